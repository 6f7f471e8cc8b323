"""run_rl: wires the standard generator -> reward -> trainer -> generator pipeline and runs it.

Recipes supply the task (prompts + references), the scorer and the prompt format; everything else
comes from ``RLConfig``. The world is split generator | reward | trainer by
``--generator.num-ranks`` / ``--reward.num-ranks`` (the trainer gets the rest). Channels:

- ``rollouts``: generator -> reward, SCATTER (whole prompt groups, balanced by tokens);
- ``scored``: reward -> trainer, SCATTER (each trainer rank gets whole groups);
- ``weights``: trainer -> generator (WeightsChannel), also run once at init so both sides start
  from bit-identical weights, and once after the last tick for the final evaluation.

The generator's first rank (global rank 0) evaluates greedy accuracy on the held-out problems
before and after training and writes ``summary.json`` into the run directory.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

import torch
import torch.distributed as dist

from llamarl.channels.base import SCATTER, CommunicationChannel
from llamarl.channels.weights import WeightsChannel
from llamarl.config import RLConfig, resume_step
from llamarl.controller import ExecutorController
from llamarl.data.prompts import Problem
from llamarl.executors.generator import GeneratorExecutor, PromptFn, Task
from llamarl.executors.reward import RewardExecutor
from llamarl.executors.trainer import TrainerExecutor
from llamarl.metrics import MetricsLogger, progress_line, write_chrome_trace
from llamarl.world import ExecutorContext, ExecutorSpec

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


def run_rl(config: RLConfig, *, recipe: str, task: Task, heldout: list[Problem],
           score: Callable[[str, str], float], scorer: str, prompt_fn: PromptFn) -> dict | None:
    """Run the RL loop on this rank; returns the summary dict on global rank 0, else None."""
    wall_start = time.time()
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    num_trainer = world_size - config.generator.num_ranks - config.reward.num_ranks
    specs = [ExecutorSpec("generator", config.generator.num_ranks, tp=config.generator.tp),
             ExecutorSpec("reward", config.reward.num_ranks),
             ExecutorSpec("trainer", num_trainer)]
    weights = WeightsChannel("weights", "trainer", "generator", mode=config.weights.mode)
    channels = [CommunicationChannel("rollouts", "generator", "reward", SCATTER),
                CommunicationChannel("scored", "reward", "trainer", SCATTER), weights]
    ctx = ExecutorContext.create(specs, timeout_s=config.run.collective_timeout_s,
                                 channel_endpoints=[(c.outbound, c.inbound) for c in channels])
    run_dir = _shared_run_dir(config, recipe, ctx.device)
    run_dir.mkdir(parents=True, exist_ok=True)
    if ctx.rank == 0:
        (run_dir / "config.json").write_text(json.dumps(asdict(config), indent=2))
        print(f"llamarl: run directory {run_dir}", flush=True)

    if ctx.executor == "generator":
        executor = GeneratorExecutor(ctx, model_config=config.model, config=config.generator, task=task,
                                     prompt_fn=prompt_fn, seed=config.run.seed)
    elif ctx.executor == "reward":
        executor = RewardExecutor(ctx, config=config.reward, scorer=scorer)
    else:
        executor = TrainerExecutor(ctx, model_config=config.model, config=config.trainer, algo=config.algo,
                                   temperature=config.generator.temperature, seed=config.run.seed)
    leader = ctx.local_rank == 0
    logger = MetricsLogger(run_dir, ctx.executor) if leader else None
    spans: list[dict] = []
    summary: dict = {}

    def on_tick(step, ex, record):
        spans.extend({"executor": ctx.executor, "rank": ctx.rank, "step": step, "start": a, "end": b}
                     for a, b in record.step_spans)
        if logger is not None and ex.metrics:
            metrics = {**ex.metrics, "channel_seconds": record.channel_seconds, "step_seconds": record.step_seconds}
            if ctx.executor == "generator":
                metrics["weight_sync_seconds"] = weights.last_seconds
            logger.log(step, metrics)
            progress_line(step, config.run.max_steps, ctx.executor, metrics, PROGRESS_KEYS[ctx.executor])

    controller = ExecutorController(ctx, executor, channels, max_steps=config.run.max_steps,
                                    executor_order=["generator", "reward", "trainer"], init_channels=[weights],
                                    schedule=config.run.schedule, checkpoint_every=config.run.checkpoint_every,
                                    checkpoint_dir=run_dir / "checkpoints", on_tick=on_tick,
                                    resume_dir=Path(config.run.resume_from) if config.run.resume_from else None,
                                    start_step=resume_step(config.run.resume_from) if config.run.resume_from else 0)
    # Evaluation is collective over a TP group, so every rank of the first generator replica runs it.
    evaluates = ctx.executor == "generator" and ctx.dp_rank == 0
    if evaluates:
        controller.before_loop = lambda: summary.update(
            base_accuracy=executor.evaluate(heldout, score, samples_path=run_dir / "eval_base.jsonl"))
    controller.run()
    try:
        weights.communicate(ctx, executor)  # the final policy, for the final evaluation
        if evaluates:
            summary["final_accuracy"] = executor.evaluate(heldout, score, samples_path=run_dir / "eval_final.jsonl")
    except BaseException as exc:  # noqa: BLE001 - same failure contract as the loop
        controller._abort(exc)
    if isinstance(executor, (RewardExecutor, GeneratorExecutor)):
        executor.close()
    (run_dir / "timeline").mkdir(exist_ok=True)
    (run_dir / "timeline" / f"rank{ctx.rank}.json").write_text(json.dumps(spans))
    if logger is not None:
        logger.close()
    dist.barrier()
    result = None
    if ctx.rank == 0:
        all_spans = [s for f in sorted((run_dir / "timeline").glob("rank*.json")) for s in json.loads(f.read_text())]
        write_chrome_trace(run_dir, all_spans)
        result = {**summary, "num_steps": config.run.max_steps, "wall_seconds": time.time() - wall_start,
                  "schedule": config.run.schedule, "loss": config.algo.loss,
                  **_throughput(run_dir)}
        (run_dir / "summary.json").write_text(json.dumps(result, indent=2))
        print(f"llamarl: base accuracy {result['base_accuracy']:.1%} -> final accuracy "
              f"{result['final_accuracy']:.1%} in {result['num_steps']} steps, {result['wall_seconds']:.0f} s "
              f"(summary: {run_dir / 'summary.json'})", flush=True)
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
