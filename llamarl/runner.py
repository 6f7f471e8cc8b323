"""run_pipeline: one entry point that runs any pipeline (llamarl/pipeline.py) on this rank.

It makes the world from the pipeline's stages (consecutive rank ranges, groups and meshes in
``llamarl/world.py``), builds this rank's executor with its stage's ``build``, builds the channels,
and runs the controller with checkpoints, exports, liveness, the device guard, metrics (JSONL +
TensorBoard per executor, rank 0's progress bar), evaluations and the run's artefacts: the
Chrome trace and the timeline PNG of every rank's busy / channel spans, and ``summary.json``.

The runner knows nothing about what an executor does. Executors report their metrics in
``executor.metrics`` after each step (an executor hosting several roles may report one section per
role in ``executor.metric_sections``) and declare how each is reduced over their ranks in
``executor.metric_specs`` (``llamarl.metrics.MetricSpec``: section, sum / mean / max); the runner
reduces them over the executor's group every tick and its first rank logs them. The inbound end of a ``weights`` channel also reports the
sync's ``weight_sync_seconds`` / ``weight_sync_skipped``. The pipeline's ``evaluator`` stage
evaluates greedy accuracy on the held-out problems before training, every ``--run.eval-every``
ticks and after the last tick (with the final weights), on every rank of its first data-parallel
replica (collective over a TP group); its first rank writes ``summary.json``.

``config`` is any dataclass with the ``run``, ``checkpoint`` and ``export`` sections of ``RLConfig``
(it is also written to ``config.json``).
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

import torch
import torch.distributed as dist

from llamarl.channels.weights import WeightsChannel
from llamarl.checkpoint import resolve_resume
from llamarl.controller import ExecutorController
from llamarl.data.prompts import Problem
from llamarl.log import setup_logging
from llamarl.metrics import MetricsLogger, reduce_metrics, write_chrome_trace, write_timeline_png
from llamarl.pipeline import Pipeline
from llamarl.progress import Progress
from llamarl.world import ExecutorContext

logger = logging.getLogger("llamarl.runner")


def _shared_run_dir(output_dir: str | None, recipe: str, device: torch.device) -> Path:
    """The same run directory on every rank: rank 0's timestamp is broadcast (a tensor, no pickle)."""
    if output_dir:
        return Path(output_dir)
    stamp = torch.tensor([int(time.time())], dtype=torch.int64, device=device)
    dist.broadcast(stamp, src=0)
    return Path("runs") / f"{recipe}-{time.strftime('%Y%m%d-%H%M%S', time.localtime(int(stamp.item())))}"


def run_pipeline(pipeline: Pipeline, config, *, recipe: str, heldout: list[Problem] | None = None,
                 score: Callable[[str, str], float] | None = None) -> dict | None:
    """Run ``pipeline`` on this rank (every rank of the torchrun world calls it).

    Returns the summary dict on the evaluator's first rank (global rank 0 when there is no
    evaluator), None elsewhere. Any failure on any rank ends the job with one line naming the
    executor, rank, step and phase (llamarl/controller.py).
    """
    wall_start = time.time()
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    run = config.run
    channels = [spec.build() for spec in pipeline.channels]
    ctx = ExecutorContext.create(pipeline.specs(world_size), timeout_s=run.collective_timeout_s,
                                 channel_endpoints=[(c.outbound, c.inbound) for c in channels])
    setup_logging(executor=ctx.executor, rank=ctx.rank)
    executor = pipeline.stage(ctx.executor).build(ctx)
    init_channels = [c for c in channels if isinstance(c, WeightsChannel)]
    run_dir = _shared_run_dir(run.output_dir, recipe, ctx.device)
    run_dir.mkdir(parents=True, exist_ok=True)
    if ctx.rank == 0:
        (run_dir / "config.json").write_text(json.dumps(asdict(config), indent=2))
        logger.info("run directory %s; stages %s", run_dir,
                    ", ".join(f"{name} ranks {ranks}" for name, ranks in ctx.ranks.items()))

    resume_dir, start_step = resolve_resume(config.checkpoint.resume, run_dir / "checkpoints") \
        if config.checkpoint.resume else (None, 0)
    if resume_dir is not None and ctx.rank == 0:
        logger.info("resuming from %s (tick %d)", resume_dir, start_step)
    leader = ctx.local_rank == 0
    # Evaluation is collective over a TP group, so every rank of the evaluator's first replica runs it.
    evaluates = ctx.executor == pipeline.evaluator and ctx.dp_rank == 0
    reporter = ctx.rank == (ctx.ranks[pipeline.evaluator][0] if pipeline.evaluator else 0)
    loggers: dict[str, MetricsLogger] = {}
    spans: list[dict] = []
    summary: dict = {}
    evals: list[dict] = []
    progress = Progress(keys=pipeline.headline_keys(), max_steps=run.max_steps, start_step=start_step,
                        rank=ctx.rank, device=ctx.device)
    weight_inbound = [c for c in init_channels if c.inbound == ctx.executor]

    def record_eval(step: int, accuracy: float) -> None:
        version = getattr(executor, "version", None)
        evals.append({"step": step, "seconds": time.time() - wall_start, "accuracy": accuracy, "version": version})
        if leader:
            logger.info("eval after %d ticks: greedy accuracy %.1f%% (weights version %s, %.0f s into the run)",
                        step, 100 * accuracy, version, evals[-1]["seconds"])

    def on_tick(step, ex, record):
        spans.extend({"executor": ctx.executor, "rank": ctx.rank, "step": step, "start": a, "end": b, "kind": "step"}
                     for a, b in record.step_spans)
        spans.extend({"executor": ctx.executor, "rank": ctx.rank, "step": step, "start": a, "end": b, "kind": name}
                     for name, a, b in record.channel_spans)
        # An executor that hosts several roles (colocated) reports one metric section per role.
        # Each is reduced over the executor's ranks as its metrics declare (collective over the group).
        specs = getattr(ex, "metric_specs", {})
        sections = {section: reduce_metrics(values or {}, specs, group=ctx.group, device=ctx.device,
                                            size=ctx.local_world_size)
                    for section, values in (getattr(ex, "metric_sections", None) or {ctx.executor: ex.metrics}).items()}
        flat = {key: value for values in sections.values() for key, value in values.items()}
        progress.update(step, executor=ctx.executor, metrics=flat, reports=leader)
        every = run.eval_every
        if evaluates and every and (step + 1) % every == 0 and step + 1 < run.max_steps:
            with controller.guard():  # collective over a TP group: every rank of the replica runs it
                record_eval(step + 1, executor.evaluate(heldout, score,
                                                        samples_path=run_dir / f"eval_step_{step + 1}.jsonl"))
        if not leader:
            return
        for index, (section, values) in enumerate(sections.items()):
            if not values:
                continue
            metrics = {**values, "channel_seconds": record.channel_seconds, "step_seconds": record.step_seconds}
            if weight_inbound and index == 0:
                metrics["weight_sync_seconds"] = sum(c.last_seconds for c in weight_inbound)
                metrics["weight_sync_skipped"] = float(all(c.last_skipped for c in weight_inbound))
            if section not in loggers:
                loggers[section] = MetricsLogger(run_dir, section, start_step=start_step, specs=specs)
            loggers[section].log(step, metrics)

    def base_evaluation():
        # A resumed run's weights are not the base model's: reuse the first run's base evaluation.
        earlier = resume_dir.parents[1] / "eval_base.jsonl" if resume_dir is not None else None
        if earlier is not None and earlier.is_file():
            scores = [json.loads(line)["score"] for line in earlier.read_text().splitlines() if line.strip()]
            summary["base_accuracy"] = sum(scores) / max(len(scores), 1)
            return
        summary["base_accuracy"] = executor.evaluate(heldout, score, samples_path=run_dir / "eval_base.jsonl")
        record_eval(0, summary["base_accuracy"])

    export_dir = run_dir / "hf" if config.export.final or config.export.every else None
    controller = ExecutorController(ctx, executor, channels, max_steps=run.max_steps,
                                    executor_order=pipeline.order, init_channels=init_channels,
                                    checkpoint_every=config.checkpoint.every, checkpoint_keep=config.checkpoint.keep,
                                    checkpoint_dir=run_dir / "checkpoints", on_tick=on_tick,
                                    resume_dir=resume_dir, start_step=start_step,
                                    export_every=config.export.every, export_dir=export_dir,
                                    before_loop=base_evaluation if evaluates else None,
                                    device_guard=run.device_guard,
                                    liveness_timeout_s=run.liveness_timeout_s)
    controller.run()
    progress.close()
    try:
        with controller.guard():
            for channel in init_channels:  # the final policy, for the final evaluation
                channel.communicate(ctx, executor)
            if evaluates:
                summary["final_accuracy"] = executor.evaluate(heldout, score,
                                                              samples_path=run_dir / "eval_final.jsonl")
                record_eval(run.max_steps, summary["final_accuracy"])
                summary["evals"] = evals
    except BaseException as exc:  # noqa: BLE001 - same failure contract as the loop
        controller.abort(exc)
    close = getattr(executor, "close", None)
    if close is not None:
        close()
    (run_dir / "timeline").mkdir(exist_ok=True)
    (run_dir / "timeline" / f"rank{ctx.rank}.json").write_text(json.dumps(spans))
    for metrics_logger in loggers.values():
        metrics_logger.close()
    peak_gib = _peak_device_memory_gib(ctx)
    dist.barrier()
    controller.finish()
    result = None
    if reporter:
        all_spans = [s for f in sorted((run_dir / "timeline").glob("rank*.json")) for s in json.loads(f.read_text())]
        write_chrome_trace(run_dir, all_spans)
        write_timeline_png(run_dir, all_spans, title=f"{recipe}: {pipeline.title}" if pipeline.title else recipe)
        result = {**summary, "num_steps": run.max_steps, "wall_seconds": time.time() - wall_start,
                  **pipeline.summary, **_throughput(run_dir)}
        if peak_gib is not None:
            result["peak_gpu_memory_gib"] = peak_gib
        (run_dir / "summary.json").write_text(json.dumps(result, indent=2))
        if "final_accuracy" in result:
            logger.info("base accuracy %.1f%% -> final accuracy %.1f%% in %d steps, %.0f s (summary: %s)",
                        100 * result.get("base_accuracy", float("nan")), 100 * result["final_accuracy"],
                        result["num_steps"], result["wall_seconds"], run_dir / "summary.json")
    ctx.destroy()
    return result


def _peak_device_memory_gib(ctx: ExecutorContext) -> float | None:
    """The largest ``torch.cuda.max_memory_allocated`` of any rank, in GiB (a WORLD all-reduce on
    every rank); None off CUDA, where no allocator statistics exist. The device type is the same on
    every rank of a world, so either all ranks take part or none does."""
    if ctx.device.type != "cuda":
        return None
    peak = torch.tensor([torch.cuda.max_memory_allocated(ctx.device) / 2**30], device=ctx.device)
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    return round(peak.item(), 3)


def _throughput(run_dir: Path) -> dict[str, float]:
    """The mean of every ``*_tokens_per_s`` metric any executor reported (``<key>_mean``), over the
    ticks that reported it (executors report throughput only for steps that did work)."""
    values: dict[str, list[float]] = {}
    for path in sorted((run_dir / "metrics").glob("*.jsonl")):
        for record in map(json.loads, path.read_text().splitlines()):
            for key, value in record.items():
                if key.endswith("_tokens_per_s"):
                    values.setdefault(key, []).append(value)
    return {f"{key}_mean": sum(v) / len(v) for key, v in sorted(values.items())}
