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
sync's ``weight_sync_seconds`` / ``weight_sync_skipped`` / ``weight_sync_bytes``. The pipeline's ``evaluator`` stage
evaluates greedy accuracy on the held-out problems before training, every ``--run.eval-every``
ticks and after the last tick (with the final weights), on every rank of its first data-parallel
replica (collective over a TP group); its first rank writes ``summary.json``.

Resuming (``--checkpoint.resume``) at step n continues one run, not a second one beside it:

- what the run directory holds of the ticks after n (newer checkpoints of an abandoned run,
  their exports, evaluation samples, metric records, its summary) is first moved into
  ``<run>/abandoned-<time>/`` by global rank 0 (the rank that commits checkpoints), between two
  WORLD barriers, so no rank reads the directory while it changes; one line names what moved
  (``llamarl.checkpoint.archive_after``). Archived rather than refused: a resume from an older
  checkpoint is deliberate, and nothing of the abandoned run is lost;
- every checkpoint holds the runner's state (``runner_state.json``: the evaluations made so far,
  the elapsed wall seconds, the steps resumed from), written by the reporting rank into the
  checkpoint before its commit and updated after the evaluation due at that step (which runs after
  the commit), so ``summary.json`` of a resumed run lists every evaluation of the whole run,
  ``wall_seconds`` counts every segment (each up to its last recorded state) and
  ``resumed_from_step`` lists the steps resumed from (``[]`` for a run never resumed); evaluation
  ``seconds`` continue across segments. An evaluation due at step n that the interrupted run did
  not record (it died during it) is made by the resumed run before its first tick;
- resuming a finished run from its newest checkpoint (``--checkpoint.resume latest`` after the run
  ended) with the same ``--run.max-steps`` N, which its ``summary.json`` reports, ends at once with
  ``run already finished at step N (<run>/summary.json); nothing to do`` and returns that summary:
  the final evaluation and export are not made again and the summary is not rewritten. A higher
  ``--run.max-steps`` trains on from there.

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

from llamarl.channels.in_memory import InMemoryWeights
from llamarl.channels.weights import WeightsChannel
from llamarl.checkpoint import (
    COMPLETE_MARKER,
    RUNNER_STATE,
    archive_after,
    complete_steps,
    read_runner_state,
    resolve_resume,
    step_dir,
    write_json,
)
from llamarl.controller import ExecutorController, Upkeep
from llamarl.data.prompts import Problem
from llamarl.eval_history import Evaluations
from llamarl.executor import check_roles
from llamarl.log import setup_logging
from llamarl.metrics import write_chrome_trace, write_timeline_png
from llamarl.pipeline import Pipeline
from llamarl.progress import Progress
from llamarl.rewards.trajectory import TrajectoryScore, resolve_trajectory_scorer
from llamarl.run_log import RunLog
from llamarl.shared_dir import check_shared_run_dir
from llamarl.world import ExecutorContext, world_barrier

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
    channels = pipeline.build_channels()
    contexts = ExecutorContext.create_all(pipeline.specs(world_size), timeout_s=run.collective_timeout_s)
    ctx = next(iter(contexts.values()))  # rank-wide facts (rank, device, ranks) are the same in each
    setup_logging(executor="+".join(contexts), rank=ctx.rank)
    run_dir = _shared_run_dir(run.output_dir, recipe, ctx.world_device)
    run_dir.mkdir(parents=True, exist_ok=True)
    check_shared_run_dir(run_dir, device=ctx.world_device)  # every node must see the same directory
    checkpoint_dir = run_dir / "checkpoints"
    reporter_rank = ctx.ranks[pipeline.evaluator][0] if pipeline.evaluator else 0
    reporter = ctx.rank == reporter_rank
    resume_dir, start_step, finished = _resume_point(config, run_dir, ctx=ctx)
    if finished is not None:
        ctx.destroy()
        return finished if reporter else None
    executors = {name: pipeline.stage(name).build(context) for name, context in contexts.items()}
    init_channels = [c for c in channels if isinstance(c, (WeightsChannel, InMemoryWeights))]
    check_roles(executors, weight_channels=init_channels, evaluator=pipeline.evaluator)
    run_dir.mkdir(parents=True, exist_ok=True)
    if ctx.rank == 0:
        (run_dir / "config.json").write_text(json.dumps(asdict(config), indent=2))
        logger.info("run directory %s; stages %s", run_dir,
                    ", ".join(f"{name} ranks {ranks}" for name, ranks in ctx.ranks.items()))

    restored = read_runner_state(resume_dir) if resume_dir is not None else None
    if resume_dir is not None and ctx.rank == 0:
        logger.info("resuming from %s (tick %d)", resume_dir, start_step)
        if restored is None:
            logger.warning("%s has no %s (saved by an older llamarl): summary.json describes the evaluations "
                           "and wall time from step %d on", resume_dir, RUNNER_STATE, start_step)
    # Evaluation is collective over a TP group, so every rank of the evaluator's first replica runs it.
    evaluates = pipeline.evaluator in contexts and contexts[pipeline.evaluator].dp_rank == 0
    trajectory_scorer = getattr(getattr(config, "reward", None), "trajectory_scorer", None)
    if trajectory_scorer is not None:  # it replaces the recipe's text scorer here too
        score = TrajectoryScore(resolve_trajectory_scorer(trajectory_scorer))
    evaluations = Evaluations(evaluator=executors.get(pipeline.evaluator), stage=pipeline.evaluator, heldout=heldout,
                              score=score, run_dir=run_dir, rank=ctx.rank,
                              reports=evaluates and contexts[pipeline.evaluator].local_rank == 0,
                              eval_every=run.eval_every, max_steps=run.max_steps, restored=restored or {},
                              resumed_at=start_step if resume_dir is not None else None, wall_start=wall_start)
    log = RunLog(contexts=contexts, run_dir=run_dir, start_step=start_step, weight_channels=init_channels,
                 progress=Progress(keys=pipeline.headline_keys(), max_steps=run.max_steps, start_step=start_step,
                                   rank=ctx.rank, device=ctx.world_device))
    summary: dict = {}

    def on_checkpoint(partial: Path) -> None:
        # The runner's state goes into the checkpoint before the controller's WORLD barrier: a
        # committed checkpoint always holds it.
        if reporter:
            write_json(partial / RUNNER_STATE, evaluations.state())

    def on_tick(step, ticked):
        log.reduce(step, ticked)
        log.write(step, ticked)

    def after_tick(step):
        checkpointed = config.checkpoint.every and (step + 1) % config.checkpoint.every == 0
        if evaluations.due(step + 1):
            if checkpointed and reporter_rank != 0:
                # Rank 0 has committed step_<step + 1>, whose runner state the reporter updates below.
                world_barrier(ctx)
            if evaluates:
                with controller.guard():  # collective over a TP group: every rank of the replica runs it
                    evaluations.evaluate(step + 1, f"eval_step_{step + 1}.jsonl")
            if checkpointed and reporter:
                # The evaluation after the checkpoint's tick belongs to its history: a run resumed
                # from it must list it (its weights are the generator's of then, not the resumed run's).
                write_json(step_dir(checkpoint_dir, step + 1) / RUNNER_STATE, evaluations.state())

    export_dir = run_dir / "hf" if config.export.final or config.export.every else None
    upkeep = Upkeep(checkpoint_every=config.checkpoint.every, checkpoint_keep=config.checkpoint.keep,
                    checkpoint_dir=checkpoint_dir, export_every=config.export.every, export_dir=export_dir,
                    device_guard=run.device_guard, liveness_timeout_s=run.liveness_timeout_s)
    controller = ExecutorController(contexts, executors, channels, max_steps=run.max_steps,
                                    executor_order=pipeline.order, init_channels=init_channels,
                                    resume_dir=resume_dir, start_step=start_step, upkeep=upkeep, on_tick=on_tick,
                                    on_checkpoint=on_checkpoint, after_tick=after_tick,
                                    before_loop=(lambda: evaluations.base(summary, resume_dir=resume_dir,
                                                                          start_step=start_step))
                                    if evaluates else None)
    controller.run()
    try:
        with controller.guard():
            for channel in init_channels:  # the final policy, for the final evaluation
                controller.communicate_now(channel)
            if evaluates:
                summary["final_accuracy"] = evaluations.evaluate(run.max_steps, "eval_final.jsonl")
                summary["evals"] = evaluations.records
    except BaseException as exc:  # noqa: BLE001 - same failure contract as the loop
        controller.abort(exc)
    for executor in executors.values():
        executor.close()
    log.close(extra_spans=evaluations.spans, rank=ctx.rank)
    peak_gib = _peak_device_memory_gib(ctx)
    world_barrier(ctx)
    controller.finish()
    result = None
    if reporter:
        # This world's ranks only: an earlier segment of a resumed run may have had more.
        all_spans = [s for r in range(ctx.world_size)
                     for s in json.loads((run_dir / "timeline" / f"rank{r}.json").read_text())]
        write_chrome_trace(run_dir, all_spans)
        write_timeline_png(run_dir, all_spans, title=f"{recipe}: {pipeline.title}" if pipeline.title else recipe)
        last = step_dir(checkpoint_dir, run.max_steps)
        if run.max_steps > start_step and (last / COMPLETE_MARKER).is_file():
            # This run's checkpoint of its last step: with the final evaluation, its state is the
            # whole run's, for a later resume that trains further (--run.max-steps raised).
            write_json(last / RUNNER_STATE, evaluations.state())
        result = {**summary, "num_steps": run.max_steps, "wall_seconds": evaluations.elapsed(),
                  "resumed_from_step": evaluations.resumed_from, **pipeline.summary, **_throughput(run_dir)}
        if peak_gib is not None:
            result["peak_gpu_memory_gib"] = peak_gib
        (run_dir / "summary.json").write_text(json.dumps(result, indent=2))
        if "final_accuracy" in result:
            logger.info("base accuracy %.1f%% -> final accuracy %.1f%% in %d steps, %.0f s (summary: %s)",
                        100 * result.get("base_accuracy", float("nan")), 100 * result["final_accuracy"],
                        result["num_steps"], result["wall_seconds"], run_dir / "summary.json")
    ctx.destroy()
    return result


def _resume_point(config, run_dir: Path, *, ctx: ExecutorContext) -> tuple[Path | None, int, dict | None]:
    """``(checkpoint to resume from or None, its step, the summary of a run that already finished)``.

    Collective (WORLD barriers) when resuming: every rank resolves the checkpoint before global
    rank 0 moves what an abandoned later timeline left into ``<run>/abandoned-<time>/``, and no rank
    reads the run directory before it is one timeline again. A finished run (``_finished_summary``)
    moves nothing."""
    if not config.checkpoint.resume:
        return None, 0, None
    max_steps = config.run.max_steps
    resume_dir, start_step = resolve_resume(config.checkpoint.resume, run_dir / "checkpoints")
    finished = _finished_summary(run_dir, resume_dir, start_step, max_steps)
    if finished is not None:
        if ctx.rank == 0:
            logger.info("run already finished at step %d (%s); nothing to do", max_steps, run_dir / "summary.json")
        return resume_dir, start_step, finished
    world_barrier(ctx)
    if ctx.rank == 0:
        archived = archive_after(run_dir, start_step)
        if archived is not None:
            logger.info("resuming at step %d: moved what an abandoned run left after it (%s) to %s",
                        start_step, ", ".join(archived[1]), archived[0])
    world_barrier(ctx)
    return resume_dir, start_step, None


def _finished_summary(run_dir: Path, resume_dir: Path, step: int, max_steps: int) -> dict | None:
    """The summary of a run that already finished, when resuming it would only redo its end; else None.

    Finished: ``resume_dir`` is this run directory's newest complete checkpoint (so nothing would
    be abandoned) and ``summary.json`` there reports ``max_steps`` steps. The summary is written
    after the final evaluation and export, and a resume moves it aside first, so one that is there
    belongs to this directory's timeline, which ended. A higher ``--run.max-steps`` or an older
    checkpoint is not finished: the run trains on."""
    path = run_dir / "summary.json"
    checkpoints = run_dir / "checkpoints"
    own = resume_dir.resolve().parent == checkpoints.resolve()
    if not own or not path.is_file() or complete_steps(checkpoints)[-1:] != [step]:
        return None
    try:
        summary = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None
    return summary if summary.get("num_steps") == max_steps else None


def _peak_device_memory_gib(ctx: ExecutorContext) -> float | None:
    """The largest ``torch.cuda.max_memory_allocated`` of any rank, in GiB (a WORLD all-reduce on
    every rank; a CPU rank of a mixed world adds 0); None in a world without GPUs, where no
    allocator statistics exist (then no rank takes part)."""
    if ctx.device.type != "cuda" and "cuda" not in ctx.device_kinds.values():
        return None
    used = torch.cuda.max_memory_allocated(ctx.device) / 2**30 if ctx.device.type == "cuda" else 0.0
    peak = torch.tensor([used], device=ctx.world_device)
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
