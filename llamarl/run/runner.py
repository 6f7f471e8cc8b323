"""run_pipeline: one entry point that runs any pipeline (llamarl/run/stages.py) on this rank.

It makes the world from the pipeline's stages (consecutive rank ranges, groups and meshes in
``llamarl/runtime/world.py``), builds this rank's executor with its stage's ``build``, builds the channels,
and runs the controller. Each of the run's other jobs is one object of its own module:

- ``RunDirectory`` (``llamarl/run/directory.py``): the run directory every rank shares,
  ``config.json``, and where the run resumes (``--checkpoint.resume``: one timeline, an abandoned
  one archived, a finished run not run again);
- ``Evaluations`` (``llamarl/run/evaluations.py``): the evaluator stage's greedy accuracy on the
  held-out problems before training, every ``--run.eval-every`` ticks and after the last tick (with
  the final weights), on every rank of its first data-parallel replica (collective over a TP
  group), and the history a resumed run continues;
- ``RunLog`` (``llamarl/run/run_log.py``): each tick's spans, metrics (JSONL + TensorBoard per executor,
  and W&B with ``--run.wandb-project``), training samples (``--run.log-samples``) and rank 0's
  progress line;
- ``RunCheckpoints`` (``llamarl/run/checkpoints.py``): the controller's one ``RunHooks`` object
  (llamarl/run/controller.py): restoring and saving checkpoints, exports, the tick's metrics and the
  evaluations due, liveness and the device guard (its ``Upkeep``), and the runner's state in each
  checkpoint;
- ``RunSummary`` (``llamarl/run/summary.py``): ``summary.json``, the Chrome trace and the timeline
  picture, written by the evaluator's first rank (global rank 0 when there is no evaluator).

The runner knows nothing about what an executor does. Executors report their metrics in
``executor.metrics`` after each step (an executor hosting several roles may report one section per
role in ``executor.metric_sections``) and declare how each is reduced over their ranks in
``executor.metric_specs`` (``llamarl.runtime.metrics.MetricSpec``: section, sum / mean / max).

``config`` is any dataclass with the ``run``, ``checkpoint`` and ``export`` sections of ``RLConfig``
(``llamarl.run.config.RunSections``; it is also written to ``config.json``).
"""

from __future__ import annotations

import logging
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import NoReturn

from llamarl.channels.in_memory import InMemoryWeights
from llamarl.channels.weights import WeightsChannel
from llamarl.data.prompts import Problem
from llamarl.executors.config import TrainerConfig
from llamarl.models.loading import resolve_source
from llamarl.run.checkpoints import RunCheckpoints
from llamarl.run.config import RunSections
from llamarl.run.controller import ExecutorController
from llamarl.run.directory import RunDirectory, release_lock
from llamarl.run.evaluations import Evaluations
from llamarl.run.run_log import RunLog
from llamarl.run.stages import Pipeline
from llamarl.run.summary import RunSummary
from llamarl.runtime.checkpoint import resume_point
from llamarl.runtime.errors import exception_text
from llamarl.runtime.executor import check_roles
from llamarl.runtime.log import setup_logging
from llamarl.runtime.preflight import checking_only
from llamarl.runtime.progress import Progress
from llamarl.runtime.run_identity import identity_defaults, run_identity
from llamarl.runtime.world import ExecutorContext, world_barrier

logger = logging.getLogger("llamarl.runner")


def stop_before_start(exc: ValueError) -> NoReturn:
    """End this rank before any executor started: ``llamarl: <exc>`` (one line, no traceback) where
    the rank has the message (a ``ResumeRefused`` without one was reported by global rank 0), exit
    code 2. ``os._exit``: peers may already be gone, and nothing of the run needs tearing down."""
    if str(exc) and str(exc) != "None":
        print(f"llamarl: {exception_text(exc)}", file=sys.stderr, flush=True)
    sys.stdout.flush()
    os._exit(2)


def run_pipeline(pipeline: Pipeline, config: RunSections, *, recipe: str, heldout: list[Problem] | None = None,
                 score: Callable[[str, str], float] | None = None,
                 dataset: Callable[[], str] | None = None) -> dict | None:
    """Run ``pipeline`` on this rank (every rank of the torchrun world calls it), evaluating with
    ``score(completion, answer)`` on ``heldout`` if the pipeline has an evaluator stage.
    ``dataset``: the fingerprint of the training data, part of the run's identity in each
    checkpoint (``llamarl/runtime/run_identity.py``), computed on global rank 0 when checkpoints are used.

    Returns the summary dict on the evaluator's first rank (global rank 0 when there is no
    evaluator), None elsewhere. Any failure on any rank ends the job with one line naming the
    executor, rank, step and phase (llamarl/run/controller.py); a run directory or checkpoint that
    cannot be used ends it before any executor starts, with one ``llamarl:`` line and exit code 2.
    """
    wall_start = time.time()
    run = config.run
    lr_note = _settle_trainer(config)
    if checking_only() and config.checkpoint.resume:
        _check_resume_point(config, recipe=recipe, dataset=dataset)
    channels = pipeline.build_channels()
    contexts = ExecutorContext.create_all(pipeline.specs(int(os.environ.get("WORLD_SIZE", "1"))),
                                          timeout_s=run.collective_timeout_s)
    ctx = next(iter(contexts.values()))  # rank-wide facts (rank, device, ranks) are the same in each
    setup_logging(executor="+".join(contexts), rank=ctx.rank)
    if lr_note is not None and ctx.rank == 0:
        logger.info("%s", lr_note)
    reporter_rank = ctx.ranks[pipeline.evaluator][0] if pipeline.evaluator else 0
    directory, identity, resume = _open_run(config, recipe=recipe, dataset=dataset, ctx=ctx)
    if resume.finished is not None:
        release_lock(directory.path)
        ctx.destroy()
        return resume.finished if ctx.rank == reporter_rank else None
    executors = {name: pipeline.stage(name).build(context) for name, context in contexts.items()}
    init_channels = [c for c in channels if isinstance(c, (WeightsChannel, InMemoryWeights))]
    check_roles(executors, weight_channels=init_channels, evaluator=pipeline.evaluator)
    directory.record(config, resume=resume, ctx=ctx)
    evaluations = _evaluations(pipeline, contexts=contexts, executors=executors, heldout=heldout, score=score,
                               run=run, run_dir=directory.path, resume=resume, wall_start=wall_start)
    log = RunLog(contexts=contexts, run_dir=directory.path, start_step=resume.step, weight_channels=init_channels,
                 progress=Progress(keys=pipeline.headline_keys(), max_steps=run.max_steps, start_step=resume.step,
                                   rank=ctx.rank, device=ctx.world_device),
                 run=run, executors=executors, reporter_rank=reporter_rank)
    evaluations.on_evaluation = log.evaluated  # each evaluation's accuracy and rollouts to W&B
    checkpoints = RunCheckpoints(config.checkpoint, config.export, run=run, run_dir=directory.path,
                                 evaluations=evaluations, ctx=ctx, reporter_rank=reporter_rank, resume=resume,
                                 on_tick=log.tick, identity=identity)
    controller = ExecutorController(contexts, executors, channels, max_steps=run.max_steps,
                                    executor_order=pipeline.order, init_channels=init_channels, hooks=checkpoints)
    controller.run()
    try:
        with controller.guard():
            for channel in init_channels:  # the final policy, for the final evaluation
                controller.communicate_now(channel)
            evaluations.final()
    except BaseException as exc:  # noqa: BLE001 - same failure contract as the loop
        controller.abort(exc)
    checkpoints.after_final(start_step=resume.step)
    for executor in executors.values():
        executor.close()
    log.close(extra_spans=evaluations.spans, rank=ctx.rank)
    peak_gib = log.peak_memory_gib()
    world_barrier(ctx)
    controller.finish()
    title = f"{recipe}: {pipeline.title}" if pipeline.title else recipe
    result = _summary(directory.path, title=title, pipeline=pipeline, evaluations=evaluations,
                      peak_gib=peak_gib, ctx=ctx) if ctx.rank == reporter_rank else None
    release_lock(directory.path)
    ctx.destroy()
    return result


def _evaluations(pipeline: Pipeline, *, contexts: dict, executors: dict, heldout: list[Problem] | None,
                 score: Callable[[str, str], float] | None, run, run_dir: Path, resume, wall_start: float) -> Evaluations:
    """The held-out evaluations of the pipeline's evaluator stage (none without one). Evaluation is
    collective over a TP group, so every rank of the evaluator's first replica runs it; its first
    local rank reports."""
    evaluator = contexts.get(pipeline.evaluator)
    evaluates = evaluator is not None and evaluator.dp_rank == 0
    rank = next(iter(contexts.values())).rank
    return Evaluations(evaluator=executors.get(pipeline.evaluator), stage=pipeline.evaluator, heldout=heldout,
                       score=score, run=run, run_dir=run_dir, rank=rank, evaluates=evaluates,
                       reports=evaluates and evaluator.local_rank == 0, resume=resume, wall_start=wall_start)


def _summary(path: Path, *, title: str, pipeline: Pipeline, evaluations: Evaluations, peak_gib, ctx) -> dict:
    """The run's summary (``summary.json`` and the console's last lines), written by the reporting rank."""
    summary = RunSummary(path, title=title, entries=pipeline.summary, world_size=ctx.world_size)
    return summary.write(evaluations.summary, peak_gib=peak_gib)


def _settle_trainer(config: RunSections) -> str | None:
    """The trainer's settings that follow from others (an unset ``--trainer.lr`` takes what it
    trains' default, the lr schedule's horizon ``--run.max-steps``); the note to log, if any."""
    trainer_config = getattr(config, "trainer", None)
    if not isinstance(trainer_config, TrainerConfig):
        return None
    lr_note = trainer_config.settle_lr()
    trainer_config.settle_schedule(max_steps=config.run.max_steps)
    return lr_note


def _check_resume_point(config: RunSections, *, recipe: str, dataset: Callable[[], str] | None) -> None:
    """The launch scripts' one-process check (llamarl/runtime/preflight.py): the checkpoint to resume, its
    identity and its files' sizes, before torchrun starts (a refusal is one line, exit 2; the run
    itself verifies the digests again, falling back where one fails)."""
    run = config.run
    run_dir = Path(run.output_dir) if run.output_dir else Path(config.checkpoint.resume).parent.parent
    identity = run_identity(config, recipe=recipe, dataset=dataset() if dataset is not None else None,
                            model_source=resolve_source(config.model.name))
    resume_point(config.checkpoint.resume, run_dir, max_steps=run.max_steps,
                 verify="off" if config.checkpoint.verify == "off" else "size", identity=identity,
                 allow_changes=config.checkpoint.allowed_changes(), defaults=identity_defaults(config))


def _open_run(config: RunSections, *, recipe: str, dataset: Callable[[], str] | None, ctx):
    """``(directory, identity, resume)``: the run directory, the run's identity (rank 0, where
    checkpoints are used; else None) and where the run resumes; a directory or checkpoint that
    cannot be used stops the job before any executor starts (``stop_before_start``)."""
    identity = None
    try:
        directory = RunDirectory.open(config.run, recipe=recipe, ctx=ctx)
        if ctx.rank == 0 and (config.checkpoint.every or config.checkpoint.resume):
            identity = run_identity(config, recipe=recipe, dataset=dataset() if dataset is not None else None,
                                    model_source=resolve_source(config.model.name))
        resume = directory.resume(config.checkpoint, max_steps=config.run.max_steps, ctx=ctx, identity=identity,
                                  defaults=identity_defaults(config) if identity is not None else None)
    except ValueError as exc:
        stop_before_start(exc)
    return directory, identity, resume
