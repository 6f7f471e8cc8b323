"""Every test under tests/gpu needs CUDA; without it each one skips with a reason naming CUDA.

``make test-gpu`` runs this directory; ``make test`` leaves it out (the CPU suite has the device
guard instead, see tests/test_device_guard.py)."""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: launch, tiny_model, ...


_GPU_DIR = Path(__file__).resolve().parent


def pytest_collection_modifyitems(config, items):
    # This hook sees every item of the session (`pytest tests` collects the CPU suite too), so the
    # skip is scoped to the items that live under tests/gpu.
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA: torch.cuda.is_available() is False on this machine")
    for item in items:
        if _GPU_DIR in Path(str(item.fspath)).resolve().parents:
            item.add_marker(skip)
