"""What a run records each tick (part of ``llamarl/run/runner.py``): spans, metrics, the progress line,
training samples and Weights & Biases, and at its end the peak device memory of every rank.

Per tick and per executor on this rank: its busy and channel spans (the Chrome trace and
``timeline.png``), its metrics reduced over its ranks as ``metric_specs`` declares (collective over
its group), the headline metrics on rank 0's progress line (one WORLD all-reduce), and, on its
first rank, one JSONL / TensorBoard record per metric section. The inbound end of a weights
channel also logs the sync's ``weight_sync_seconds`` / ``weight_sync_skipped`` / ``weight_sync_bytes``
(the weight bytes this rank received, or copied in place from a co-resident trainer).

With ``--run.log-samples N``, the first N scored samples the trainer's first rank receives each
tick go to ``<run>/samples.jsonl`` (``llamarl/runtime/sample_log.py``). With ``--run.wandb-project``, the
reporting rank's W&B run (``llamarl/run/wandb_log.py``) gets every record the metric files get, with
its tick (gathered over WORLD each tick), and each evaluation's accuracy and rollouts
(``evaluated``, called by ``Evaluations`` on the rank that reports them).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.distributed as dist

from llamarl.run.config import RunConfig
from llamarl.run.directory import current_config
from llamarl.run.wandb_log import WandbLog, gather_json
from llamarl.runtime.metrics import MetricsLogger, reduce_metrics
from llamarl.runtime.progress import Progress
from llamarl.runtime.sample_log import SampleLog


class RunLog:
    """This rank's records of a run (module docstring)."""

    def __init__(self, *, contexts: dict, run_dir: Path, start_step: int, progress: Progress,
                 weight_channels: list, run: RunConfig | None = None, executors: dict | None = None,
                 reporter_rank: int = 0) -> None:
        """``run``: its ``log_samples`` and ``wandb_*`` (None: neither); ``executors``: this rank's,
        whose inputs the sample log reads; ``reporter_rank``: the rank holding the W&B run."""
        self.contexts, self.run_dir, self.start_step = contexts, run_dir, start_step
        self.progress = progress
        self.weight_channels = weight_channels
        self.leaders = {name: context.local_rank == 0 for name, context in contexts.items()}
        self.spans: list[dict] = []
        self.loggers: dict[str, MetricsLogger] = {}
        self._sections: dict[str, dict[str, dict[str, float]]] = {}
        run = run or RunConfig()
        self.samples = SampleLog(run_dir, count=run.log_samples, start_step=start_step)
        self.samples.attach(executors or {}, contexts)
        ctx = next(iter(contexts.values()))
        self.gathers = run.wandb_project is not None  # the same on every rank: a collective each tick
        self.wandb: WandbLog | None = None
        if self.gathers and ctx.rank == reporter_rank:
            config_file = current_config(run_dir)
            self.wandb = WandbLog.start(project=run.wandb_project, name=run.wandb_run_name, entity=run.wandb_entity,
                                        run_dir=run_dir, config=json.loads(config_file.read_text())
                                        if config_file.is_file() else None, resumed=start_step > 0)

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
        """On each executor's first rank: one record per metric section of tick ``step``; with W&B,
        every rank's records to the reporting rank's W&B run (collective over WORLD)."""
        tags: dict[str, float] = {}
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
                tags.update(self.loggers[section].tags(metrics))
        if self.gathers:
            ctx = next(iter(self.contexts.values()))
            gathered = gather_json(tags, device=ctx.world_device, world_size=ctx.world_size)
            if self.wandb is not None:
                self.wandb.log_metrics(step, {k: v for rank_tags in gathered for k, v in rank_tags.items()})

    def evaluated(self, step: int, accuracy: float, samples_path: Path) -> None:
        """An evaluation after ``step`` ticks (on the rank that reports it): its accuracy and the
        rollouts of ``samples_path`` (an ``eval_*.jsonl``) to W&B, with this rank's latest samples."""
        if self.wandb is None:
            return
        records = [json.loads(line) for line in samples_path.read_text(encoding="utf-8").splitlines()
                   if line.strip()] if samples_path.is_file() else []
        self.wandb.log_evaluation(step, accuracy, records, samples=self.samples.latest)

    def close(self, *, extra_spans: list[dict], rank: int) -> None:
        """Flush the metric files and write this rank's spans (``timeline/rank<r>.json``)."""
        self.progress.close()
        self.samples.close()
        if self.wandb is not None:
            self.wandb.close()
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
