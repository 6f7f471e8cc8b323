"""What the test modules share: import paths, the tiny model, benchmark modules, row batches.

- ``tests/`` and ``tests/worlds/`` are importable (``launch``, ``tiny_model``, ``taps``, ...).
- ``model_dir`` (session): a tiny random Llama with its character tokenizer, built once per pytest
  process (each xdist worker) and read-only; a test that needs another model builds its own.
- ``load_benchmark(name)``: a ``benchmarks/<name>.py`` script as a module (they are scripts, not a
  package, and import each other by name).
- ``TRITON_INTERPRET=1`` where no CUDA device is: Triton kernels run by its interpreter.
- ``rows_batch(rows, width=...)``: a ``TensorBatch`` of (prompt, completion) token rows with the
  trainer's fields (``input_ids``, ``loss_mask`` on the completion, ``num_tokens``).
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

# Triton kernels run here on the CPU through Triton's interpreter (tests/test_triton_kernels.py).
# Triton reads the choice when it is first imported (its own library functions are decorated then),
# so it is made before any test imports it; where CUDA runs the tests (tests/gpu) it compiles them.
if not torch.cuda.is_available():
    import os

    os.environ.setdefault("TRITON_INTERPRET", "1")

TESTS = Path(__file__).resolve().parent
BENCH = TESTS.parent / "benchmarks"
for path in (TESTS, TESTS / "worlds"):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

from llamarl.runtime.batch import TensorBatch


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory):
    """The tiny random Llama (untied) and its tokenizer, saved once for the session."""
    from tiny_model import save_tiny_model

    return save_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


def load_benchmark(name: str):
    """``benchmarks/<name>.py`` imported as module ``name`` (once; later calls return the same)."""
    if name in sys.modules:
        return sys.modules[name]
    if str(BENCH) not in sys.path:
        sys.path.insert(0, str(BENCH))  # async_quality imports async_speedup by name
    spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def rows_batch(rows: list[tuple[list[int], list[int]]], *, width: int | None = None) -> TensorBatch:
    """``rows`` of (prompt ids, completion ids) right-padded to ``width`` (default: the longest row
    + 1): ``input_ids``, ``loss_mask`` (1 on completion tokens, uint8) and ``num_tokens``."""
    width = width or max(len(p) + len(c) for p, c in rows) + 1
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    loss_mask = torch.zeros(len(rows), width, dtype=torch.uint8)
    for r, (p, c) in enumerate(rows):
        ids[r, : len(p) + len(c)] = torch.tensor(p + c)
        loss_mask[r, len(p): len(p) + len(c)] = 1
    return TensorBatch({"input_ids": ids, "loss_mask": loss_mask,
                        "num_tokens": torch.tensor([len(p) + len(c) for p, c in rows])})


def read_jsonl(path: Path) -> list[dict]:
    """The records of a JSON-lines file (a run's metrics, evaluation samples); [] when it is absent."""
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


# ----- `make test-fast`: the tests that start no process ---------------------------------------
# A test is marked ``world`` when it starts processes (a torchrun world, a recipe, a subprocess):
# its own source, a fixture it uses, or a module-level helper it calls (transitively) contains one
# of LAUNCHES. ``pytest -m "not world"`` (make test-fast) runs the rest: the unit tests.
LAUNCHES = ("run_torchrun(", "run_colocated_runs(", "subprocess.", "torch.distributed.run")


def _world_helpers(module) -> set[str]:
    """Names of ``module``'s functions that start processes, directly or through each other."""
    import inspect

    sources = {}
    for name, obj in vars(module).items():
        if inspect.isfunction(obj) and obj.__module__ == module.__name__:
            try:
                sources[name] = inspect.getsource(obj)
            except (OSError, TypeError):
                continue
    found = {name for name, src in sources.items() if any(launch in src for launch in LAUNCHES)}
    while True:
        more = {name for name, src in sources.items() if name not in found and any(f"{h}(" in src for h in found)}
        if not more:
            return found
        found |= more


# The files of the CPU suite that take longest (an idle 2-core run, slowest first): scheduled first.
SLOW_FIRST = ("test_task_recipe.py", "test_checkpoint_faults.py", "test_colocated.py", "test_e2e.py",
              "test_episodes_pipeline.py", "test_ref_kl.py", "test_model_families.py", "test_kill_resume.py",
              "test_default_model.py", "test_static_decode.py", "test_launch_scripts.py", "test_benchmarks_smoke.py")


def pytest_configure(config):
    config.addinivalue_line("markers", "world: starts processes (torchrun worlds, recipes, subprocesses)")


def pytest_collection_modifyitems(config, items):
    import inspect

    helpers: dict[str, set[str]] = {}
    for item in items:
        module = getattr(item, "module", None)
        if module is None:
            continue
        if module.__name__ not in helpers:
            helpers[module.__name__] = _world_helpers(module)
        names = helpers[module.__name__]
        functions = [item.function]
        for defs in getattr(item, "_fixtureinfo", None).name2fixturedefs.values() if hasattr(item, "_fixtureinfo") else []:
            functions += [d.func for d in defs]
        for function in functions:
            try:
                src = inspect.getsource(function)
            except (OSError, TypeError):
                continue
            if any(launch in src for launch in LAUNCHES) or any(f"{h}(" in src for h in names):
                item.add_marker(pytest.mark.world)
                break
    # The slowest files first: `make test` hands whole files to its two workers in collection
    # order (xdist's loadfile), so a slow file collected late (they are alphabetical) ran alone at
    # the end while the other worker idled. Longest first, the tail is the small files. Stable:
    # the rest keep their order (every worker collects the same order, as xdist requires).
    rank = {name: i for i, name in enumerate(SLOW_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(SLOW_FIRST)))
