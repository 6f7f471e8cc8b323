"""The learning curve of a run with an environment (recipes.calculator, recipes.guess_number), from
its run directory (not a test).

    .venv/bin/python benchmarks/episode_curve.py RUN_DIR --out docs/bench/calculator.png --title "..."

Reads ``RUN_DIR/summary.json`` (held-out greedy score at each evaluation) and
``RUN_DIR/metrics/{reward,generator}.jsonl`` (per tick: the training samples' reward, the fraction
of emitted samples whose episode got an observation, ``env_samples_with_observation /
gen_emitted_samples``, and the tool calls per emitted sample, ``env_tool_calls`` of the tick; a
run directory written before ``env_tool_calls`` became per tick holds it cumulative), prints them as a table and draws the first two and the evaluations against
the tick.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def curve(run_dir: Path) -> dict:
    """``{"evals": [(tick, score)], "ticks": [(tick, reward_mean, observation_rate, calls_per_sample)]}``."""
    summary = json.loads((run_dir / "summary.json").read_text())
    rewards = {r["step"]: r["reward_mean"] for r in read_jsonl(run_dir / "metrics" / "reward.jsonl") if "reward_mean" in r}
    # The last record of each tick: a run directory reused by a later run holds both runs' lines.
    generator = list({r["step"]: r for r in read_jsonl(run_dir / "metrics" / "generator.jsonl")
                      if "env_tool_calls" in r}.values())
    if not generator:
        raise SystemExit(f"{run_dir}: no env_tool_calls in metrics/generator.jsonl (a run without --env.name?)")
    ticks, calls_before = [], 0.0
    for r in sorted(generator, key=lambda r: r["step"]):
        emitted = r.get("gen_emitted_samples") or float("nan")
        per_tick = "env_tool_calls_total" in r  # else an older run's cumulative env_tool_calls
        ticks.append((r["step"], rewards.get(r["step"], float("nan")), r["env_samples_with_observation"] / emitted,
                      (r["env_tool_calls"] - (0.0 if per_tick else calls_before)) / emitted))
        calls_before = r["env_tool_calls"]
    evals = sorted({e["step"]: e["accuracy"] for e in summary["evals"]}.items())
    return {"evals": evals, "ticks": ticks, "wall_seconds": summary["wall_seconds"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--out", type=Path, required=True, help="the PNG to write")
    parser.add_argument("--title", default="", help="the picture's title")
    parser.add_argument("--eval-label", default="held-out greedy accuracy (64 problems)")
    args = parser.parse_args()
    data = curve(args.run_dir)
    print("| tick | training reward | samples with an observation | tool calls per sample |")
    print("|---|---|---|---|")
    for tick, reward, rate, calls in data["ticks"]:
        print(f"| {tick} | {reward:.3f} | {rate:.3f} | {calls:.2f} |")
    print("held-out greedy score:", ", ".join(f"tick {t}: {a:.3f}" for t, a in data["evals"]),
          f"({data['wall_seconds']:.0f} s)")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.6))
    ticks = [t[0] for t in data["ticks"]]
    ax.plot(ticks, [t[1] for t in data["ticks"]], label="training reward (sampled)", color="tab:blue")
    ax.plot(ticks, [t[2] for t in data["ticks"]], label="samples with an observation", color="tab:orange",
            linestyle="--")
    ax.plot([t for t, _ in data["evals"]], [a for _, a in data["evals"]], "o-", color="tab:green",
            label=args.eval_label)
    ax.set_xlabel("tick")
    ax.set_ylim(-0.02, 1.02)
    ax.set_title(args.title, fontsize=9)
    ax.legend(fontsize=8, loc="lower right")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out, dpi=110)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
