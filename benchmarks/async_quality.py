"""Does the off-policy correction pay? Final held-out accuracy of async + AIPO vs sync vs async uncorrected.

    .venv/bin/python benchmarks/async_quality.py                       # 3 seeds x 3 configs x 40 ticks
    .venv/bin/python benchmarks/async_quality.py --seeds 1 --ticks 3   # smoke

Prints a markdown table; writes ``<out>/async_quality.json`` and ``<out>/async_quality.png`` (default
``--out runs/async_quality``; each run's directory, log and command under ``<out>/<config>/seed<s>/``).

Task: ``recipes.arithmetic`` with its defaults (SmolLM2-135M-Instruct, 16 prompts x 4 samples,
12 new tokens, temperature 0.8, lr 1.5e-5, bf16 compute), ``--ticks`` (40) ticks, greedy accuracy on
the same 100 held-out problems every ``--eval-every`` ticks and after the last (the held-out set
does not depend on the seed; the training prompts and the sampling do). Each run is a
``python -m torch.distributed.run --standalone --nproc-per-node N`` subprocess with ``OMP_NUM_THREADS``
pinned; threads as in ``benchmarks/async_speedup.py`` (sync: 2 for the busy executor; async:
generator 1 + trainer 1, ``--async-threads``). Configs (``--configs``):

- ``async-aipo``: ``--run.schedule async --run.async-lag L`` (``--lag``, default 1, the
  library's default: every trained token is 1 version old; 2 is LlamaRL's Algorithm 1 as written),
  ``--algo.loss aipo`` (rho 4): the importance weight ``min(pi/mu, rho)`` corrects for the lag.
- ``sync``: ``--run.schedule sync``, ``--algo.loss aipo``: on-policy, the ratio is 1 up to the bf16
  generator's rounding, so this is plain REINFORCE with the group baseline: the reference.
- ``async-uncorrected``: the async schedule of ``async-aipo`` with **no off-policy correction at
  all**: per token ``-A * log pi`` (token mean), i.e. AIPO with the importance weight replaced by 1,
  the stale samples treated as if on-policy. None of the registered losses means that
  (``llamarl/algorithms/registered.py``: ``aipo``, ``decoupled_ppo``, ``ppo``; ``ppo`` uses the
  behaviour policy as PPO's old policy, so its gradient still carries the ratio pi/mu inside the
  clip range, a clipped importance correction), so this script registers it as ``pg_uncorrected``
  through the library's ``register_policy_loss`` and launches the recipe through itself
  (``benchmarks/async_quality.py --recipe-worker <recipe flags>``: registers, then runs
  ``recipes.arithmetic.main``; everything else is the recipe's code path).
- ``async-ppo`` (optional): the same schedule with ``--algo.loss ppo``: coupled PPO with the behaviour
  policy as the old policy, AReaL's naive baseline (a clipped, not a decoupled, correction).

Per config: final held-out accuracy mean, sample standard deviation and min..max over the seeds,
the mean accuracy curve, and trainer diagnostics averaged over trained ticks (staleness,
importance weight, k3 KL, clip fraction). ``uptime`` at the start, between runs and at the end is
in the JSON (the machine may be shared; this measures quality, not speed).
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
UNCORRECTED_LOSS = "pg_uncorrected"
CONFIGS = ("async-aipo", "sync", "async-uncorrected", "async-ppo")
DEFAULT_CONFIGS = ("async-aipo", "sync", "async-uncorrected")
DIAGNOSTICS = ("staleness_mean", "importance_weight_mean", "importance_weight_max", "approx_kl", "clip_fraction")


# ----- worker: one rank of a run of the uncorrected loss -----
def pg_uncorrected_loss(*, logp, behav_logp, prox_logp, advantages, mask, algo, num_loss_tokens):
    """Per masked token ``-A * log pi`` over the global token count (no importance weight); reports
    AIPO's behaviour metrics (computed without grad) for comparison. The registry's signature."""
    import torch

    from llamarl.algorithms.losses import aipo_loss

    keep = mask.to(torch.bool)
    lp = logp.to(torch.promote_types(logp.dtype, torch.float32))
    adv = advantages.detach().to(lp.dtype)
    adv = adv.unsqueeze(-1).expand_as(lp) if adv.dim() == 1 else adv
    adv = torch.where(keep, adv, 0.0)
    if num_loss_tokens is None:
        denominator = keep.sum().to(lp.dtype).clamp_min(1.0)
    else:
        denominator = torch.as_tensor(num_loss_tokens, dtype=lp.dtype, device=lp.device).clamp_min(1.0)
    loss = (-adv * torch.where(keep, lp, 0.0)).sum() / denominator
    with torch.no_grad():
        _, metrics = aipo_loss(logp=logp.detach(), behav_logp=behav_logp, advantages=advantages, mask=mask, rho=algo.rho)
    return loss, metrics


def register_uncorrected_loss() -> None:
    """Register ``pg_uncorrected_loss`` as ``--algo.loss pg_uncorrected`` (in this process)."""
    from llamarl.algorithms.registered import _BEHAVIOUR_METRICS, POLICY_LOSSES, register_policy_loss

    if UNCORRECTED_LOSS not in POLICY_LOSSES:
        register_policy_loss(UNCORRECTED_LOSS, metrics=dict(_BEHAVIOUR_METRICS))(pg_uncorrected_loss)


def recipe_worker(argv: list[str]) -> None:
    """Under torchrun: register the uncorrected loss, then run recipes.arithmetic with ``argv``."""
    sys.path.insert(0, str(REPO))
    import tyro

    register_uncorrected_loss()
    from recipes.arithmetic import ArithmeticConfig, main

    main(tyro.cli(ArithmeticConfig, args=argv))


# ----- driver -----
def config_flags(name: str, args) -> tuple[int, int, int, list[str], bool]:
    """(ranks, generator threads, trainer threads, flags, through the worker) of config ``name``."""
    agen, atrain = args.async_threads
    async_flags = ["--run.schedule", "async", "--run.async-lag", str(args.lag)]
    if name == "sync":
        return 3, args.cores, args.cores, ["--run.schedule", "sync", "--algo.loss", "aipo"], False
    if name == "async-aipo":
        return 3, agen, atrain, [*async_flags, "--algo.loss", "aipo"], False
    if name == "async-ppo":
        return 3, agen, atrain, [*async_flags, "--algo.loss", "ppo"], False
    if name == "async-uncorrected":
        return 3, agen, atrain, [*async_flags, "--algo.loss", UNCORRECTED_LOSS], True
    raise ValueError(f"unknown config {name!r}")


def command(name: str, seed: int, run_dir: Path, args) -> tuple[list[str], int]:
    from async_speedup import PYTHON

    nproc, gen, train, flags, worker = config_flags(name, args)
    entry = [str(REPO / "benchmarks" / "async_quality.py"), "--recipe-worker"] if worker else ["-m", "recipes.arithmetic"]
    # A rank each for generator, reward and trainer: the split these measurements were taken with.
    flags = [*flags, "--reward.num-ranks", "1"]
    cmd = [str(PYTHON), "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc), *entry, *flags,
           "--generator.num-threads", str(gen), "--trainer.num-threads", str(train), "--run.max-steps", str(args.ticks),
           "--run.seed", str(seed), "--run.output-dir", str(run_dir), "--run.eval-every", str(args.eval_every),
           "--run.num-eval-problems", str(args.heldout), "--export.no-final"]
    return cmd, max(gen, train)


def diagnostics(run_dir: Path) -> dict[str, float | None]:
    """Means over trained ticks of the trainer's off-policy diagnostics."""
    from async_speedup import read_jsonl

    trainer = read_jsonl(run_dir / "metrics" / "trainer.jsonl")
    trained = [r for r in trainer.values() if not r.get("skipped") and not r.get("skipped_no_signal")]
    return {key: statistics.mean(r[key] for r in trained if key in r) if any(key in r for r in trained) else None
            for key in DIAGNOSTICS} | {"trained_ticks": len(trained)}


def aggregate(runs: list[dict]) -> dict:
    """Mean, sample std, min, max of the final accuracies of ``runs`` (those that finished), and the
    mean curve over the evaluation steps every finished run has."""
    done = [r for r in runs if r.get("final_accuracy") is not None]
    finals = [r["final_accuracy"] for r in done]
    out = {"n": len(finals), "finals": finals,
           "mean": statistics.mean(finals) if finals else None,
           "std": statistics.stdev(finals) if len(finals) > 1 else (0.0 if finals else None),
           "min": min(finals) if finals else None, "max": max(finals) if finals else None}
    if done:
        steps = set.intersection(*({e["step"] for e in r["evals"]} for r in done))
        out["curve"] = {s: statistics.mean(next(e["accuracy"] for e in r["evals"] if e["step"] == s) for r in done)
                        for s in sorted(steps)}
        for key in DIAGNOSTICS:
            values = [r["diagnostics"][key] for r in done if r["diagnostics"].get(key) is not None]
            out[key] = statistics.mean(values) if values else None
        out["wall_seconds_mean"] = statistics.mean(r["wall_seconds"] for r in done)
    return out


def _fmt(x, spec=".3f") -> str:
    return "-" if x is None else format(x, spec)


def table(summary: dict[str, dict], *, ticks: int) -> str:
    lines = [(f"| config | seeds | final held-out acc. after {ticks} ticks, mean ± std | min..max | mean curve | "
             "staleness | importance weight mean / max | k3 KL | clip fraction | wall s / run |"),
             "|---|---|---|---|---|---|---|---|---|---|"]
    for name, a in summary.items():
        if not a["n"]:
            lines.append(f"| {name} | 0 | failed |" + " |" * 7)
            continue
        curve = ", ".join(f"{s}: {v:.2f}" for s, v in a.get("curve", {}).items())
        lines.append(f"| {name} | {a['n']} | {a['mean']:.3f} ± {a['std']:.3f} | {a['min']:.2f}..{a['max']:.2f} | "
                     f"{curve} | {_fmt(a.get('staleness_mean'), '.2f')} | {_fmt(a.get('importance_weight_mean'))} / "
                     f"{_fmt(a.get('importance_weight_max'), '.2f')} | {_fmt(a.get('approx_kl'), '.4f')} | "
                     f"{_fmt(a.get('clip_fraction'))} | {_fmt(a.get('wall_seconds_mean'), '.0f')} |")
    return "\n".join(lines)


def plot(summary: dict[str, dict], runs: dict[str, list[dict]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [n for n, a in summary.items() if a["n"]]
    if not names:
        return
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    means = [summary[n]["mean"] for n in names]
    left.bar(range(len(names)), means, yerr=[summary[n]["std"] for n in names], capsize=4, color="tab:blue")
    for i, n in enumerate(names):
        left.plot([i] * summary[n]["n"], summary[n]["finals"], "k.", ms=5)
    left.set_xticks(range(len(names)), names, rotation=20, ha="right")
    left.set_ylabel("final held-out greedy accuracy (mean ± std; dots: seeds)")
    for n in names:
        curve = summary[n].get("curve", {})
        line, = right.plot(list(curve), list(curve.values()), "o-", label=n, lw=2)
        for r in runs[n]:
            if r.get("evals"):
                right.plot([e["step"] for e in r["evals"]], [e["accuracy"] for e in r["evals"]], "-",
                           color=line.get_color(), alpha=0.25, lw=1)
    right.set_xlabel("ticks (optimizer steps)")
    right.set_ylabel("held-out greedy accuracy")
    right.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def build_parser() -> argparse.ArgumentParser:
    from async_speedup import csv_choices, parse_threads

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=Path("runs/async_quality"))
    p.add_argument("--configs", type=csv_choices(CONFIGS), default=list(DEFAULT_CONFIGS))
    p.add_argument("--seeds", type=int, default=3, help="seeds 0..N-1 per config")
    p.add_argument("--ticks", type=int, default=40)
    p.add_argument("--lag", type=int, choices=(1, 2), default=1, help="--run.async-lag of the async configs")
    p.add_argument("--eval-every", type=int, default=10)
    p.add_argument("--heldout", type=int, default=100)
    p.add_argument("--cores", type=int, default=2, help="threads of the busy executor under sync")
    p.add_argument("--async-threads", type=parse_threads, default=(1, 1), help="GEN,TRAIN threads under async")
    p.add_argument("--reuse", action="store_true", help="reuse runs in --out that already finished")
    p.add_argument("--run-timeout", type=float, default=3600.0)
    return p


def main(argv: list[str] | None = None) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from async_speedup import cpu_model, launch, log_tail, uptime

    args = build_parser().parse_args(argv)
    start = time.time()
    out = args.out if args.out.is_absolute() else Path.cwd() / args.out
    out.mkdir(parents=True, exist_ok=True)
    uptimes = {"start": uptime()}
    print(f"async_quality: uptime at start: {uptimes['start']}; CPU {cpu_model()}", flush=True)
    runs: dict[str, list[dict]] = {name: [] for name in args.configs}
    # seed-major order: an interrupted benchmark still has every config for the first seeds
    for seed in range(args.seeds):
        for name in args.configs:
            run_dir = out / name / f"seed{seed}"
            cmd, threads = command(name, seed, run_dir, args)
            record = {"config": name, "seed": seed, "run_dir": str(run_dir), "command": shlex.join(cmd)}
            if not (args.reuse and (run_dir / "summary.json").exists()):
                print(f"async_quality: {name} seed {seed}: {shlex.join(cmd)}", flush=True)
                code, wall = launch(cmd, run_dir, threads=threads, timeout_s=args.run_timeout)
                record.update(returncode=code, uptime_after=uptime())
                if code != 0:
                    print(f"async_quality: {name} seed {seed} failed (exit {code}):\n{log_tail(run_dir)}", flush=True)
                    runs[name].append(record)
                    continue
                print(f"async_quality: {name} seed {seed} done in {wall:.0f} s", flush=True)
            summary = json.loads((run_dir / "summary.json").read_text())
            record.update(final_accuracy=summary.get("final_accuracy"), base_accuracy=summary.get("base_accuracy"),
                          wall_seconds=summary.get("wall_seconds"), loss=summary.get("loss"),
                          evals=[{"step": e["step"], "accuracy": e["accuracy"], "seconds": e["seconds"],
                                  "version": e.get("version")} for e in summary.get("evals", [])],
                          diagnostics=diagnostics(run_dir))
            runs[name].append(record)
    summary = {name: aggregate(rs) for name, rs in runs.items()}
    uptimes["end"] = uptime()
    print(f"async_quality: uptime at end: {uptimes['end']}", flush=True)
    (out / "async_quality.json").write_text(json.dumps({
        "args": {k: (list(v) if isinstance(v, tuple) else str(v) if isinstance(v, Path) else v)
                 for k, v in vars(args).items()},
        "command": shlex.join([sys.executable, *sys.argv]), "cpu_model": cpu_model(), "uptime": uptimes,
        "wall_seconds": time.time() - start,
        "uncorrected_loss": "pg_uncorrected: per token -A * log pi, token mean, no importance weight (registered by "
                            "this script)", "summary": summary, "runs": runs}, indent=2))
    plot(summary, runs, out / "async_quality.png")
    print(table(summary, ticks=args.ticks))
    print(f"\nwall {time.time() - start:.0f} s; json + png in {out}")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--recipe-worker":
        recipe_worker(sys.argv[2:])
    else:
        main()
