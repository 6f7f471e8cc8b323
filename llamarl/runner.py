"""run_rl: wires the standard generator -> reward -> trainer -> generator pipeline and runs it.

``--run.schedule colocated`` instead puts generator, scorer and trainer on every rank
(``executors/colocated.py``); everything below about ranks and channels is for the split schedules.

Recipes supply the task (prompts + references), the scorer and the prompt format; everything else
comes from ``RLConfig``. The world is split generator | reward | trainer by
``--generator.num-ranks`` / ``--reward.num-ranks`` (the trainer gets the rest). Channels:

- ``rollouts``: generator -> reward, SCATTER (whole prompt groups, balanced by tokens); same-tick
  under ``sync`` and ``async`` with ``--run.async-lag 1``;
- ``scored``: reward -> trainer, SCATTER (each trainer rank gets whole groups); same-tick under ``sync``;
- ``weights``: trainer -> generator (WeightsChannel), also run once at init so both sides start
  from bit-identical weights, and once after the last tick for the final evaluation.

The generator's first rank (global rank 0) evaluates greedy accuracy on the held-out problems
before and after training and writes ``summary.json`` into the run directory.
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

from llamarl.channels.base import SCATTER, CommunicationChannel
from llamarl.channels.weights import WeightsChannel
from llamarl.checkpoint import resolve_resume
from llamarl.config import RLConfig
from llamarl.controller import ExecutorController
from llamarl.data.prompts import Problem
from llamarl.executors.colocated import ColocatedExecutor
from llamarl.executors.generator import GeneratorExecutor, PromptFn, Task
from llamarl.executors.reward import RewardExecutor
from llamarl.executors.trainer import TrainerExecutor
from llamarl.log import setup_logging
from llamarl.metrics import MetricsLogger, progress_line, write_chrome_trace, write_timeline_png
from llamarl.validate import model_context_length, validate_config
from llamarl.world import ExecutorContext, ExecutorSpec

logger = logging.getLogger("llamarl.runner")

PROGRESS_KEYS = {
    "generator": ["gen_tokens_per_s", "gen_emitted_samples", "gen_carried", "gen_version"],
    "reward": ["reward_mean", "accuracy", "completion_len_mean"],
    "trainer": ["loss", "grad_norm", "staleness_mean", "clip_fraction", "importance_weight_max",
                "train_tokens_per_s"],
}


def _shared_run_dir(config: RLConfig, recipe: str, device: torch.device) -> Path:
    """The same run directory on every rank: rank 0's timestamp is broadcast (a tensor, no pickle)."""
    if config.run.output_dir:
        return Path(config.run.output_dir)
    stamp = torch.tensor([int(time.time())], dtype=torch.int64, device=device)
    dist.broadcast(stamp, src=0)
    return Path("runs") / f"{recipe}-{time.strftime('%Y%m%d-%H%M%S', time.localtime(int(stamp.item())))}"


def _build(config: RLConfig, *, task: Task, scorer: str, prompt_fn: PromptFn):
    """The world, this rank's executor and the channels for ``config.run.schedule``.

    Split schedules (``async`` / ``sync``): generator | reward | trainer ranks with the ``rollouts``,
    ``scored`` and ``weights`` channels. ``colocated``: one executor on every rank, no channels
    (the weights are updated in place inside the executor).
    Returns ``(ctx, executor, channels, init_channels, executor_order)``.
    """
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    context = model_context_length(config.model.name)
    max_tokens = min(config.trainer.max_tokens_per_microbatch, context or config.trainer.max_tokens_per_microbatch)
    if config.run.schedule == "colocated":
        if config.generator.tp != 1:
            raise ValueError(f"--run.schedule colocated needs --generator.tp 1, got {config.generator.tp}")
        ctx = ExecutorContext.create([ExecutorSpec("colocated", world_size)],
                                     timeout_s=config.run.collective_timeout_s)
        generator = GeneratorExecutor(ctx, model_config=config.model, config=config.generator, task=task,
                                      prompt_fn=prompt_fn, seed=config.run.seed, max_sequence_tokens=max_tokens)
        trainer = TrainerExecutor(ctx, model_config=config.model, config=config.trainer, algo=config.algo,
                                  temperature=config.generator.temperature, seed=config.run.seed)
        executor = ColocatedExecutor(ctx, generator=generator, trainer=trainer, reward=config.reward, scorer=scorer)
        return ctx, executor, [], [], ["colocated"]
    num_trainer = world_size - config.generator.num_ranks - config.reward.num_ranks
    specs = [ExecutorSpec("generator", config.generator.num_ranks, tp=config.generator.tp),
             ExecutorSpec("reward", config.reward.num_ranks),
             ExecutorSpec("trainer", num_trainer)]
    weights = WeightsChannel("weights", "trainer", "generator", mode=config.weights.mode)
    sync = config.run.schedule == "sync"
    channels = [CommunicationChannel("rollouts", "generator", "reward", SCATTER,
                                     same_tick=sync or config.run.async_lag == 1),
                CommunicationChannel("scored", "reward", "trainer", SCATTER, same_tick=sync), weights]
    ctx = ExecutorContext.create(specs, timeout_s=config.run.collective_timeout_s,
                                 channel_endpoints=[(c.outbound, c.inbound) for c in channels])
    if ctx.executor == "generator":
        executor = GeneratorExecutor(ctx, model_config=config.model, config=config.generator, task=task,
                                     prompt_fn=prompt_fn, seed=config.run.seed, max_sequence_tokens=max_tokens)
    elif ctx.executor == "reward":
        executor = RewardExecutor(ctx, config=config.reward, scorer=scorer)
    else:
        executor = TrainerExecutor(ctx, model_config=config.model, config=config.trainer, algo=config.algo,
                                   temperature=config.generator.temperature, seed=config.run.seed)
    return ctx, executor, channels, [weights], ["generator", "reward", "trainer"]


def run_rl(config: RLConfig, *, recipe: str, task: Task, heldout: list[Problem],
           score: Callable[[str, str], float], scorer: str, prompt_fn: PromptFn) -> dict | None:
    """Run the RL loop on this rank; returns the summary dict on global rank 0, else None."""
    wall_start = time.time()
    # Every rank, before any process group: bad input costs one line, not a half-started world.
    validate_config(config, world_size=int(os.environ.get("WORLD_SIZE", "1")))
    ctx, executor, channels, init_channels, executor_order = _build(config, task=task, scorer=scorer,
                                                                    prompt_fn=prompt_fn)
    setup_logging(executor=ctx.executor, rank=ctx.rank)
    run_dir = _shared_run_dir(config, recipe, ctx.device)
    run_dir.mkdir(parents=True, exist_ok=True)
    if ctx.rank == 0:
        (run_dir / "config.json").write_text(json.dumps(asdict(config), indent=2))
        logger.info("run directory %s", run_dir)

    resume_dir, start_step = resolve_resume(config.checkpoint.resume, run_dir / "checkpoints") \
        if config.checkpoint.resume else (None, 0)
    if resume_dir is not None and ctx.rank == 0:
        logger.info("resuming from %s (tick %d)", resume_dir, start_step)
    leader = ctx.local_rank == 0
    loggers: dict[str, MetricsLogger] = {}
    spans: list[dict] = []
    summary: dict = {}

    evals: list[dict] = []

    def record_eval(step: int, accuracy: float) -> None:
        version = getattr(executor, "version", None)
        evals.append({"step": step, "seconds": time.time() - wall_start, "accuracy": accuracy, "version": version})
        if ctx.local_rank == 0:
            logger.info("eval after %d ticks: greedy accuracy %.1f%% (weights version %s, %.0f s into the run)",
                        step, 100 * accuracy, version, evals[-1]["seconds"])

    def on_tick(step, ex, record):
        spans.extend({"executor": ctx.executor, "rank": ctx.rank, "step": step, "start": a, "end": b, "kind": "step"}
                     for a, b in record.step_spans)
        spans.extend({"executor": ctx.executor, "rank": ctx.rank, "step": step, "start": a, "end": b, "kind": name}
                     for name, a, b in record.channel_spans)
        every = config.run.eval_every
        if evaluates and every and (step + 1) % every == 0 and step + 1 < config.run.max_steps:
            with controller.guard():  # collective over a TP group: every rank of the replica runs it
                record_eval(step + 1, executor.evaluate(heldout, score,
                                                        samples_path=run_dir / f"eval_step_{step + 1}.jsonl"))
        if not leader:
            return
        # An executor that hosts several roles (colocated) reports one metric section per role.
        sections = getattr(ex, "metric_sections", None) or {ctx.executor: ex.metrics}
        for section, values in sections.items():
            if not values:
                continue
            metrics = {**values, "channel_seconds": record.channel_seconds, "step_seconds": record.step_seconds}
            if section == "generator" and init_channels:
                metrics["weight_sync_seconds"] = init_channels[0].last_seconds
                metrics["weight_sync_skipped"] = float(init_channels[0].last_skipped)
            if section not in loggers:
                loggers[section] = MetricsLogger(run_dir, section, start_step=start_step)
            loggers[section].log(step, metrics)
            progress_line(step, config.run.max_steps, section, metrics, PROGRESS_KEYS.get(section, []))

    # Evaluation is collective over a TP group, so every rank of the first replica runs it.
    evaluates = hasattr(executor, "evaluate") and ctx.dp_rank == 0

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
    controller = ExecutorController(ctx, executor, channels, max_steps=config.run.max_steps,
                                    executor_order=executor_order, init_channels=init_channels,
                                    checkpoint_every=config.checkpoint.every, checkpoint_keep=config.checkpoint.keep,
                                    checkpoint_dir=run_dir / "checkpoints", on_tick=on_tick,
                                    resume_dir=resume_dir, start_step=start_step,
                                    export_every=config.export.every, export_dir=export_dir,
                                    before_loop=base_evaluation if evaluates else None,
                                    device_guard=config.run.device_guard,
                                    liveness_timeout_s=config.run.liveness_timeout_s)
    controller.run()
    try:
        with controller.guard():
            for channel in init_channels:  # the final policy, for the final evaluation
                channel.communicate(ctx, executor)
            if evaluates:
                summary["final_accuracy"] = executor.evaluate(heldout, score,
                                                              samples_path=run_dir / "eval_final.jsonl")
                record_eval(config.run.max_steps, summary["final_accuracy"])
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
    dist.barrier()
    controller.finish()
    result = None
    if ctx.rank == 0:
        all_spans = [s for f in sorted((run_dir / "timeline").glob("rank*.json")) for s in json.loads(f.read_text())]
        write_chrome_trace(run_dir, all_spans)
        lag = f" (lag {config.run.async_lag})" if config.run.schedule == "async" else ""
        write_timeline_png(run_dir, all_spans, title=f"{recipe}: {config.run.schedule}{lag}")
        result = {**summary, "num_steps": config.run.max_steps, "wall_seconds": time.time() - wall_start,
                  "schedule": config.run.schedule, "loss": config.algo.loss,
                  **_throughput(run_dir)}
        (run_dir / "summary.json").write_text(json.dumps(result, indent=2))
        logger.info("base accuracy %.1f%% -> final accuracy %.1f%% in %d steps, %.0f s (summary: %s)",
                    100 * result["base_accuracy"], 100 * result["final_accuracy"], result["num_steps"],
                    result["wall_seconds"], run_dir / "summary.json")
    ctx.destroy()
    return result


def _throughput(run_dir: Path) -> dict[str, float]:
    """Mean generation / training tokens per second from the executors' JSONL metrics."""
    out = {}
    for executor, key in (("generator", "gen_tokens_per_s"), ("trainer", "train_tokens_per_s")):
        path = run_dir / "metrics" / f"{executor}.jsonl"
        if path.exists():
            values = [r[key] for r in map(json.loads, path.read_text().splitlines()) if key in r]
            if values:
                out[f"{key}_mean"] = sum(values) / len(values)
    return out
