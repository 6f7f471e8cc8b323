"""Per-executor metrics: JSONL + TensorBoard, and the timeline trace and picture.

Each executor's first rank owns one ``MetricsLogger`` writing ``<run>/metrics/<executor>.jsonl``
and TensorBoard scalars under ``<run>/tensorboard/<executor>``. Every rank appends its busy spans
to ``<run>/timeline/rank<r>.json``; ``write_chrome_trace`` merges them into a Chrome-trace JSON
(``chrome://tracing`` / Perfetto) showing, per executor and tick, busy vs idle time — the
picture of LlamaRL's Figure 2.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
import torch.distributed as dist

logger = logging.getLogger("llamarl.metrics")


REDUCTIONS = ("sum", "mean", "max")


@dataclass(frozen=True)
class MetricSpec:
    """How an executor's metric is named and reduced over the executor's ranks, declared where it is
    produced (an executor's ``metric_specs``). Its TensorBoard tag is ``<executor>/<section>/<key>``."""

    section: str
    """Group of related metrics (``throughput``, ``rollouts``, ``loss``, ...)."""
    reduction: Literal["sum", "mean", "max"] = "mean"
    """Over the executor's ranks: ``sum`` (counts, throughput), ``mean`` (rates, averages) or ``max``."""
    weight: str | None = None
    """``mean`` only: the key of another metric weighting each rank's value (e.g. its sample count);
    None weighs every reporting rank equally."""

    def __post_init__(self) -> None:
        if self.reduction not in REDUCTIONS:
            raise ValueError(f"metric reduction must be one of {REDUCTIONS}, got {self.reduction!r}")


def reduce_metrics(metrics: dict[str, float], specs: dict[str, MetricSpec], *, group, device: torch.device,
                   size: int) -> dict[str, float]:
    """The executor-wide value of every declared metric that any of its ``size`` ranks reported.

    Collective over ``group`` (two small all-reduces, skipped when ``size`` is 1): every rank of the
    executor calls it each tick with its own ``metrics`` and the same ``specs``. A rank that did
    not report a key does not count in its reduction. Undeclared keys pass through with this rank's
    value (a user executor that declares nothing is logged from its first rank, as before).
    """
    keys = sorted(specs)
    if size > 1 and keys:
        sums = torch.zeros(3 * len(keys), dtype=torch.float64, device=device)  # value·weight, weight, present
        maxes = torch.full((len(keys),), float("-inf"), dtype=torch.float64, device=device)
        for i, key in enumerate(keys):
            if key not in metrics:
                continue
            spec, value = specs[key], float(metrics[key])
            weight = float(metrics.get(spec.weight, 0.0)) if spec.weight else 1.0
            sums[i] = value * weight if spec.reduction == "mean" else value
            sums[len(keys) + i] = weight
            sums[2 * len(keys) + i] = 1.0
            maxes[i] = value
        dist.all_reduce(sums, group=group)
        dist.all_reduce(maxes, op=dist.ReduceOp.MAX, group=group)
        totals = sums.tolist()
        present = totals[2 * len(keys):]
        reduced = {}
        for i, key in enumerate(keys):
            if present[i] == 0:
                continue
            reduction = specs[key].reduction
            if reduction == "max":
                reduced[key] = float(maxes[i])
            elif reduction == "sum":
                reduced[key] = totals[i]
            else:
                weight = totals[len(keys) + i]
                reduced[key] = totals[i] / weight if weight > 0 else 0.0
    else:
        reduced = {k: float(v) for k, v in metrics.items() if k in specs}
    return {**reduced, **{k: float(v) for k, v in metrics.items() if k not in specs}}


class MetricsLogger:
    """Writes one JSON object per step (and TensorBoard scalars) for one executor."""

    def __init__(self, run_dir: Path, executor: str, *, tensorboard: bool = True, start_step: int = 0,
                 specs: dict[str, MetricSpec] | None = None) -> None:
        """``start_step`` > 0 (a resumed run) drops the records of ticks >= it that an interrupted run
        already wrote (the runner has moved them aside before: ``llamarl.runtime.checkpoint.archive_after``),
        and TensorBoard hides its events of those ticks (``purge_step``), so each tick appears once,
        as the resumed run computes it. ``specs`` give the TensorBoard sections
        (``<executor>/<section>/<key>``; ``misc`` for undeclared keys)."""
        self.executor, self.specs = executor, specs or {}
        (run_dir / "metrics").mkdir(parents=True, exist_ok=True)
        path = run_dir / "metrics" / f"{executor}.jsonl"
        if start_step > 0 and path.exists():
            kept = [line for line in path.read_text(encoding="utf-8").splitlines()
                    if line.strip() and json.loads(line).get("step", 0) < start_step]
            path.write_text("".join(line + "\n" for line in kept), encoding="utf-8")
        # Kept open for the whole run (one append per step); closed by close().
        self.jsonl = open(path, "a", encoding="utf-8")  # noqa: SIM115
        self.writer = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(log_dir=str(run_dir / "tensorboard" / executor),
                                        purge_step=start_step if start_step > 0 else None)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        record = {"step": step, "time": time.time(), **{k: float(v) for k, v in metrics.items()}}
        self.jsonl.write(json.dumps(record) + "\n")
        self.jsonl.flush()
        if self.writer is not None:
            for tag, value in self.tags(metrics).items():
                self.writer.add_scalar(tag, value, step)

    def tags(self, metrics: dict[str, float]) -> dict[str, float]:
        """``metrics`` under their TensorBoard tags, ``<executor>/<section>/<key>`` (also W&B's keys)."""
        return {f"{self.executor}/{self.specs[key].section if key in self.specs else 'misc'}/{key}": float(value)
                for key, value in metrics.items()}

    def close(self) -> None:
        self.jsonl.close()
        if self.writer is not None:
            self.writer.close()


def write_chrome_trace(run_dir: Path, spans: list[dict], *, out_name: str = "timeline.json") -> Path:
    """Chrome-trace JSON of busy spans: each ``{"executor", "rank", "step", "start", "end"}``."""
    origin = min((s["start"] for s in spans), default=0.0)
    events = [{"name": f"{s['executor']} {s.get('kind', 'step')} {s['step']}", "ph": "X", "pid": s["executor"],
               "tid": s["rank"],
               "ts": (s["start"] - origin) * 1e6, "dur": (s["end"] - s["start"]) * 1e6} for s in spans]
    path = run_dir / out_name
    path.write_text(json.dumps({"traceEvents": events}))
    return path


def write_timeline_png(run_dir: Path, spans: list[dict], *, title: str = "", out_name: str = "timeline.png") -> Path:
    """The picture of LlamaRL's Figure 2: one row per executor on each rank (co-resident executors
    get a row each); per tick its busy step (solid), its evaluations (solid, their own colour), its
    channels (hatched; weight syncs in their own colour) and, as the gaps, the time it waited. ``spans`` as for ``write_chrome_trace`` with ``kind`` = ``step`` or a channel name."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    origin = min((s["start"] for s in spans), default=0.0)
    rows = sorted({(s["rank"], s["executor"]) for s in spans})
    fig, ax = plt.subplots(figsize=(12, 0.6 * len(rows) + 1.5))
    colours = {"step": "tab:blue", "weights": "tab:red", "eval": "tab:green"}
    for y, (rank, executor) in enumerate(rows):
        for s in (s for s in spans if s["rank"] == rank and s["executor"] == executor):
            kind = s.get("kind", "step")
            ax.barh(y, s["end"] - s["start"], left=s["start"] - origin, height=0.6,
                    color=colours.get(kind, "tab:gray"), hatch=None if kind in ("step", "eval") else "//",
                    edgecolor="black", linewidth=0.3)
    ax.set_yticks(range(len(rows)), [f"{executor} (rank {rank})" for rank, executor in rows])
    ax.invert_yaxis()
    ax.set_xlabel("seconds since the first span (gaps: waiting)")
    from matplotlib.patches import Patch

    ax.legend(handles=[Patch(color="tab:blue", label="step (busy)"), Patch(color="tab:green", label="evaluation"),
                       Patch(color="tab:red", label="weight sync (incl. waiting for the peer)"),
                       Patch(color="tab:gray", label="data channel (incl. waiting for the peer)")], loc="upper right", fontsize=8)
    ax.set_title(title)
    fig.tight_layout()
    path = run_dir / out_name
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
