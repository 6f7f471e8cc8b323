"""The sections that run a subprocess of their own with a timeout, this process reading what it
wrote: the run part's ticks (``tick:<shape>``: a 256 x 256 colocated tick, run_child.py) and the
optional part's ``tests`` (``pytest tests/gpu``) and ``recipe`` (the default recipe colocated)."""

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

from gpu_check import bounds
from gpu_check.common import REPO, SHAPES, SectionFailed, Sizes, device_peaks, head_dim

SCORER = "scorers_for_tests:first_char_even"  # a random model earns reward from it: the trainer trains
RUN_CHILD = Path(__file__).resolve().parent / "run_child.py"


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




def model_root(out_dir: Path) -> Path:
    """Where a run's random-init model is written for its executors to load (and deleted after):
    /dev/shm (memory, not disk) where it exists, else ``out_dir/models``."""
    shm = Path("/dev/shm")
    root = shm / "llamarl-gpu-check" if shm.is_dir() else out_dir / "models"
    root.mkdir(parents=True, exist_ok=True)
    return root


def _run_child(name: str, spec: dict, *, out_dir: Path, timeout_s: float, **env: str) -> tuple[int, dict, Path]:
    """run_child.py over ``spec`` (its result file and run directory named by ``name``): (exit code,
    what it wrote, the log)."""
    spec_path, log = out_dir / f"{name}.spec.json", out_dir / f"{name}.log"
    spec = {**spec, "result": str(out_dir / f"{name}.child.json")}
    spec_path.write_text(json.dumps(spec, indent=2))
    code, _ = run_logged([sys.executable, str(RUN_CHILD), str(spec_path)], log=log, env=child_env(**env),
                         timeout_s=timeout_s)
    result_path = Path(spec["result"])
    return code, json.loads(result_path.read_text()) if result_path.exists() else {}, log


# ----- the run part: a GPU-shaped colocated tick -----
def tick_overrides(sizes: Sizes, run_dir: Path) -> dict:
    """The tick's ``ArithmeticConfig`` fields (run_child.apply_overrides): colocated, no evaluation
    between ticks, no export, the reward in this process, every sample to ``tick_new_tokens``."""
    return {"run.schedule": "colocated", "run.max_steps": sizes.tick_ticks, "run.eval_every": 0,
            "run.num_eval_problems": 8, "run.output_dir": str(run_dir), "export.final": False,
            "reward.num_workers": 0, "generator.num_prompts_per_step": sizes.tick_prompts,
            "generator.samples_per_prompt": sizes.tick_samples, "generator.max_new_tokens": sizes.tick_new_tokens,
            "generator.temperature": 1.0, "generator.dtype": sizes.dtype, "trainer.param_dtype": sizes.dtype,
            "trainer.max_tokens_per_microbatch": 16384, "trainer.logprob_chunk_tokens": 2048}


def tick(shape: str, sizes: Sizes, save, *, out_dir: Path, timeout_s: float) -> dict:
    """``tick:<shape>``: ``tick_prompts x tick_samples`` samples x ``tick_new_tokens`` new tokens a
    tick, colocated (llamarl's generator, reward and FSDP2 trainer in one process), on a random-init
    model of ``shape`` (every sample runs to its length): generated tokens/s and its ratio to the
    tick's memory bound (bounds.tick_bound_s at the copy bandwidth the child measured), trainer
    tokens/s and MFU, peak memory."""
    name = shape.replace(".", "_")
    run_dir = out_dir / f"tick-{name}"
    overrides = tick_overrides(sizes, run_dir)
    rows = sizes.tick_prompts * sizes.tick_samples
    result: dict = {"shape": shape, "samples": rows, "new_tokens": sizes.tick_new_tokens, "ticks": sizes.tick_ticks,
                    "scorer": SCORER, "overrides": overrides}
    save(result)
    code, child, log = _run_child(f"tick-{name}", {"shape": shape, "model_root": str(model_root(out_dir)),
                                                    "overrides": overrides, "scorer": SCORER},
                                  out_dir=out_dir, timeout_s=timeout_s)
    result.update(child)
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
                       "per_tick": {s: {k: r.get(k) for k in ("gen_tokens_per_s", "gen_seconds", "train_tokens_per_s",
                                                              "train_seconds")} for s, r in sorted(steps.items())}})
    result.update(tick_ratios(result, shape=shape, dtype=sizes.dtype))
    if (run_dir / "summary.json").exists():
        result["peak_gpu_memory_gib"] = json.loads((run_dir / "summary.json").read_text()).get("peak_gpu_memory_gib")
    if code not in (0, 124) and log.exists():  # the memory target's MISSED (checks.tick_memory_check)
        result["out_of_memory"] = "CUDA out of memory" in log.read_text(errors="replace")
    save(result)
    if code != 0:
        raise _failed(code, log, "the tick run")
    return result


def tick_ratios(result: dict, *, shape: str, dtype: str) -> dict:
    """The tick's figures over this GPU's: generated tokens/s over the tick's memory bound (its
    decode steps' weights + live KV at the measured copy bandwidth), trainer MFU over the data
    sheet's bf16 peak and over the measured GEMM rate. Missing inputs give None."""
    _, shape_fields = SHAPES[shape]
    gen, gbps, params = result.get("gen_tokens_per_s"), result.get("copy_gbps"), result.get("params")
    out: dict = {"tick_bound_tokens_per_s": None, "gen_vs_bound": None, "mfu": None, "mfu_vs_gemm": None}
    if gbps and params and result.get("prompt_tokens_mean") is not None:
        # The step's weights: tied shapes read the embedding as the LM head, untied ones not the input table.
        embedding = shape_fields["vocab_size"] * shape_fields["hidden_size"]
        weight_params = params if shape_fields["tie_word_embeddings"] else params - embedding
        seconds = bounds.tick_bound_s(
            weight_bytes=weight_params * bounds.DTYPE_BYTES[dtype], rows=result["samples"],
            prompt_tokens=result["prompt_tokens_mean"], new_tokens=result["new_tokens"],
            layers=shape_fields["num_hidden_layers"], kv_heads=shape_fields["num_key_value_heads"],
            head_dim=head_dim(shape_fields), dtype_bytes=bounds.DTYPE_BYTES[dtype], gbps=gbps)
        out["tick_bound_tokens_per_s"] = result["samples"] * (result["new_tokens"] - 1) / seconds
        out["gen_vs_bound"] = bounds.ratio(gen, out["tick_bound_tokens_per_s"])
    train = result.get("train_tokens_per_s")
    peak, _ = device_peaks(result.get("device") or "")
    if train and params:
        flops = 6 * params * train
        out["mfu"] = bounds.ratio(flops, peak * 1e12 if peak else None)
        out["mfu_vs_gemm"] = bounds.ratio(flops, result["gemm_tflops"] * 1e12 if result.get("gemm_tflops") else None)
    return out


# ----- the optional part: the default recipe -----
def recipe(sizes: Sizes, save, *, out_dir: Path, timeout_s: float, smollm2: str | None = None) -> dict:
    """The default recipe colocated (``make run``'s ticks and evaluations) with the time to 0.70
    held-out accuracy in training seconds (model load and evaluations left out, as
    benchmarks/async_speedup.py counts them): SmolLM2's weights if installed (or ``smollm2``, a
    directory), else a random-init model of its shape with a scorer it earns reward from (timing
    only: the accuracy of random weights means nothing)."""
    import async_speedup

    run_dir = out_dir / "recipe"
    overrides = {"run.schedule": "colocated", "run.max_steps": sizes.recipe_ticks,
                 "run.eval_every": sizes.recipe_eval_every, "run.output_dir": str(run_dir), "export.final": False}
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
    spec: dict = {"overrides": overrides, "scorer": None}
    if why_not is None:
        spec["model"] = model
        result.update(model=model, accuracy_meaningful=True)
    else:
        shape = "tiny" if sizes.smoke else "smollm2-135m"
        overrides["reward.num_workers"] = 0
        spec.update(shape=shape, model_root=str(model_root(out_dir)), scorer=SCORER)
        result.update(model=f"random init, {shape} shape, the tests' character tokenizer", accuracy_meaningful=False,
                      note=f"{why_not}: the recipe's pipeline with the scorer {SCORER} so the trainer has reward to "
                           "learn from; its held-out 'accuracy' is that scorer's, so only the timing means anything")
    save(result)
    launched = time.time()
    code, child, log = _run_child("recipe", spec, out_dir=out_dir, timeout_s=timeout_s)
    result.update(shims=child.get("shims"), wall_s=time.time() - launched)
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
