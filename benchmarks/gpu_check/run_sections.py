"""Sections a (``tests``), d (``recipe``) and e (``tick``): each a subprocess of its own (pytest, a
one-rank ``torchrun`` world), run with a timeout; this process reads what it wrote."""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import statistics
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

from gpu_check.common import REPO, SectionFailed, Sizes, build_model, device_peaks, num_params

SCORER = "scorers_for_tests:first_char_even"  # a random model earns reward from it: the trainer trains
RUN_MODULES = ("tyro", "tensorboard", "matplotlib")  # a recipe's configuration, metrics and timeline.png


def child_env(**extra: str) -> dict[str, str]:
    """The environment of a subprocess: this repository and tests/ importable before the caller's
    PYTHONPATH (packages installed with ``pip --target``), no hub access."""
    path = os.pathsep.join(filter(None, [str(REPO), str(REPO / "tests"), os.environ.get("PYTHONPATH")]))
    return {**os.environ, "PYTHONPATH": path, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
            "PYTHONUNBUFFERED": "1", **extra}


def run_logged(cmd: list[str], *, log: Path, env: dict[str, str], timeout_s: float) -> tuple[int, float]:
    """Run ``cmd`` from the repository root, its output into ``log``; (exit code, wall seconds).
    Past ``timeout_s`` its process group (its own session: torchrun and its ranks) is ended: 124."""
    log.parent.mkdir(parents=True, exist_ok=True)
    start = time.time()
    with log.open("w") as out:
        out.write(f"$ {shlex.join(cmd)}\n")
        out.flush()
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            code = proc.wait(timeout=max(timeout_s, 1))
        except subprocess.TimeoutExpired:
            _end(proc)
            code = 124
        except BaseException:  # Ctrl-C: its own session does not get the terminal's signal
            _end(proc)
            raise
    return code, time.time() - start


def _end(proc: subprocess.Popen) -> None:
    """End ``proc``'s process group (the session it was started in), politely first."""
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def require(*modules: str, why: str) -> None:
    """A ``SectionFailed`` naming the modules of ``modules`` this Python cannot import."""
    import importlib.util

    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    if missing:
        raise SectionFailed(f"{', '.join(missing)} not installed in {sys.executable}: {why} (offline: the wheels "
                            "recipe in docs/gpu.md, 'Checking a GPU: make gpu-check')")


def log_tail(log: Path, lines: int = 12) -> str:
    return "\n".join(log.read_text(errors="replace").splitlines()[-lines:]) if log.exists() else ""


def _failed(code: int, log: Path, what: str) -> SectionFailed:
    if code == 124:
        return SectionFailed(f"{what} timed out (killed); log: {log}", status="timeout")
    return SectionFailed(f"{what} exited {code}; the end of {log}:\n{log_tail(log)}")


# ----- a. tests/gpu -----
_OUTCOME = re.compile(r"^(\S+::\S+)\s+(PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)\b", re.MULTILINE)
_SUMMARY = re.compile(r"^=+ (.*?) in [\d.]+s(?: \([^)]*\))? =+$", re.MULTILINE)
_SHORT = re.compile(r"^(FAILED|ERROR) (\S+)(?: - (.*))?$", re.MULTILINE)
_SKIP = re.compile(r"^SKIPPED \[\d+\] ([^:]+(?::\d+)?): (.*)$", re.MULTILINE)


def parse_pytest(text: str) -> dict:
    """Counts and names from ``pytest -v -rfEs`` output (complete or cut short by a timeout)."""
    outcomes: dict[str, str] = {}
    for name, outcome in _OUTCOME.findall(text):
        if outcomes.get(name) not in ("FAILED", "ERROR"):  # a teardown ERROR after PASSED stays an error
            outcomes[name] = outcome
    counts = {k.lower(): v for k, v in Counter(outcomes.values()).items()}
    summary = _SUMMARY.findall(text)
    if summary:  # pytest's own final line, when it got there
        counts = {word.rstrip("s") if word in ("errors", "warnings") else word: int(n)
                  for n, word in re.findall(r"(\d+) (\w+)", summary[-1])}
    reasons = {name: reason for _, name, reason in _SHORT.findall(text)}
    failures = sorted({n for n, o in outcomes.items() if o in ("FAILED", "ERROR")} | set(reasons))
    return {"counts": {k: counts.get(k, 0) for k in ("passed", "failed", "error", "skipped")} | counts,
            "failures": [{"test": n, "reason": reasons.get(n, "")} for n in failures],
            "skip_reasons": sorted({f"{where}: {why}" for where, why in _SKIP.findall(text)}),
            "complete": bool(summary)}


def tests(sizes: Sizes, save, *, out_dir: Path, timeout_s: float) -> dict:
    require("pytest", why="it runs tests/gpu")
    log = out_dir / "tests.log"
    cmd = [sys.executable, "-m", "pytest", "-v", "-rfEs", "-p", "no:cacheprovider", "tests/gpu"]
    code, seconds = run_logged(cmd, log=log, env=child_env(OMP_NUM_THREADS="1"), timeout_s=timeout_s)
    result = {**parse_pytest(log.read_text(errors="replace")), "returncode": code, "seconds": seconds}
    save(result)
    if code == 124:
        raise SectionFailed(f"pytest tests/gpu timed out after {timeout_s:.0f} s (the counts are the tests that "
                            f"finished); log: {log}", status="timeout")
    if not result["complete"] and code not in (0, 1):
        raise _failed(code, log, "pytest tests/gpu")
    return result


# ----- the models the runs load -----
def random_model_dir(out_dir: Path, shape: dict) -> Path:
    """A random-init Llama of ``shape`` (bf16 safetensors) with the tests' character tokenizer,
    saved once under ``out_dir/models``; ``num_params.json`` beside it."""
    from tiny_model import tiny_tokenizer  # tests/ (on sys.path: gpu_check.cli)

    directory = out_dir / "models" / f"random-{shape['hidden_size']}x{shape['num_hidden_layers']}"
    if (directory / "num_params.json").exists():
        return directory
    import torch

    model = build_model(shape, dtype="float32", device="cpu")
    tokenizer = tiny_tokenizer()
    model.config.eos_token_id, model.config.pad_token_id = tokenizer.eos_token_id, tokenizer.pad_token_id
    model.to(torch.bfloat16).save_pretrained(directory, safe_serialization=True)
    tokenizer.save_pretrained(directory)
    (directory / "num_params.json").write_text(json.dumps({"num_params": num_params(model)}))
    return directory


def _torchrun(*target: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1", *target]


def _metrics_by_step(run_dir: Path) -> dict[int, dict]:
    """Every executor's metrics of each tick, merged (a colocated run writes one file per stage)."""
    steps: dict[int, dict] = {}
    for path in sorted((run_dir / "metrics").glob("*.jsonl")):
        for line in path.read_text().splitlines():
            if line.strip():
                record = json.loads(line)
                steps.setdefault(record["step"], {}).update(record)
    return steps


def _first_tick_start(run_dir: Path) -> float | None:
    spans = [s for f in sorted((run_dir / "timeline").glob("rank*.json")) for s in json.loads(f.read_text())]
    return min((s["start"] for s in spans if s.get("step") == 0 and s.get("kind", "step") == "step"), default=None)


# ----- d. the default recipe -----
def recipe(sizes: Sizes, save, *, out_dir: Path, timeout_s: float, smollm2: str | None = None) -> dict:
    """The default recipe colocated (module docstring of gpu_check); SmolLM2's weights if installed
    (or ``smollm2``, a directory), else a random-init model of its shape with a scorer it earns
    reward from (timing only)."""
    import async_speedup

    require(*RUN_MODULES, why="a recipe run needs them")
    deadline = time.time() + timeout_s
    run_dir, log = out_dir / "recipe", out_dir / "recipe.log"
    flags = ["--run.schedule", "colocated", "--run.max-steps", str(sizes.recipe_ticks), "--run.eval-every",
             str(sizes.recipe_eval_every), "--run.output-dir", str(run_dir), "--export.no-final"]
    result: dict = {"ticks": sizes.recipe_ticks, "eval_every": sizes.recipe_eval_every}
    model, why_not = smollm2, None
    if model is None and sizes.smoke:
        why_not = "--smoke: a tiny random model"
    elif model is None:
        try:
            from llamarl.models.loading import SMOLLM2_ALIAS, resolve_model_path

            model = str(resolve_model_path(SMOLLM2_ALIAS))
        except Exception as error:  # noqa: BLE001 - the package or gguf missing: the fallback below
            why_not = f"SmolLM2's weights are not usable here ({type(error).__name__}: {error})"
    env = child_env()
    if why_not is None:
        cmd = _torchrun("-m", "recipes.arithmetic", *flags, "--model.name", model)
        result.update(model=model, accuracy_meaningful=True)
    else:
        shape = sizes.shape
        cmd = _torchrun(str(REPO / "tests" / "worlds" / "e2e_arithmetic.py"), *flags, "--model.name",
                        str(random_model_dir(out_dir, shape)), "--reward.num-workers", "0")
        env["LLAMARL_TEST_SCORER"] = SCORER
        result.update(model=f"random init, {shape['hidden_size']} x {shape['num_hidden_layers']} layers "
                            f"(SmolLM2-135M's shape{' scaled down' if sizes.smoke else ''}), the tests' character tokenizer",
                      accuracy_meaningful=False,
                      note=f"{why_not}: the recipe's pipeline (tests/worlds/e2e_arithmetic.py) with the scorer {SCORER} "
                           "so the trainer has reward to learn from; its held-out 'accuracy' is that scorer's, "
                           "so only the timing means anything")
    result["command"] = shlex.join(cmd)
    save(result)
    launched = time.time()
    code, seconds = run_logged(cmd, log=log, env=env, timeout_s=deadline - time.time())
    result["wall_s"] = seconds
    if (run_dir / "summary.json").exists():
        summary = json.loads((run_dir / "summary.json").read_text())
        accuracy = async_speedup.measure_accuracy(run_dir, 0.70)
        first = _first_tick_start(run_dir)
        # Tick durations with the ticks around an evaluation replaced by the run's median (async_speedup).
        train = async_speedup.training_seconds(run_dir, [e["step"] for e in summary.get("evals", [])
                                                         if 0 < e["step"] != summary.get("num_steps")])
        ticks = [train[k + 1] - train[k] for k in sorted(train) if k + 1 in train]
        result.update({
            "base_accuracy": summary.get("base_accuracy"), "final_accuracy": summary.get("final_accuracy"),
            "evals": accuracy["evals"], "seconds_to_0.70": accuracy["time_to_target_s"],
            "wall_to_0.70": accuracy["wall_to_target_s"], "steps_to_0.70": accuracy["steps_to_target"],
            "launch_to_first_tick_s": None if first is None else first - launched,
            "tick_median_s": statistics.median(ticks) if ticks else None,
            "gen_tokens_per_s_mean": summary.get("gen_tokens_per_s_mean"),
            "train_tokens_per_s_mean": summary.get("train_tokens_per_s_mean"),
            "peak_gpu_memory_gib": summary.get("peak_gpu_memory_gib"), "run_dir": str(run_dir)})
    save(result)
    if code != 0:
        raise _failed(code, log, "the recipe run")
    return result


# ----- e. a GPU-shaped tick -----
def tick(sizes: Sizes, save, *, out_dir: Path, timeout_s: float) -> dict:
    """256 samples x 256 new tokens a tick, colocated, on a random-init model of SmolLM2's shape
    (every sample runs to its length): generation and trainer tokens/s, MFU, peak memory."""
    import torch

    require(*RUN_MODULES, why="a recipe run needs them")
    deadline = time.time() + timeout_s
    run_dir, log = out_dir / "tick", out_dir / "tick.log"
    model_dir = random_model_dir(out_dir, sizes.shape)
    params = json.loads((model_dir / "num_params.json").read_text())["num_params"]
    cmd = _torchrun(str(REPO / "tests" / "worlds" / "e2e_arithmetic.py"), "--model.name", str(model_dir),
                    "--run.schedule", "colocated", "--run.max-steps", str(sizes.tick_ticks), "--run.eval-every", "0",
                    "--run.num-eval-problems", "8", "--run.output-dir", str(run_dir), "--export.no-final",
                    "--reward.num-workers", "0", "--generator.num-prompts-per-step", str(sizes.tick_prompts),
                    "--generator.samples-per-prompt", str(sizes.tick_samples), "--generator.max-new-tokens",
                    str(sizes.tick_new_tokens), "--generator.temperature", "1.0",
                    "--trainer.max-tokens-per-microbatch", "16384", "--trainer.logprob-chunk-tokens", "2048")
    name = torch.cuda.get_device_name() if sizes.device.startswith("cuda") else "cpu"
    peak_tflops, _ = device_peaks(name)
    result: dict = {"samples": sizes.tick_prompts * sizes.tick_samples, "new_tokens": sizes.tick_new_tokens,
                    "ticks": sizes.tick_ticks, "params": params, "device": name, "peak_bf16_tflops": peak_tflops,
                    "scorer": SCORER, "command": shlex.join(cmd)}
    save(result)
    code, seconds = run_logged(cmd, log=log, env=child_env(LLAMARL_TEST_SCORER=SCORER),
                               timeout_s=deadline - time.time())
    result["wall_s"] = seconds
    steps = _metrics_by_step(run_dir) if (run_dir / "metrics").is_dir() else {}
    if steps:
        # Tick 0 captures the graphs (and the trainer's first step warms up): the later ticks are steady.
        steady = [r for s, r in sorted(steps.items()) if s >= 1] or list(steps.values())

        def median(key):
            values = [r[key] for r in steady if key in r]
            return statistics.median(values) if values else None

        result.update({"steady_ticks": len(steady), "gen_tokens_per_s": median("gen_tokens_per_s"),
                       "gen_new_tokens": median("gen_new_tokens"), "gen_seconds": median("gen_seconds"),
                       "train_tokens_per_s": median("train_tokens_per_s"), "train_seconds": median("train_seconds"),
                       "per_tick": {s: {k: r.get(k) for k in ("gen_tokens_per_s", "gen_seconds", "gen_new_tokens",
                                                              "train_tokens_per_s", "train_seconds")}
                                    for s, r in sorted(steps.items())}})
        train = result["train_tokens_per_s"]
        result["mfu"] = 6 * params * train / (peak_tflops * 1e12) if train and peak_tflops else None
        if peak_tflops is None:
            result["mfu_note"] = f"no bf16 peak known for {name!r} (gpu_check/common.py DEVICE_PEAKS)"
    if (run_dir / "summary.json").exists():
        result["peak_gpu_memory_gib"] = json.loads((run_dir / "summary.json").read_text()).get("peak_gpu_memory_gib")
    save(result)
    if code != 0:
        raise _failed(code, log, "the tick run")
    return result
