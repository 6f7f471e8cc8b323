"""LoRA against full fine-tuning on the default recipe (``make run``), seeds interleaved in one session.

Not a test. Usage::

    .venv/bin/python benchmarks/lora_vs_full.py [--seeds 0 1 2] [--lora "--trainer.lora.rank 8 --trainer.lr 8e-4"]
        [--out runs/lora_vs_full.json]

For each seed, ``make run RUN_ARGS="--run.seed S --run.output-dir ..."`` runs full fine-tuning and
then the same with the LoRA flags, one after the other (so both see the same hour of the machine).
Per run it reads back what the run wrote: the held-out greedy accuracy of every evaluation
(``summary.json``), the seconds per tick (the median gap between consecutive trainer metric
lines: evaluation ticks fall out of the median), the trainer's parameters + gradients + AdamW state
(``state_mib``, summed over its ranks, the largest of the run), the bytes of a weight sync (the
largest of the run) and the generator / trainer mismatch (the mean k3 KL of the sampled tokens,
the largest importance weight). It checks that each run did what was timed (every tick trained or was a
no-signal skip, each made 25 ticks, and LoRA synced fewer bytes than full), prints the per-seed rows
and the means, and the ratios LoRA / full against issue 39's targets: final accuracy within 0.05,
sync bytes <= 2 %, trainer state <= 40 %, a tick no slower.
"""

from __future__ import annotations

import argparse
import itertools
import json
import shlex
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def run(out: Path, *, seed: int, extra: list[str]) -> dict:
    args = ["--run.seed", str(seed), "--run.output-dir", str(out), *extra]
    proc = subprocess.run(["make", "run", f"RUN_ARGS={shlex.join(args)}"], cwd=REPO, capture_output=True, text=True,
                          check=False)
    if proc.returncode != 0:
        raise SystemExit(f"make run failed ({' '.join(args)}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    summary = json.loads((out / "summary.json").read_text())
    trainer = read_jsonl(out / "metrics" / "trainer.jsonl")
    generator = read_jsonl(out / "metrics" / "generator.jsonl")
    times = [r["time"] for r in trainer]
    if summary["num_steps"] != 25 or len(trainer) != 25:
        raise SystemExit(f"{out}: {summary['num_steps']} ticks, {len(trainer)} trainer lines (25 expected)")
    return {"seed": seed, "evals": [(e["step"], e["accuracy"]) for e in summary["evals"]],
            "final_accuracy": summary["final_accuracy"], "wall_seconds": summary["wall_seconds"],
            "tick_seconds": statistics.median(b - a for a, b in itertools.pairwise(times)),
            "state_mib": max(r["state_mib"] for r in trainer),
            "sync_bytes": max(r.get("weight_sync_bytes", 0) for r in generator),
            "updates": sum(1 for r in trainer if "loss" in r),
            # The generator / trainer mismatch: colocated there is no staleness, so the k3 KL of the
            # sampled tokens' log-probs is numerics alone (LoRA's merged forward: models/lora_forward.py).
            "approx_kl_mean": statistics.mean(r["approx_kl"] for r in trainer if "approx_kl" in r),
            "importance_weight_max": max(r["importance_weight_max"] for r in trainer if "importance_weight_max" in r)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--lora", default="--trainer.lora.rank 8 --trainer.lr 8e-4", help="the LoRA run's flags")
    parser.add_argument("--root", type=Path, default=REPO / "runs" / "lora_vs_full")
    parser.add_argument("--out", type=Path, default=None, help="also write the rows as JSON")
    args = parser.parse_args()
    rows: dict[str, list[dict]] = {"full": [], "lora": []}
    for seed in args.seeds:
        for kind, extra in (("full", []), ("lora", shlex.split(args.lora))):
            row = run(args.root / f"{kind}_seed{seed}", seed=seed, extra=extra)
            rows[kind].append(row)
            print(f"{kind:4} seed {seed}: " + " ".join(f"{a:.2f}@{s}" for s, a in row["evals"])
                  + f" | {row['tick_seconds']:.2f} s/tick, {row['wall_seconds']:.0f} s, state {row['state_mib']:.0f} MiB,"
                  f" sync {row['sync_bytes'] / 2**20:.2f} MiB, {row['updates']} updates,"
                  f" k3 {row['approx_kl_mean']:.4f}, max weight {row['importance_weight_max']:.2f}", flush=True)

    def mean(kind: str, key: str) -> float:
        return statistics.mean(r[key] for r in rows[kind])

    for kind, runs in rows.items():
        evals = [statistics.mean(r["evals"][i][1] for r in runs) for i in range(len(runs[0]["evals"]))]
        print(f"{kind} mean: evals " + " ".join(f"{a:.3f}" for a in evals) + f", final {mean(kind, 'final_accuracy'):.3f},"
              f" {mean(kind, 'tick_seconds'):.2f} s/tick, state {mean(kind, 'state_mib'):.0f} MiB,"
              f" sync {mean(kind, 'sync_bytes') / 2**20:.2f} MiB, k3 {mean(kind, 'approx_kl_mean'):.4f}")
    ratios = {"final_accuracy_difference": mean("lora", "final_accuracy") - mean("full", "final_accuracy"),
              "sync_bytes_ratio": mean("lora", "sync_bytes") / mean("full", "sync_bytes"),
              "state_ratio": mean("lora", "state_mib") / mean("full", "state_mib"),
              "tick_ratio": mean("lora", "tick_seconds") / mean("full", "tick_seconds")}
    if ratios["sync_bytes_ratio"] >= 1:
        raise SystemExit(f"LoRA synced no fewer bytes than full fine-tuning: {ratios}")
    print(f"LoRA - full final accuracy {ratios['final_accuracy_difference']:+.3f} (target >= -0.05); "
          f"sync bytes {ratios['sync_bytes_ratio']:.2%} of full (<= 2 %); trainer state "
          f"{ratios['state_ratio']:.1%} of full (<= 40 %); tick {ratios['tick_ratio']:.2f}x full's (<= 1)")
    if args.out is not None:
        args.out.write_text(json.dumps({"rows": rows, "ratios": ratios, "lora_flags": args.lora}, indent=1))


if __name__ == "__main__":
    sys.exit(main())
