"""One recipe run in this process, configured without a command line: the run part's tick and the
optional recipe section. ``python benchmarks/gpu_check/run_child.py SPEC.json``.

Why not ``torchrun -m recipes.arithmetic``: a GPU machine's Python may lack tyro (the recipes parse
their flags with it), tensorboard and matplotlib (the run's scalars and timeline picture); the
check needs none of them. Where one is missing this process stands in for it (``shims``, recorded
in the result): tyro's ``cli`` is never called, TensorBoard's writer drops scalars, the timeline
picture is not drawn (its JSON spans and the metrics JSONL are written as always). The world is one
rank, made by the run itself (RANK 0 of 1, a free port), as ``tests/worlds/colocated_runs.py`` does.

SPEC (JSON): ``overrides`` (dotted ``ArithmeticConfig`` fields -> values, e.g. ``"run.schedule":
"colocated"``), ``scorer`` (a ``module:function`` the run trains on instead of the recipe's, or
null), ``model`` (a directory) or ``shape`` (a ``common.SHAPES`` name: a random-init model built on
the device in bf16 and saved with the tests' character tokenizer under ``model_root``, deleted
after the run: the recipe's executors load from safetensors, there is no way to hand them a
model), ``result`` (where this process writes what it measured besides the run directory).
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import socket
import sys
import time
import types
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != HERE]
sys.path.insert(0, str(HERE.parent))

from gpu_check.common import REPO  # after the path fix; it puts the repository on sys.path

if str(REPO / "tests") not in sys.path:
    sys.path.append(str(REPO / "tests"))  # tiny_model, scorers_for_tests


def install_shims() -> list[str]:
    """Stand in for tyro, tensorboard and matplotlib where this Python lacks them (module docstring);
    the names of those stood in for."""
    shims = []
    if importlib.util.find_spec("tyro") is None:
        tyro = types.ModuleType("tyro")

        def cli(*args, **kwargs):
            raise RuntimeError("tyro is not installed: gpu-check's run_child configures the run without it")

        tyro.cli = cli
        sys.modules["tyro"] = tyro
        shims.append("tyro")
    if importlib.util.find_spec("tensorboard") is None:
        board = types.ModuleType("torch.utils.tensorboard")

        class SummaryWriter:
            def __init__(self, *args, **kwargs) -> None:
                pass

            def add_scalar(self, *args, **kwargs) -> None:
                pass

            def flush(self) -> None:
                pass

            def close(self) -> None:
                pass

        board.SummaryWriter = SummaryWriter
        sys.modules["torch.utils.tensorboard"] = board
        shims.append("tensorboard")
    if importlib.util.find_spec("matplotlib") is None:
        import llamarl.run.summary

        llamarl.run.summary.write_timeline_png = lambda run_dir, spans, **kwargs: None
        shims.append("matplotlib")
    return shims


def apply_overrides(config, overrides: dict) -> None:
    """Set each dotted field of ``overrides`` on ``config`` (nested dataclasses); a ValueError
    names a field that does not exist."""
    for dotted, value in overrides.items():
        *path, last = dotted.split(".")
        target = config
        for part in path:
            if not hasattr(target, part):
                raise ValueError(f"no config section {dotted!r}")
            target = getattr(target, part)
        if not hasattr(target, last):
            raise ValueError(f"no config field {dotted!r}")
        setattr(target, last, value)


def write_random_model(shape: str, root: Path) -> tuple[Path, int]:
    """A random-init model of ``shape`` built on the device (bf16) and saved with the tests'
    character tokenizer under ``root``; (its directory, its parameter count)."""
    import torch
    from tiny_model import tiny_tokenizer

    from gpu_check.common import build_model, num_params

    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = "bfloat16" if device == "cuda" else "float32"
    model = build_model(shape, dtype=dtype, device=device)
    tokenizer = tiny_tokenizer()
    model.config.eos_token_id, model.config.pad_token_id = tokenizer.eos_token_id, tokenizer.pad_token_id
    directory = root / f"random-{shape}-{os.getpid()}"
    model.save_pretrained(directory, safe_serialization=True)
    tokenizer.save_pretrained(directory)
    params = num_params(model)
    del model
    if device == "cuda":
        torch.cuda.empty_cache()
    return directory, params


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(spec_path: str) -> int:
    spec = json.loads(Path(spec_path).read_text())
    result_path = Path(spec["result"])
    result: dict = {"shims": install_shims()}

    def save():
        result_path.write_text(json.dumps(result, indent=2, default=str))

    import torch

    from gpu_check.probes import copy_bandwidth_gbps, gemm_tflops

    device = "cuda" if torch.cuda.is_available() else "cpu"
    small = device == "cpu"
    result["device"] = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    if device == "cuda":
        result["device_memory_gib"] = torch.cuda.get_device_properties(0).total_memory / 2**30
    result["copy_gbps"] = copy_bandwidth_gbps(device, 1 << (22 if small else 30))
    result["gemm_tflops"] = gemm_tflops(device, 128 if small else 8192)
    save()
    made = None
    try:
        model = spec.get("model")
        if model is None:
            start = time.perf_counter()
            made, result["params"] = write_random_model(spec["shape"], Path(spec["model_root"]))
            model, result["model_write_s"] = str(made), time.perf_counter() - start
            save()
        from llamarl.rl.arithmetic_task import arithmetic_task
        from llamarl.rl.standard_pipeline import run_rl
        from recipes.arithmetic import ArithmeticConfig
        from recipes.arithmetic import main as recipe_main

        config = ArithmeticConfig()
        apply_overrides(config, {**spec["overrides"], "model.name": model})
        scorer = spec.get("scorer")
        task = arithmetic_task(config) if scorer is None else arithmetic_task(config, scorer=scorer)
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(model)
        lengths = [len(task.prompt_fn(tokenizer, task.sample(i).question)) for i in range(64)]
        result["prompt_tokens_mean"] = sum(lengths) / len(lengths)
        save()
        os.environ.update({"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1",
                           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port())})
        if scorer is None:  # the recipe itself, as `torchrun -m recipes.arithmetic` runs it
            recipe_main(config)
        else:  # its pipeline trained on ``scorer`` (tests/worlds/e2e_arithmetic.py's LLAMARL_TEST_SCORER)
            run_rl(config, task, recipe="arithmetic")
    finally:
        if made is not None:
            shutil.rmtree(made, ignore_errors=True)
        save()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
