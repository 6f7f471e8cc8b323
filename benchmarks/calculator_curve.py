"""The calculator recipe's learning curve from a run directory (not a test).

    .venv/bin/python benchmarks/calculator_curve.py RUN_DIR [--out docs/bench/calculator.png]

Reads ``RUN_DIR/summary.json`` (held-out greedy accuracy at each evaluation) and
``RUN_DIR/metrics/{reward,generator}.jsonl`` (per tick: the training samples' reward, and the
fraction of emitted samples whose episode got a tool answer, ``env_samples_with_observation /
gen_emitted_samples``), prints them as a table and draws them against the tick.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def curve(run_dir: Path) -> dict:
    """``{"evals": [(tick, accuracy)], "ticks": [(tick, reward_mean, tool_rate)]}`` of a run."""
    summary = json.loads((run_dir / "summary.json").read_text())
    rewards = {r["step"]: r["reward_mean"] for r in read_jsonl(run_dir / "metrics" / "reward.jsonl") if "reward_mean" in r}
    rates = {r["step"]: r["env_samples_with_observation"] / r["gen_emitted_samples"]
             for r in read_jsonl(run_dir / "metrics" / "generator.jsonl")
             if r.get("gen_emitted_samples") and "env_samples_with_observation" in r}
    if not rates:
        raise SystemExit(f"{run_dir}: no env_samples_with_observation in metrics/generator.jsonl (a run without --env.name?)")
    ticks = [(t, rewards.get(t, float("nan")), rates[t]) for t in sorted(rates)]
    evals = sorted({e["step"]: e["accuracy"] for e in summary["evals"]}.items())
    return {"evals": evals, "ticks": ticks, "wall_seconds": summary["wall_seconds"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--out", type=Path, default=Path("docs/bench/calculator.png"))
    args = parser.parse_args()
    data = curve(args.run_dir)
    print("| tick | training reward | samples with a tool answer |")
    print("|---|---|---|")
    for tick, reward, rate in data["ticks"]:
        print(f"| {tick} | {reward:.3f} | {rate:.3f} |")
    print("held-out greedy accuracy:", ", ".join(f"tick {t}: {a:.3f}" for t, a in data["evals"]),
          f"({data['wall_seconds']:.0f} s)")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.6))
    ticks = [t for t, _, _ in data["ticks"]]
    ax.plot(ticks, [r for _, r, _ in data["ticks"]], label="training reward (sampled, T = 0.8)", color="tab:blue")
    ax.plot(ticks, [q for _, _, q in data["ticks"]], label="samples with a tool answer", color="tab:orange",
            linestyle="--")
    ax.plot([t for t, _ in data["evals"]], [a for _, a in data["evals"]], "o-", color="tab:green",
            label="held-out greedy accuracy (64 problems)")
    ax.set_xlabel("tick")
    ax.set_ylim(-0.02, 1.02)
    ax.set_title("recipes.calculator: 3-digit x 2-digit products, SmolLM2-135M, chat prompt", fontsize=9)
    ax.legend(fontsize=8, loc="lower right")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out, dpi=110)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
