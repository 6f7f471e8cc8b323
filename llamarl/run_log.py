"""What a run records each tick (part of ``llamarl/runner.py``): spans, metrics, the progress line,
and at its end the peak device memory of every rank.

Per tick and per executor on this rank: its busy and channel spans (the Chrome trace and
``timeline.png``), its metrics reduced over its ranks as ``metric_specs`` declares (collective over
its group), the headline metrics on rank 0's progress line (one WORLD all-reduce), and, on its
first rank, one JSONL / TensorBoard record per metric section. The inbound end of a weights
channel also logs the sync's ``weight_sync_seconds`` / ``weight_sync_skipped`` / ``weight_sync_bytes``
(the weight bytes this rank received, or copied in place from a co-resident trainer).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.distributed as dist

from llamarl.metrics import MetricsLogger, reduce_metrics
from llamarl.progress import Progress


class RunLog:
    """This rank's records of a run (module docstring)."""

    def __init__(self, *, contexts: dict, run_dir: Path, start_step: int, progress: Progress,
                 weight_channels: list) -> None:
        self.contexts, self.run_dir, self.start_step = contexts, run_dir, start_step
        self.progress = progress
        self.weight_channels = weight_channels
        self.leaders = {name: context.local_rank == 0 for name, context in contexts.items()}
        self.spans: list[dict] = []
        self.loggers: dict[str, MetricsLogger] = {}
        self._sections: dict[str, dict[str, dict[str, float]]] = {}

    def tick(self, step: int, ticked: dict) -> None:
        """The controller's ``on_tick``: ``reduce`` then ``write`` (collective, as ``reduce``)."""
        self.reduce(step, ticked)
        self.write(step, ticked)

    def reduce(self, step: int, ticked: dict) -> None:
        """Spans and reduced metrics of tick ``step`` (``ticked``: name -> (executor, TickRecord)),
        then the progress line. Collective: every rank of every executor group, and WORLD."""
        rank = next(iter(self.contexts.values())).rank
        self._sections = {}
        for name, (executor, record) in ticked.items():
            self.spans.extend({"executor": name, "rank": rank, "step": step, "start": a, "end": b, "kind": "step"}
                              for a, b in record.step_spans)
            self.spans.extend({"executor": name, "rank": rank, "step": step, "start": a, "end": b, "kind": kind}
                              for kind, a, b in record.channel_spans)
            context, specs = self.contexts[name], getattr(executor, "metric_specs", {})
            self._sections[name] = {
                section: reduce_metrics(values or {}, specs, group=context.group, device=context.device,
                                        size=context.local_world_size)
                for section, values in (executor.metric_sections or {name: executor.metrics}).items()}
        self.progress.update(step, reported={
            name: {k: v for values in sections.values() for k, v in values.items()}
            for name, sections in self._sections.items() if self.leaders[name]})

    def write(self, step: int, ticked: dict) -> None:
        """On each executor's first rank: one record per metric section of tick ``step``."""
        for name, (executor, record) in ticked.items():
            if not self.leaders[name]:
                continue
            weight_inbound = [c for c in self.weight_channels if c.inbound == name]
            for index, (section, values) in enumerate(self._sections[name].items()):
                if not values:
                    continue
                metrics = {**values, "channel_seconds": record.channel_seconds, "step_seconds": record.step_seconds}
                if weight_inbound and index == 0:
                    metrics["weight_sync_seconds"] = sum(c.last_seconds for c in weight_inbound)
                    metrics["weight_sync_skipped"] = float(all(c.last_skipped for c in weight_inbound))
                    metrics["weight_sync_bytes"] = float(sum(c.last_bytes_received for c in weight_inbound))
                if section not in self.loggers:
                    self.loggers[section] = MetricsLogger(self.run_dir, section, start_step=self.start_step,
                                                          specs=getattr(executor, "metric_specs", {}))
                self.loggers[section].log(step, metrics)

    def close(self, *, extra_spans: list[dict], rank: int) -> None:
        """Flush the metric files and write this rank's spans (``timeline/rank<r>.json``)."""
        self.progress.close()
        (self.run_dir / "timeline").mkdir(exist_ok=True)
        (self.run_dir / "timeline" / f"rank{rank}.json").write_text(json.dumps(self.spans + extra_spans))
        for metrics_logger in self.loggers.values():
            metrics_logger.close()

    def peak_memory_gib(self) -> float | None:
        """The largest ``torch.cuda.max_memory_allocated`` of any rank, in GiB (a WORLD all-reduce on
        every rank; a CPU rank of a mixed world adds 0); None in a world without GPUs, where no
        allocator statistics exist (then no rank takes part)."""
        ctx = next(iter(self.contexts.values()))
        if ctx.device.type != "cuda" and "cuda" not in ctx.device_kinds.values():
            return None
        used = torch.cuda.max_memory_allocated(ctx.device) / 2**30 if ctx.device.type == "cuda" else 0.0
        peak = torch.tensor([used], device=ctx.world_device)
        dist.all_reduce(peak, op=dist.ReduceOp.MAX)
        return round(peak.item(), 3)
