"""What a run leaves when it ends (part of ``llamarl/run/runner.py``): ``summary.json``, the Chrome
trace and the timeline picture.

Written by the reporting rank (the evaluator's first rank, global rank 0 when there is no
evaluator) after every rank wrote its spans (``timeline/rank<r>.json``, ``llamarl/run/run_log.py``).
``summary.json`` holds, in this order:

- ``base_accuracy`` (when known), ``final_accuracy`` and ``evals`` (every evaluation of the whole
  run: step, seconds into the run, accuracy, weight version), on a run with an evaluator; then
  ``num_steps`` (``--run.max-steps``), ``wall_seconds`` (every segment of a resumed run, each up to
  its last recorded state) and ``resumed_from_step`` (the steps resumed from, ``[]`` for a run never
  resumed): the run's history (``Evaluations.summary``, ``llamarl/run/evaluations.py``);
- the pipeline's own entries (``Pipeline.summary``: the schedule, the loss, a recipe's additions);
- ``<key>_mean`` for every ``*_tokens_per_s`` metric an executor reported (its mean over the ticks
  that reported it);
- ``peak_gpu_memory_gib``: the largest ``torch.cuda.max_memory_allocated`` of any rank (absent in a
  world without GPUs).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from pathlib import Path

from llamarl.runtime.metrics import write_chrome_trace, write_timeline_png

logger = logging.getLogger("llamarl.runner")


class RunSummary:
    """The end of a run's record (module docstring)."""

    def __init__(self, run_dir: Path, *, title: str, entries: dict, world_size: int) -> None:
        """``title``: the timeline picture's; ``entries``: the pipeline's own ``summary.json``
        entries; ``world_size``: the ranks whose spans ``timeline/rank<r>.json`` holds."""
        self.run_dir, self.title, self.entries, self.world_size = run_dir, title, entries, world_size

    def write(self, history: Callable[[], dict], *, peak_gib: float | None) -> dict:
        """On the reporting rank, after every rank wrote its spans: the Chrome trace, the timeline
        picture and ``summary.json``; returns the summary. ``history()``: the run's accuracy and time
        (its first entries), asked for last, so that ``wall_seconds`` includes the pictures;
        ``peak_gib``: the peak device memory (None without GPUs)."""
        # This world's ranks only: an earlier segment of a resumed run may have had more.
        all_spans = [s for r in range(self.world_size)
                     for s in json.loads((self.run_dir / "timeline" / f"rank{r}.json").read_text())]
        write_chrome_trace(self.run_dir, all_spans)
        write_timeline_png(self.run_dir, all_spans, title=self.title)
        result = {**history(), **self.entries, **throughput(self.run_dir)}
        if peak_gib is not None:
            result["peak_gpu_memory_gib"] = peak_gib
        (self.run_dir / "summary.json").write_text(json.dumps(result, indent=2))
        if "final_accuracy" in result:
            logger.info("base accuracy %.1f%% -> final accuracy %.1f%% in %d steps, %.0f s (summary: %s)",
                        100 * result.get("base_accuracy", float("nan")), 100 * result["final_accuracy"],
                        result["num_steps"], result["wall_seconds"], self.run_dir / "summary.json")
        return result


def throughput(run_dir: Path) -> dict[str, float]:
    """The mean of every ``*_tokens_per_s`` metric any executor reported (``<key>_mean``), over the
    ticks that reported it (executors report throughput only for steps that did work)."""
    values: dict[str, list[float]] = {}
    for path in sorted((run_dir / "metrics").glob("*.jsonl")):
        for record in map(json.loads, path.read_text().splitlines()):
            for key, value in record.items():
                if key.endswith("_tokens_per_s"):
                    values.setdefault(key, []).append(value)
    return {f"{key}_mean": sum(v) / len(v) for key, v in sorted(values.items())}
