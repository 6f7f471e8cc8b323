"""Asynchrony that pays? colocated vs sync vs async (lag 1, lag 2, partial rollouts) on the same cores.

    .venv/bin/python benchmarks/async_speedup.py                          # speed: both workloads, every schedule
    .venv/bin/python benchmarks/async_speedup.py --workloads arithmetic --accuracy --variants
    .venv/bin/python benchmarks/async_speedup.py --ticks 3 --workloads arithmetic --schedules colocated,async-lag1

Prints a markdown table; writes ``<out>/async_speedup.json`` and ``<out>/async_speedup.png`` (default
``--out runs/async_speedup``; every run's directory, log and command are under ``<out>/<workload>/<run>/``).

Every run is one ``python -m torch.distributed.run --standalone --nproc-per-node N -m recipes.<recipe>``
subprocess on the same model (``smollm2-135m-instruct``), data, batch, seed and total cores, with
``OMP_NUM_THREADS`` pinned. Schedules (``--schedules``), and the torch threads each busy executor gets
(the cores idle at that moment; recorded per run in the JSON):

| name | ranks | flags | threads |
|---|---|---|---|
| ``colocated`` | 1 | ``--run.schedule colocated`` | 2 for whichever phase runs |
| ``sync`` | 3 | ``--run.schedule sync`` | generator 2, trainer 2 (one busy at a time) |
| ``async-lag1`` | 3 | ``--run.schedule async --run.async-lag 1`` | generator 1, trainer 1 (``--async-threads``) |
| ``async-lag2`` | 3 | ``--run.schedule async --run.async-lag 2`` (Algorithm 1 as written) | same |
| ``async-lag1-partial`` | 3 | lag 1 + ``--generator.token-budget B`` (partial rollouts) | same |
| ``async-lag1-partial-keep`` | 3 | the same + ``--generator.torch.carried-cache keep`` (carried samples keep their KV cache) | same |

The reward rank scores in ``--reward.num-workers 1`` process (the recipes' default) everywhere.
``--variants`` adds ``async-lag1`` runs with ``--algo.loss decoupled_ppo --trainer.num-minibatches 4``
and ``--algo.prox recompute`` vs ``loglinear`` (A-3PO); with fixed micro-batches of 8 rows
(``--trainer.microbatch-rows 8``) vs the default dynamic micro-batching; and with
``--trainer.no-share-prompts`` (each sample's prompt forwarded on its own); skipped, with a line saying
so, when the recipe has no ``--trainer.num-minibatches``.

Workloads (``--workloads``): ``arithmetic`` = ``recipes.arithmetic`` defaults (``make run``'s task:
16 prompts x 4 samples, 12 new tokens, short answers, train-heavy); ``gsm8k`` = ``recipes.gsm8k
cpu-smoke --data.path ../shared/data/gsm8k/train.jsonl`` with ``--gsm8k-prompts`` x ``--gsm8k-samples``
samples of up to ``--gsm8k-max-new-tokens`` (256) tokens: long-tail lengths, generation-heavy.
Note: SmolLM2-135M rarely solves a GSM8K problem, and the trainer skips a batch whose groups all
scored alike (no gradient), so on gsm8k most trainer ticks do no work; ``trained_ticks`` says how
many did, and the per-phase times show it.

Measured per run (speed runs: no evaluation, no export): the tick time is the difference of
consecutive ``time`` stamps of ``metrics/generator.jsonl`` (every schedule writes it; all executors
tick in lock-step), median over ticks after the first ``--warmup``; samples/s and generated
tokens/s are the sums of ``gen_emitted_samples`` / ``gen_new_tokens`` over those ticks divided by
their total time (with partial rollouts the samples finished per tick vary). Phases per tick:
busy ``step`` spans of each executor in ``timeline/rank*.json`` (colocated: the ``gen_seconds`` /
``reward_seconds`` / ``train_seconds`` metrics of its one step), medians over the same ticks.

LlamaRL §7 model (the speed-up asynchrony can buy, from the measured per-phase times): with sync's
per-tick busy seconds g (generate), r (score), t (train), all at sync's threads,

    T_sync = g + r + t,   T_async = max(g, r, t)   =>   S_model = (g + r + t) / max(g, r, t)

i.e. every executor keeps the cores it had in sync (its own GPUs, in the paper). On a fixed core
budget the async executors share the cores, so the table also gives ``S_split = (g + r + t) /
max(g_a, r_a, t_a)`` with g_a, r_a, t_a measured in that async run itself (fewer threads each):
the speed-up a perfect overlap would reach with those threads. ``S_measured`` = sync tick / async
tick. Speed-ups vs colocated and vs sync are ratios of steady-state samples/s.

``--accuracy`` (arithmetic only): every schedule again for ``--accuracy-ticks`` (40) ticks with
``--run.eval-every 5`` on the 100 held-out problems, and the single-process loop a user could write
(``benchmarks/single_process_loop.py``: HF ``generate``, group-normalised REINFORCE, fp32 AdamW lr
1e-5, temperature 1.0, same prompts and held-out problems, 2 threads). Time to ``--target`` (0.70)
greedy accuracy is the training time up to the first evaluation reaching it, model load and
evaluations excluded: the tick durations from the time stamps, with the two ticks around each
earlier evaluation (which runs between ticks on the evaluating rank, overlapping the other
executors under async) replaced by the run's median untouched tick (``training_seconds``); the
loop's own step seconds. Also the wall time from ``summary["evals"]`` (load + evaluations included).

The JSON records the exact command of every run, ``uptime`` at the start, between runs and at the
end (the machine may be shared: compare only runs made under similar load) and ``os.cpu_count()``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PYTHON = REPO / ".venv" / "bin" / "python"
GSM8K_DATA = "../shared/data/gsm8k/train.jsonl"  # relative to the repo root (the runs' cwd)
SCHEDULES = ("colocated", "sync", "async-lag1", "async-lag2", "async-lag1-partial", "async-lag1-partial-keep")
WORKLOADS = ("arithmetic", "gsm8k")
VARIANTS = {  # name -> extra flags, run on the async-lag1 schedule
    "async-lag1+dppo-recompute-mb4": ["--algo.loss", "decoupled_ppo", "--algo.prox", "recompute",
                                      "--trainer.num-minibatches", "4"],
    "async-lag1+dppo-loglinear-mb4": ["--algo.loss", "decoupled_ppo", "--algo.prox", "loglinear",
                                      "--trainer.num-minibatches", "4"],
    # Fixed micro-batches of 8 rows (verl's ppo_micro_batch_size_per_gpu) vs the default dynamic
    # micro-batching under a token budget (verl's use_dynamic_bsz).
    "async-lag1+fixed-mb8": ["--trainer.microbatch-rows", "8"],
    # Every sample forwarded with its own copy of the prompt (the trainer's share-prompts off).
    "async-lag1+per-row": ["--trainer.no-share-prompts"],
}
PHASES = ("gen", "reward", "train")


# ----- what to run -----
@dataclass
class RunSpec:
    """One subprocess: a schedule (or variant) of a workload."""

    name: str
    workload: str
    schedule: str
    nproc: int
    gen_threads: int
    train_threads: int
    flags: list[str] = field(default_factory=list)

    @property
    def omp_threads(self) -> int:
        return max(self.gen_threads, self.train_threads)


def parse_threads(text: str) -> tuple[int, int]:
    """``"1,1"`` -> (generator threads, trainer threads)."""
    try:
        gen, train = (int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected GEN,TRAIN thread counts, got {text!r}") from None
    if gen < 1 or train < 1:
        raise argparse.ArgumentTypeError(f"thread counts must be >= 1, got {text!r}")
    return gen, train


def csv_choices(choices):
    def parse(text: str) -> list[str]:
        items = [x.strip() for x in text.split(",") if x.strip()]
        bad = [x for x in items if x not in choices]
        if bad or not items:
            raise argparse.ArgumentTypeError(f"unknown {bad or text!r}; choose from {', '.join(choices)}")
        return items
    return parse


def run_spec(name: str, workload: str, args) -> RunSpec:
    """The schedule ``name`` (or a variant of async-lag1) of ``workload`` with its threads and flags."""
    cores = args.cores
    agen, atrain = args.async_threads
    budget = args.token_budget or {"arithmetic": 6, "gsm8k": 128}[workload]
    if name == "colocated":
        return RunSpec(name, workload, "colocated", 1, cores, cores, ["--run.schedule", "colocated"])
    if name == "sync":
        return RunSpec(name, workload, "sync", 3, cores, cores, ["--run.schedule", "sync"])
    if name in ("async-lag1", "async-lag2"):
        return RunSpec(name, workload, "async", 3, agen, atrain,
                       ["--run.schedule", "async", "--run.async-lag", name[-1]])
    if name in ("async-lag1-partial", "async-lag1-partial-keep"):
        keep = ["--generator.torch.carried-cache", "keep"] if name.endswith("keep") else []
        return RunSpec(name, workload, "async", 3, agen, atrain,
                       ["--run.schedule", "async", "--run.async-lag", "1", "--generator.token-budget", str(budget), *keep])
    if name in VARIANTS:
        return RunSpec(name, workload, "async", 3, agen, atrain,
                       ["--run.schedule", "async", "--run.async-lag", "1", *VARIANTS[name]])
    raise ValueError(f"unknown schedule {name!r}")


def recipe_args(workload: str, args) -> list[str]:
    """``-m recipes.<recipe> ...`` of a workload (recipe defaults, plus the gsm8k sizes)."""
    if workload == "arithmetic":
        return ["-m", "recipes.arithmetic"]
    return ["-m", "recipes.gsm8k", "cpu-smoke", "--data.path", GSM8K_DATA,
            "--generator.num-prompts-per-step", str(args.gsm8k_prompts),
            "--generator.samples-per-prompt", str(args.gsm8k_samples),
            "--generator.max-new-tokens", str(args.gsm8k_max_new_tokens), "--eval.pass-k"]


def command(spec: RunSpec, run_dir: Path, args, *, ticks: int, eval_every: int = 0, heldout: int = 0) -> list[str]:
    return [str(PYTHON), "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(spec.nproc),
            *recipe_args(spec.workload, args), *spec.flags,
            # The split these measurements were taken with (generator, reward, trainer: a rank each);
            # the default since 2026-11-23 runs the reward on the trainer's ranks.
            *(["--reward.num-ranks", "1"] if spec.nproc == 3 else []),
            "--generator.num-threads", str(spec.gen_threads), "--trainer.num-threads", str(spec.train_threads),
            "--run.max-steps", str(ticks), "--run.seed", str(args.seed), "--run.output-dir", str(run_dir),
            "--run.eval-every", str(eval_every), "--run.num-eval-problems", str(heldout), "--export.no-final"]


def subprocess_env(threads: int) -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads),
            "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}


def uptime() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True, check=False).stdout.strip()


def cpu_model() -> str:
    """The host CPU's model name: how phases scale with threads (and so which schedule wins on a
    fixed core budget) differs between CPU models of the same machine kind."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def flag_available(workload: str, flag: str, args) -> bool:
    """Whether ``recipes.<workload> --help`` lists ``flag`` (another engineer may still be adding it)."""
    cmd = [str(PYTHON), *recipe_args(workload, args)[:2 if workload == "arithmetic" else 3], "--help"]
    out = subprocess.run(cmd, cwd=REPO, env=subprocess_env(1), capture_output=True, text=True, check=False)
    return flag in out.stdout


def launch(cmd: list[str], run_dir: Path, *, threads: int, timeout_s: float) -> tuple[int, float]:
    """Run ``cmd`` from the repo root with its output in ``run_dir/log.txt``; (return code, wall seconds)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "command.txt").write_text(shlex.join(cmd) + "\n")
    start = time.time()
    with (run_dir / "log.txt").open("w") as log:
        proc = subprocess.Popen(cmd, cwd=REPO, env=subprocess_env(threads), stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            code = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 15)  # our own process group only (torchrun and its ranks)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, 9)
                proc.wait()
            code = 124
    return code, time.time() - start


def log_tail(run_dir: Path, lines: int = 15) -> str:
    path = run_dir / "log.txt"
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:]) if path.exists() else ""


# ----- reading a run -----
def read_jsonl(path: Path) -> dict[int, dict]:
    """step -> record (the last line of a step wins)."""
    if not path.exists():
        return {}
    return {r["step"]: r for r in map(json.loads, filter(None, path.read_text().splitlines()))}


def tick_durations(records: dict[int, dict]) -> dict[int, float]:
    """step k -> time[k] - time[k-1] (seconds of tick k), from the metrics' wall stamps."""
    return {k: records[k]["time"] - records[k - 1]["time"] for k in sorted(records) if k - 1 in records}


def steady_steps(durations: dict[int, float], warmup: int) -> list[int]:
    """The ticks after the first ``warmup`` (all measurable ticks when none are left)."""
    steps = [k for k in sorted(durations) if k >= warmup]
    return steps or sorted(durations)


def span_phases(spans: list[dict]) -> dict[int, dict[str, float]]:
    """step -> {executor: busy seconds} from timeline spans (``kind`` step; max over an executor's ranks)."""
    busy: dict[tuple[int, str, int], float] = {}
    for s in spans:
        if s.get("kind", "step") != "step":
            continue
        key = (s["step"], s["executor"], s["rank"])
        busy[key] = busy.get(key, 0.0) + s["end"] - s["start"]
    out: dict[int, dict[str, float]] = {}
    for (step, executor, _), seconds in busy.items():
        out.setdefault(step, {})[executor] = max(out.get(step, {}).get(executor, 0.0), seconds)
    return out


def phase_seconds(run_dir: Path, steps: list[int]) -> dict[str, float]:
    """Median busy seconds per tick of gen / reward / train over ``steps``."""
    names = {"generator": "gen", "reward": "reward", "trainer": "train"}
    per_step = {}
    timeline = run_dir / "timeline"
    spans = [s for f in sorted(timeline.glob("rank*.json")) for s in json.loads(f.read_text())] \
        if timeline.is_dir() else []
    by_step = span_phases(spans)
    if any("colocated" in v for v in by_step.values()) or not by_step:
        # one step does everything: its phases are the per-role metrics
        gen, rew, tr = (read_jsonl(run_dir / "metrics" / f"{n}.jsonl") for n in ("generator", "reward", "trainer"))
        for k in steps:
            per_step[k] = {"gen": gen.get(k, {}).get("gen_seconds", 0.0),
                           "reward": rew.get(k, {}).get("reward_seconds", 0.0),
                           "train": tr.get(k, {}).get("train_seconds", 0.0)}
    else:
        for k in steps:
            per_step[k] = {names[e]: v for e, v in by_step.get(k, {}).items() if e in names}
    return {p: statistics.median(per_step[k].get(p, 0.0) for k in steps) if steps else 0.0 for p in PHASES}


def measure_speed(run_dir: Path, warmup: int) -> dict:
    """Steady-state tick time, samples/s, tokens/s, phases and trainer activity of one speed run."""
    gen = read_jsonl(run_dir / "metrics" / "generator.jsonl")
    trainer = read_jsonl(run_dir / "metrics" / "trainer.jsonl")
    durations = tick_durations(gen)
    steps = steady_steps(durations, warmup)
    if not steps:
        raise ValueError(f"{run_dir}: fewer than 2 ticks in metrics/generator.jsonl")
    seconds = sum(durations[k] for k in steps)
    samples = sum(gen[k].get("gen_emitted_samples", 0.0) for k in steps)
    tokens = sum(gen[k].get("gen_new_tokens", 0.0) for k in steps)
    # A tick trained when it made an optimizer step (with k minibatches, ``skipped_no_signal`` counts
    # the minibatches without signal, so it may be > 0 on a tick that did train).
    trained = [k for k in steps if k in trainer and (
        trainer[k]["optimizer_steps"] > 0 if "optimizer_steps" in trainer[k]
        else not trainer[k].get("skipped") and not trainer[k].get("skipped_no_signal"))]
    staleness = [trainer[k]["staleness_mean"] for k in trained if "staleness_mean" in trainer[k]]
    # Proximal-policy time (decoupled PPO: the recompute forward or A-3PO's interpolation).
    prox = [trainer[k]["prox_seconds"] for k in trained if "prox_seconds" in trainer[k]]
    return {"prox_median_s": statistics.median(prox) if prox else None,
            "steady_ticks": steps, "tick_seconds": [durations[k] for k in steps],
            "tick_median_s": statistics.median(durations[k] for k in steps),
            "samples_per_s": samples / seconds, "gen_tokens_per_s": tokens / seconds,
            "phases_median_s": phase_seconds(run_dir, steps),
            "trained_ticks": len(trained), "staleness_mean": statistics.mean(staleness) if staleness else None}


def section7(sync_phases: dict[str, float], async_phases: dict[str, float] | None = None) -> dict:
    """LlamaRL §7: ``S_model = (g + r + t) / max(g, r, t)`` from sync's phases; ``S_split`` uses the
    async run's own phases in the denominator (module docstring). None where undefined."""
    serial = sum(sync_phases.get(p, 0.0) for p in PHASES)
    bottleneck = max(sync_phases.get(p, 0.0) for p in PHASES)
    out = {"sync_serial_s": serial, "sync_bottleneck_s": bottleneck,
           "S_model": serial / bottleneck if bottleneck > 0 else None}
    if async_phases is not None:
        split = max(async_phases.get(p, 0.0) for p in PHASES)
        out["async_bottleneck_s"] = split
        out["S_split"] = serial / split if split > 0 else None
    return out


def add_ratios(results: list[dict]) -> None:
    """Speed-ups vs colocated / sync (samples/s ratios) and the §7 model, per workload, in place."""
    for workload in {r["workload"] for r in results}:
        rows = {r["name"]: r for r in results if r["workload"] == workload and r.get("speed")}
        colocated, sync = rows.get("colocated"), rows.get("sync")
        for r in rows.values():
            sps = r["speed"]["samples_per_s"]
            r["vs_colocated"] = sps / colocated["speed"]["samples_per_s"] if colocated else None
            r["vs_sync"] = sps / sync["speed"]["samples_per_s"] if sync else None
            if sync and r["schedule"] == "async":
                r["section7"] = section7(sync["speed"]["phases_median_s"], r["speed"]["phases_median_s"])
                r["section7"]["S_measured"] = sync["speed"]["tick_median_s"] / r["speed"]["tick_median_s"]


def training_seconds(run_dir: Path, eval_steps: list[int]) -> dict[int, float]:
    """Ticks done -> cumulative training seconds, evaluations and the model load left out.

    Tick k lasts ``time[k] - time[k-1]`` (the evaluating stage's ``metrics/generator.jsonl`` stamps;
    tick 0 from the first span of that stage's rank at step 0, i.e. after the load and the base
    evaluation). An evaluation after ``e`` ticks runs on the evaluating rank between ticks e-1 and
    e, so it lengthens tick e-1 and, where the other executors were still busy (async), shortens
    tick e: both are replaced by the median of the ticks no evaluation touched.
    """
    gen = read_jsonl(run_dir / "metrics" / "generator.jsonl")
    if not gen:
        return {0: 0.0}
    durations = tick_durations(gen)
    timeline = run_dir / "timeline"
    spans = [s for f in sorted(timeline.glob("rank*.json")) for s in json.loads(f.read_text())] \
        if timeline.is_dir() else []
    first = min((s["start"] for s in spans if s["step"] == min(gen) and s["executor"] in ("generator", "colocated")),
                default=None)
    if first is not None:
        durations[min(gen)] = gen[min(gen)]["time"] - first
    touched = {k for e in eval_steps for k in (e - 1, e)}
    clean = [d for k, d in durations.items() if k not in touched]
    fill = statistics.median(clean) if clean else None
    out, total = {0: 0.0}, 0.0
    for k in sorted(gen):
        d = durations.get(k)
        d = fill if (k in touched or d is None) and fill is not None else d
        total += d if d is not None else gen[k].get("step_seconds", 0.0) + gen[k].get("channel_seconds", 0.0)
        out[k + 1] = total
    return out


def time_to_target(evals: list[dict], target: float) -> dict:
    """First evaluation at or above ``target``: its step, training seconds and wall seconds (None if never)."""
    hit = next((e for e in evals if e["accuracy"] >= target), None)
    return {"steps_to_target": hit["step"] if hit else None,
            "time_to_target_s": hit.get("train_seconds") if hit else None,
            "wall_to_target_s": hit.get("wall_seconds") if hit else None}


def measure_accuracy(run_dir: Path, target: float) -> dict:
    summary = json.loads((run_dir / "summary.json").read_text())
    last = summary.get("num_steps")
    train = training_seconds(run_dir, [e["step"] for e in summary.get("evals", []) if 0 < e["step"] != last])
    evals = [{"step": e["step"], "accuracy": e["accuracy"], "version": e.get("version"),
              "wall_seconds": e["seconds"], "train_seconds": train.get(e["step"])} for e in summary.get("evals", [])]
    return {"evals": evals, "final_accuracy": summary.get("final_accuracy"), "base_accuracy": summary.get("base_accuracy"),
            "wall_seconds": summary.get("wall_seconds"), **time_to_target(evals, target)}


# ----- output -----
def _fmt(x, spec=".2f", none="-") -> str:
    return none if x is None else format(x, spec)


def table(results: list[dict], *, target: float | None = None) -> str:
    lines = [("| workload | schedule | ranks | threads gen/train | tick s (median) | samples/s | gen tok/s | "
             "x vs colocated | x vs sync | gen / rew / train s per tick | §7 S_model | §7 S_split | S_measured | "
             "trained ticks |"),
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        s = r.get("speed")
        if not s:
            if "speed_error" in r or "skipped" in r:
                lines.append(f"| {r['workload']} | {r['name']} | {r['nproc']} | {r['gen_threads']}/{r['train_threads']} | "
                             f"{r.get('skipped') or 'failed: ' + r['speed_error']} |" + " |" * 9)
            continue
        ph = s["phases_median_s"]
        m = r.get("section7") or {}
        lines.append(
            f"| {r['workload']} | {r['name']} | {r['nproc']} | {r['gen_threads']}/{r['train_threads']} | "
            f"{s['tick_median_s']:.1f} | {s['samples_per_s']:.2f} | {s['gen_tokens_per_s']:.1f} | "
            f"{_fmt(r.get('vs_colocated'))} | {_fmt(r.get('vs_sync'))} | "
            f"{ph['gen']:.1f} / {ph['reward']:.2f} / {ph['train']:.1f} | {_fmt(m.get('S_model'))} | "
            f"{_fmt(m.get('S_split'))} | {_fmt(m.get('S_measured'))} | {s['trained_ticks']}/{len(s['steady_ticks'])} |")
    prox = [r for r in results if (r.get("speed") or {}).get("prox_median_s") is not None]
    if prox:
        lines += ["", "Proximal-policy seconds per trained tick (median; decoupled PPO):", ""]
        lines += [f"- {r['workload']} {r['name']}: {r['speed']['prox_median_s']:.3g} s" for r in prox]
    acc = [r for r in results if r.get("workload") == "arithmetic-accuracy"]
    if acc:
        lines += ["", (f"Time to {target:.2f} held-out greedy accuracy (arithmetic; training s = evaluations and load "
                  "excluded; wall = from the run's start):"), "",
                  ("| system | base -> final | evaluations (step: acc) | steps to target | training s to target | "
                  "wall s to target |"), "|---|---|---|---|---|---|"]
        for r in acc:
            a = r.get("accuracy")
            if not a:
                lines.append(f"| {r['name']} | failed (exit {r.get('returncode')}) |" + " |" * 4)
                continue
            curve = ", ".join(f"{e['step']}: {e['accuracy']:.2f}" for e in a["evals"])
            lines.append(f"| {r['name']} | {_fmt(a.get('base_accuracy'))} -> {_fmt(a.get('final_accuracy'))} | {curve} | "
                         f"{_fmt(a['steps_to_target'], 'd', 'not reached')} | {_fmt(a['time_to_target_s'], '.0f')} | "
                         f"{_fmt(a['wall_to_target_s'], '.0f')} |")
    return "\n".join(lines)


def plot(results: list[dict], path: Path, *, target: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workloads = [w for w in WORKLOADS if any(r["workload"] == w and r.get("speed") for r in results)]
    acc = [r for r in results if r.get("accuracy")]
    panels = len(workloads) + (1 if acc else 0)
    if not panels:
        return
    fig, axes = plt.subplots(1, panels, figsize=(5.5 * panels, 4.2), squeeze=False)
    for ax, workload in zip(axes[0], workloads):
        rows = [r for r in results if r["workload"] == workload and r.get("speed")]
        bars = ax.bar(range(len(rows)), [r["speed"]["samples_per_s"] for r in rows], color="tab:blue")
        for bar, r in zip(bars, rows):
            label = "\n".join(f"{r[key]:.2f}x {text}" for key, base, text in
                              (("vs_sync", "sync", "sync"), ("vs_colocated", "colocated", "coloc."))
                              if r.get(key) is not None and r["name"] != base)
            ax.annotate(label, (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center", va="bottom", fontsize=7)
        ax.set_xticks(range(len(rows)), [r["name"] for r in rows], rotation=30, ha="right", fontsize=8)
        ax.set_ylabel("steady-state samples/s")
        ax.margins(y=0.2)
        ax.set_title(f"{workload}: speed-up vs sync / colocated")
    if acc:
        ax = axes[0][-1]
        for r in acc:
            evals = [e for e in r["accuracy"]["evals"] if e.get("train_seconds") is not None]
            ax.plot([e["train_seconds"] for e in evals], [e["accuracy"] for e in evals], "o-", label=r["name"], ms=3)
        ax.axhline(target, color="grey", ls=":", label=f"target {target:.2f}")
        ax.set_xlabel("training seconds (evaluations excluded)")
        ax.set_ylabel("held-out greedy accuracy")
        ax.set_title("arithmetic: time to accuracy")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ----- main -----
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=Path("runs/async_speedup"), help="output directory")
    p.add_argument("--workloads", type=csv_choices(WORKLOADS), default=list(WORKLOADS))
    p.add_argument("--schedules", type=csv_choices(SCHEDULES), default=list(SCHEDULES))
    p.add_argument("--ticks", type=int, default=10, help="ticks per speed run")
    p.add_argument("--warmup", type=int, default=3, help="ticks left out of the steady state")
    p.add_argument("--cores", type=int, default=2, help="threads of the busy executor in colocated / sync")
    p.add_argument("--async-threads", type=parse_threads, default=(1, 1),
                   help="GEN,TRAIN torch threads of the async schedules' generator and trainer")
    p.add_argument("--token-budget", type=int, default=None,
                   help="partial rollouts' --generator.token-budget (default: 6 arithmetic, 128 gsm8k)")
    p.add_argument("--gsm8k-prompts", type=int, default=2, help="gsm8k prompts per tick")
    p.add_argument("--gsm8k-samples", type=int, default=4, help="gsm8k samples per prompt")
    p.add_argument("--gsm8k-max-new-tokens", type=int, default=256)
    p.add_argument("--accuracy", action="store_true", help="arithmetic time-to-accuracy runs + the single-process loop")
    p.add_argument("--accuracy-ticks", type=int, default=40)
    p.add_argument("--eval-every", type=int, default=5)
    p.add_argument("--heldout", type=int, default=100)
    p.add_argument("--target", type=float, default=0.70)
    p.add_argument("--no-speed", action="store_true", help="skip the speed runs (e.g. only --accuracy)")
    p.add_argument("--no-single-loop", action="store_true", help="--accuracy without the single-process loop")
    p.add_argument("--variants", action="store_true",
                   help="add async-lag1 decoupled-PPO runs with 4 minibatches, prox recompute vs loglinear")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--reuse", action="store_true", help="reuse runs in --out that already finished (summary.json)")
    p.add_argument("--run-timeout", type=float, default=3600.0, help="seconds before a run is killed")
    return p


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.ticks < 2:
        parser.error("--ticks must be >= 2 (tick times are differences of consecutive stamps)")
    start = time.time()
    out = args.out if args.out.is_absolute() else (Path.cwd() / args.out)
    out.mkdir(parents=True, exist_ok=True)
    uptimes = {"start": uptime()}
    print(f"async_speedup: uptime at start: {uptimes['start']}; CPU {cpu_model()}", flush=True)
    names = list(args.schedules)
    skipped: dict[tuple[str, str], str] = {}
    if args.variants:
        for workload in args.workloads if not args.no_speed else ["arithmetic"]:
            if flag_available(workload, "--trainer.num-minibatches", args):
                names += [v for v in VARIANTS if v not in names]
            else:
                for v in VARIANTS:
                    skipped[(workload, v)] = "skipped: flag not available"
                print(f"async_speedup: variants for {workload} skipped: flag not available "
                      "(--trainer.num-minibatches)", flush=True)
    results: list[dict] = []

    def do_run(spec: RunSpec, run_dir: Path, **kw) -> tuple[dict, bool]:
        cmd = command(spec, run_dir, args, **kw)
        record = {**asdict(spec), "run_dir": str(run_dir), "command": shlex.join(cmd)}
        if args.reuse and (run_dir / "summary.json").exists():
            print(f"async_speedup: reusing {run_dir}", flush=True)
            return record, True
        print(f"async_speedup: {spec.workload} {spec.name}: {shlex.join(cmd)}", flush=True)
        code, wall = launch(cmd, run_dir, threads=spec.omp_threads, timeout_s=args.run_timeout)
        record.update(returncode=code, wall_seconds=wall, uptime_after=uptime())
        if code != 0:
            print(f"async_speedup: {spec.workload} {spec.name} failed (exit {code}); log tail:\n{log_tail(run_dir)}",
                  flush=True)
        else:
            print(f"async_speedup: {spec.workload} {spec.name} done in {wall:.0f} s", flush=True)
        return record, code == 0

    if not args.no_speed:
        for workload in args.workloads:
            for name in names:
                spec = run_spec(name, workload, args)
                if (workload, name) in skipped:
                    results.append({**asdict(spec), "skipped": skipped[(workload, name)]})
                    continue
                record, ok = do_run(spec, out / workload / name, ticks=args.ticks)
                if ok:
                    try:
                        record["speed"] = measure_speed(out / workload / name, args.warmup)
                    except (ValueError, OSError, KeyError) as exc:
                        record["speed_error"] = str(exc)
                else:
                    record["speed_error"] = f"exit {record.get('returncode')}"
                results.append(record)
        add_ratios(results)
    if args.accuracy:
        accuracy_names = [n for n in names if ("arithmetic", n) not in skipped]
        for name in accuracy_names:
            spec = run_spec(name, "arithmetic", args)
            run_dir = out / "accuracy" / name
            record, ok = do_run(spec, run_dir, ticks=args.accuracy_ticks, eval_every=args.eval_every,
                                heldout=args.heldout)
            record["name"] = f"{name}"
            record["workload"] = "arithmetic-accuracy"
            if ok:
                record["accuracy"] = measure_accuracy(run_dir, args.target)
            results.append(record)
        if not args.no_single_loop:
            loop_dir = out / "accuracy" / "single-process-loop"
            cmd = [str(PYTHON), str(REPO / "benchmarks" / "single_process_loop.py"), "--out", str(loop_dir),
                   "--steps", str(args.accuracy_ticks), "--eval-every", str(args.eval_every), "--heldout",
                   str(args.heldout), "--threads", str(args.cores), "--target", str(args.target),
                   "--seed", str(args.seed)]
            record = {"name": "single-process loop", "workload": "arithmetic-accuracy", "schedule": "single-loop",
                      "nproc": 1, "gen_threads": args.cores, "train_threads": args.cores, "command": shlex.join(cmd)}
            if args.reuse and (loop_dir / "single_loop.json").exists():
                code = 0
            else:
                print(f"async_speedup: single-process loop: {shlex.join(cmd)}", flush=True)
                code, record["wall_seconds"] = launch(cmd, loop_dir, threads=args.cores, timeout_s=args.run_timeout)
                record["uptime_after"] = uptime()
            if code == 0:
                loop = json.loads((loop_dir / "single_loop.json").read_text())
                record["accuracy"] = {"evals": loop["evals"], "final_accuracy": loop["final_accuracy"],
                                      "base_accuracy": loop["evals"][0]["accuracy"], "wall_seconds": loop["wall_seconds"],
                                      **time_to_target(loop["evals"], args.target)}
            else:
                print(f"async_speedup: single-process loop failed (exit {code}):\n{log_tail(loop_dir)}", flush=True)
            results.append(record)
    uptimes["end"] = uptime()
    print(f"async_speedup: uptime at end: {uptimes['end']}", flush=True)
    (out / "async_speedup.json").write_text(json.dumps({
        "args": {k: (list(v) if isinstance(v, tuple) else str(v) if isinstance(v, Path) else v)
                 for k, v in vars(args).items()},
        "command": shlex.join([sys.executable, *sys.argv]), "cpu_count": os.cpu_count(), "cpu_model": cpu_model(),
        "uptime": uptimes,
        "wall_seconds": time.time() - start, "section7_formula": "S_model = (g + r + t) / max(g, r, t) from sync's "
        "per-tick busy seconds; S_split = (g + r + t) / max(g_a, r_a, t_a) with the async run's own; "
        "S_measured = sync tick / async tick", "results": results}, indent=2))
    plot(results, out / "async_speedup.png", target=args.target)
    print(table(results, target=args.target if args.accuracy else None))
    print(f"\nwall {time.time() - start:.0f} s; json + png in {out}")


if __name__ == "__main__":
    main()
