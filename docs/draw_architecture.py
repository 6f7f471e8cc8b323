"""Draw docs/architecture.png (executors, channels, controller, DDMA) and docs/schedules.png (one
tick of each schedule), the pictures of docs/architecture.md.

    .venv/bin/python docs/draw_architecture.py          # rewrites both PNGs beside this file

The pictures are schematic: what they show is taken from llamarl/run/stages.py,
llamarl/rl/standard_pipeline.py and the tick timelines in llamarl/run/controller.py's docstring; bar
lengths in schedules.png are illustrative, not measured (a run's own timeline.png is measured).
"""

from __future__ import annotations

import logging
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from matplotlib.patches import FancyArrowPatch, FancyBboxPatch, Patch, Rectangle

logger = logging.getLogger("llamarl.docs")
HERE = Path(__file__).resolve().parent
COLOURS = {"generator": "#cfe2f3", "reward": "#d9ead3", "trainer": "#fce5cd", "controller": "#eeeeee",
           "world": "#f3f3f3", "rollouts": "#b4a7d6", "scored": "#93c47d", "weights": "#e06666"}
STEP_COLOURS = {"generate": "tab:blue", "score": "tab:green", "train": "tab:orange", "copy": "tab:red"}


def _box(ax, x, y, w, h, colour, *, lw=1.2, style="round,pad=0.005,rounding_size=0.012"):
    ax.add_patch(FancyBboxPatch((x, y), w, h, boxstyle=style, facecolor=colour, edgecolor="black", linewidth=lw))


def _arrow(ax, start, end, colour, *, rad=0.0, lw=2.0):
    ax.add_patch(FancyArrowPatch(start, end, arrowstyle="-|>", mutation_scale=16, color=colour, lw=lw,
                                 connectionstyle=f"arc3,rad={rad}"))


def _executor(ax, x, w, name, lines, ranks, colour):
    """An executor box at [x, x+w] with its name, description lines and one square per rank."""
    y, h = 0.60, 0.27
    _box(ax, x, y, w, h, colour)
    ax.text(x + w / 2, y + h - 0.03, name, ha="center", va="top", fontsize=12, weight="bold")
    for i, line in enumerate(lines):
        ax.text(x + w / 2, y + h - 0.075 - 0.032 * i, line, ha="center", va="top", fontsize=8.5)
    size, gap = 0.036, 0.008
    left = x + (w - len(ranks) * size - (len(ranks) - 1) * gap) / 2
    for i, label in enumerate(ranks):
        ax.add_patch(Rectangle((left + i * (size + gap), y + 0.015), size, 0.05, facecolor="white",
                               edgecolor="black", linewidth=0.8))
        ax.text(left + i * (size + gap) + size / 2, y + 0.04, label, ha="center", va="center", fontsize=7.5)


def _pipeline_panel(ax):
    ax.set_axis_off()
    ax.set_xlim(0, 1)
    ax.set_ylim(0, 1)
    ax.set_title("One torchrun world split into executors (8 ranks: --generator.num-ranks 2 --generator.tp 2 "
                 "--reward.num-ranks 1)", fontsize=11)
    _executor(ax, 0.02, 0.24, "generator", ["ranks 0-1: mesh (dp 1, tp 2)",
                                            "engine: torch (KV cache) or vLLM",
                                            "step(): sample prompt groups"], ["r0", "r1"], COLOURS["generator"])
    _executor(ax, 0.405, 0.21, "reward", ["rank 2: a scorer process pool",
                                         "(timeouts and errors score 0)",
                                         "step(): add rewards"], ["r2"], COLOURS["reward"])
    _executor(ax, 0.74, 0.24, "trainer", ["ranks 3-7: FSDP2 mesh, Shard(0)",
                                          "loss from the registry (AIPO, ...)",
                                          "step(): one optimizer step"], ["r3", "r4", "r5", "r6", "r7"],
              COLOURS["trainer"])
    _arrow(ax, (0.265, 0.70), (0.40, 0.70), "#674ea7")
    ax.text(0.3325, 0.86, "rollouts: SCATTER\nnext tick (lag 2)\nsame tick (lag 1, sync)", ha="center", va="top",
            fontsize=7.5, color="#351c75")
    _arrow(ax, (0.62, 0.70), (0.735, 0.70), "#38761d")
    ax.text(0.6775, 0.86, "scored: SCATTER\nnext tick (async)\nsame tick (sync)", ha="center", va="top",
            fontsize=7.5, color="#274e13")
    _arrow(ax, (0.86, 0.595), (0.14, 0.595), COLOURS["weights"], rad=-0.1, lw=2.5)
    ax.text(0.5, 0.475, "weights: WeightsChannel (DDMA), next tick; also once after init and after the last tick\n"
            "each trainer shard goes straight to the generator ranks holding that slice (static plan, one bucket "
            "per pair)", ha="center", va="center", fontsize=8, color="#990000")
    _box(ax, 0.02, 0.20, 0.96, 0.16, COLOURS["controller"])
    ax.text(0.5, 0.335, "ExecutorController (llamarl/run/controller.py): the same SPMD loop on every rank", ha="center",
            va="top", fontsize=10, weight="bold")
    ax.text(0.5, 0.285, "init; init channels (weights) | each tick: set_step -> next-tick channels -> for each "
            "executor in data order:\nits same-tick inbound channels, then its step() | checkpoint / export when "
            "due | metrics + progress (one WORLD all-reduce)", ha="center", va="top", fontsize=8.5)
    _box(ax, 0.02, 0.02, 0.96, 0.15, COLOURS["world"])
    ax.text(0.5, 0.15, "ExecutorContext (llamarl/runtime/world.py)", ha="center", va="top", fontsize=10, weight="bold")
    ax.text(0.5, 0.105, "consecutive rank ranges in stage order; one process group + DeviceMesh per executor (2-D "
            "(dp, tp) when tp > 1),\ncreated once, in the same order, on every rank; nccl on CUDA, gloo on CPU; "
            "channels send point-to-point between their two ends", ha="center", va="top", fontsize=8.5)


def _kinds_panel(ax):
    """BROADCAST / SCATTER / GATHER with two outbound and two inbound ranks."""
    ax.set_axis_off()
    ax.set_xlim(0, 3)
    ax.set_ylim(0, 1)
    ax.set_title("Data channel kinds (TensorBatch, point-to-point, no pickle)", fontsize=10)
    kinds = [("BROADCAST", ["A", "B"], ["A B", "A B"]), ("SCATTER", ["A", "B"], ["g0 g2", "g1 g3"]),
             ("GATHER", ["A", "B"], ["A B", "(empty)"])]
    for k, (name, outs, ins) in enumerate(kinds):
        x0 = k + 0.05
        ax.text(x0 + 0.45, 0.93, name, ha="center", va="top", fontsize=9, weight="bold")
        for i, (out, inn) in enumerate(zip(outs, ins)):
            y = 0.58 - 0.33 * i
            ax.add_patch(Rectangle((x0, y), 0.22, 0.2, facecolor=COLOURS["generator"], edgecolor="black", lw=0.8))
            ax.text(x0 + 0.11, y + 0.1, out, ha="center", va="center", fontsize=8)
            ax.add_patch(Rectangle((x0 + 0.6, y), 0.3, 0.2, facecolor=COLOURS["trainer"], edgecolor="black", lw=0.8))
            ax.text(x0 + 0.75, y + 0.1, inn, ha="center", va="center", fontsize=8)
        for i in range(2):
            for j in range(2):
                if name == "GATHER" and j == 1:
                    continue
                _arrow(ax, (x0 + 0.23, 0.68 - 0.33 * i), (x0 + 0.59, 0.68 - 0.33 * j), "gray", lw=0.8)
    ax.text(1.5, 0.08, "SCATTER never splits a prompt's group (g0..g3: groups of samples); GATHER lands on the "
            "inbound executor's first rank", ha="center", va="center", fontsize=7.5)


def _ddma_panel(ax):
    """One weight matrix: five trainer Shard(0) stripes into two generator TP halves."""
    ax.set_axis_off()
    ax.set_xlim(0, 1)
    ax.set_ylim(0, 1)
    ax.set_title("DDMA for one parameter: trainer shards -> TP shards", fontsize=10)
    top, height = 0.88, 0.75
    for i in range(5):
        y = top - (i + 1) * height / 5
        ax.add_patch(Rectangle((0.08, y), 0.16, height / 5, facecolor=COLOURS["trainer"], edgecolor="black", lw=0.8))
        ax.text(0.16, y + height / 10, f"r{i + 3}", ha="center", va="center", fontsize=8)
    for j in range(2):
        y = top - (j + 1) * height / 2
        ax.add_patch(Rectangle((0.66, y), 0.16, height / 2, facecolor=COLOURS["generator"], edgecolor="black", lw=0.8))
        ax.text(0.74, y + height / 4, f"r{j} (tp {j})", ha="center", va="center", fontsize=8)
    # Trainer stripe i covers rows [i/5, (i+1)/5); generator half j covers [j/2, (j+1)/2).
    for i in range(5):
        for j in range(2):
            lo, hi = max(i / 5, j / 2), min((i + 1) / 5, (j + 1) / 2)
            if lo < hi:
                mid = (lo + hi) / 2
                _arrow(ax, (0.245, top - mid * height), (0.655, top - mid * height), "#cc0000", lw=1.0)
    ax.text(0.45, 0.05, "r5's stripe is split: its halves go to r0 and r1", ha="center", fontsize=7.5)
    ax.text(0.16, 0.92, "trainer", ha="center", fontsize=8, weight="bold")
    ax.text(0.74, 0.92, "generator", ha="center", fontsize=8, weight="bold")


def draw_architecture(path: Path) -> None:
    """The pipeline, the controller and the world (top), channel kinds and DDMA (bottom)."""
    fig = plt.figure(figsize=(12, 8.6))
    grid = fig.add_gridspec(2, 2, height_ratios=[2.1, 1], width_ratios=[1.75, 1], hspace=0.08, wspace=0.05)
    _pipeline_panel(fig.add_subplot(grid[0, :]))
    _kinds_panel(fig.add_subplot(grid[1, 0]))
    _ddma_panel(fig.add_subplot(grid[1, 1]))
    fig.savefig(path, dpi=90, bbox_inches="tight")
    plt.close(fig)


# One tick per schedule: (row, start, length, kind, label); kind is a step colour or a channel name.
SCHEDULES = {
    "async, --run.async-lag 2 (LlamaRL Algorithm 1): every channel next tick": (
        ["generator", "reward", "trainer"],
        [("generator", 0, 0.6, "rollouts", ""), ("reward", 0, 0.6, "rollouts", ""),
         ("reward", 0.6, 0.6, "scored", ""), ("trainer", 0, 1.2, "scored", ""),
         ("trainer", 1.2, 1.0, "weights", ""), ("generator", 0.6, 1.6, "weights", ""),
         ("generator", 2.2, 6.0, "generate", "generate batch t (weights of update t-1)"),
         ("reward", 1.2, 2.0, "score", "score batch t-1"),
         ("trainer", 2.2, 5.0, "train", "train on batch t-2 -> update t")]),
    "async, --run.async-lag 1: rollouts same tick, scored and weights next tick (the default placement runs the "
    "reward on the trainer's ranks, after its step)": (
        ["generator", "reward", "trainer"],
        [("reward", 0, 0.6, "scored", ""), ("trainer", 0, 0.6, "scored", ""),
         ("trainer", 0.6, 1.0, "weights", ""), ("generator", 0, 1.6, "weights", ""),
         ("generator", 1.6, 6.0, "generate", "generate batch t (weights of update t-1)"),
         ("generator", 7.6, 0.6, "rollouts", ""), ("reward", 0.6, 7.6, "rollouts", ""),
         ("reward", 8.2, 2.0, "score", "score batch t"),
         ("trainer", 1.6, 5.0, "train", "train on batch t-1 -> update t")]),
    "sync: rollouts and scored same tick, weights next tick (on-policy)": (
        ["generator", "reward", "trainer"],
        [("trainer", 0, 1.0, "weights", ""), ("generator", 0, 1.0, "weights", ""),
         ("generator", 1.0, 6.0, "generate", "generate batch t (weights of update t-1)"),
         ("generator", 7.0, 0.6, "rollouts", ""), ("reward", 0, 7.6, "rollouts", ""),
         ("reward", 7.6, 2.0, "score", "score t"),
         ("reward", 9.6, 0.6, "scored", ""), ("trainer", 1.0, 9.2, "scored", ""),
         ("trainer", 10.2, 5.0, "train", "train on batch t -> update t")]),
    "colocated: every stage on every rank, batches handed over in memory, weights copied in place (on-policy)": (
        ["generator", "reward", "trainer"],
        [("generator", 0, 6.0, "generate", "generate batch t"), ("reward", 6.0, 0.3, "rollouts", ""),
         ("reward", 6.3, 2.0, "score", "score t"), ("trainer", 8.3, 0.3, "scored", ""),
         ("trainer", 8.6, 5.0, "train", "train on batch t -> update t"),
         ("trainer", 13.6, 0.8, "weights", ""), ("generator", 13.6, 0.8, "weights", "")]),
}


def draw_schedules(path: Path) -> None:
    """One tick of each schedule as horizontal bars per executor (schematic lengths)."""
    heights = [len(rows) + 1.4 for rows, _ in SCHEDULES.values()]
    fig, axes = plt.subplots(len(SCHEDULES), 1, figsize=(12, 9), sharex=True,
                             gridspec_kw={"height_ratios": heights, "hspace": 0.55})
    for ax, (title, (rows, bars)) in zip(axes, SCHEDULES.items()):
        for row, start, length, kind, label in bars:
            y = rows.index(row)
            if kind in STEP_COLOURS:
                ax.barh(y, length, left=start, height=0.6, color=STEP_COLOURS[kind], edgecolor="black", lw=0.5)
            else:
                ax.barh(y, length, left=start, height=0.6, color=COLOURS[kind], hatch="//", edgecolor="black",
                        lw=0.5)
            if label:
                ax.text(start + length / 2, y, label, ha="center", va="center", fontsize=8, color="white",
                        weight="bold")
        end = max(start + length for _, start, length, _, _ in bars)
        ax.axvline(end, color="black", ls="--", lw=0.8)
        ax.text(end + 0.1, len(rows) - 0.75, "next tick", fontsize=8, va="center")
        ax.set_yticks(range(len(rows)), rows)
        ax.set_ylim(len(rows) - 0.4, -0.6)
        ax.set_title(title, fontsize=10, loc="left")
        ax.grid(axis="x", alpha=0.3)
    axes[-1].set_xlim(0, 16.5)
    axes[-1].set_xlabel("time within one tick (schematic; gaps are waiting: a channel bar lasts until both ends "
                        "are there)")
    handles = [Patch(color=STEP_COLOURS[k], label=f"step: {k}") for k in ("generate", "score", "train")]
    handles += [Patch(facecolor=COLOURS[c], hatch="//", edgecolor="black", label=f"channel: {c}")
                for c in ("rollouts", "scored", "weights")]
    handles.append(Patch(color=STEP_COLOURS["copy"], label="in-place weight copy (colocated)"))
    fig.legend(handles=handles, loc="lower center", ncol=4, fontsize=8, frameon=False)
    fig.subplots_adjust(top=0.91, bottom=0.12, left=0.09, right=0.97)
    fig.suptitle("One tick of each schedule of the generator -> reward -> trainer pipeline", fontsize=12, y=0.985)
    fig.savefig(path, dpi=90)
    plt.close(fig)


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    for name, draw in (("architecture.png", draw_architecture), ("schedules.png", draw_schedules)):
        draw(HERE / name)
        logger.info("wrote %s (%d KB)", HERE / name, (HERE / name).stat().st_size // 1024)


if __name__ == "__main__":
    main()
