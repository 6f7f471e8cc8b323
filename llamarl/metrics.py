"""Per-executor metrics: JSONL + TensorBoard, a one-line console progress, and a timeline trace.

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
from pathlib import Path

logger = logging.getLogger("llamarl.metrics")


class MetricsLogger:
    """Writes one JSON object per step (and TensorBoard scalars) for one executor."""

    def __init__(self, run_dir: Path, executor: str, *, tensorboard: bool = True, start_step: int = 0) -> None:
        """``start_step`` > 0 (a resumed run) drops the records of ticks >= it that an interrupted run
        already wrote, so each tick appears once, as the resumed run computes it."""
        self.executor = executor
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

            self.writer = SummaryWriter(log_dir=str(run_dir / "tensorboard" / executor))

    def log(self, step: int, metrics: dict[str, float]) -> None:
        record = {"step": step, "time": time.time(), **{k: float(v) for k, v in metrics.items()}}
        self.jsonl.write(json.dumps(record) + "\n")
        self.jsonl.flush()
        if self.writer is not None:
            for key, value in metrics.items():
                self.writer.add_scalar(f"{self.executor}/{key}", float(value), step)

    def close(self) -> None:
        self.jsonl.close()
        if self.writer is not None:
            self.writer.close()


def progress_line(step: int, max_steps: int, executor: str, metrics: dict[str, float], keys: list[str]) -> None:
    """Log ``[step/max] executor k=v ...`` for the keys present (console progress)."""
    shown = " ".join(f"{k}={metrics[k]:.4g}" for k in keys if k in metrics)
    logger.info("[%3d/%d] %-9s %s", step + 1, max_steps, executor, shown)


def write_chrome_trace(run_dir: Path, spans: list[dict], *, out_name: str = "timeline.json") -> Path:
    """Chrome-trace JSON of busy spans: each ``{"executor", "rank", "step", "start", "end"}``."""
    origin = min((s["start"] for s in spans), default=0.0)
    events = [{"name": f"{s['executor']} step {s['step']}", "ph": "X", "pid": s["executor"], "tid": s["rank"],
               "ts": (s["start"] - origin) * 1e6, "dur": (s["end"] - s["start"]) * 1e6} for s in spans]
    path = run_dir / out_name
    path.write_text(json.dumps({"traceEvents": events}))
    return path
