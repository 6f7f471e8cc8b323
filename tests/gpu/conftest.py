"""Every test under tests/gpu needs CUDA; without it each one skips with a reason naming CUDA.

``make test-gpu`` runs this directory; ``make test`` leaves it out (the CPU suite has the device
guard instead, see tests/test_device_guard.py)."""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: launch, tiny_model, ...


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA: torch.cuda.is_available() is False on this machine")
    for item in items:
        item.add_marker(skip)
