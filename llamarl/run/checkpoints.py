"""A run's checkpoints and exports, and the runner's own state in each checkpoint (part of
``llamarl/run/runner.py``).

``RunCheckpoints`` is the run's ``RunHooks``, the one object the controller calls for everything
besides stepping (``llamarl/run/controller.py`` says when): it restores a resumed run, writes the
checkpoints (``--checkpoint.every``, ``--checkpoint.keep``; ``llamarl/runtime/checkpoint.py`` for the
files) and makes the controller's ``Upkeep`` (the exports, ``--export.every``, ``--export.final``,
under ``<run>/hf/``, the device guard, liveness). Beside the executors' state, every checkpoint
holds the runner's (``runner_state.json``: the evaluations made so far, the
elapsed wall seconds, the steps resumed from, ``Evaluations.state``):

- written by the reporting rank into the checkpoint before the controller's WORLD barrier, so a
  committed checkpoint always holds it;
- updated after the evaluation due at the checkpoint's step, which runs after the commit: a run
  resumed from it lists that evaluation (made with the weights of then, not the resumed run's);
- updated once more after the final evaluation in the run's checkpoint of the last step, if it took
  one: it is then the whole run's state, for a later resume that trains further (``--run.max-steps``
  raised).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from pathlib import Path

from llamarl.run.config import CheckpointConfig, ExportConfig, RunConfig
from llamarl.run.controller import At, TickRecord, Upkeep
from llamarl.run.evaluations import Evaluations
from llamarl.runtime.checkpoint import (
    COMPLETE_MARKER,
    RUNNER_STATE,
    ResumePoint,
    commit_step,
    complete_steps,
    partial_dir,
    prune,
    read_json,
    step_dir,
    write_json,
)
from llamarl.runtime.checkpoint_files import (
    disk_full_error,
    fault_point,
    is_disk_full,
    recording,
    replace_committed_file,
)
from llamarl.runtime.executor import Executor
from llamarl.runtime.world import ExecutorContext, world_barrier


class RunCheckpoints:
    """A run's ``RunHooks`` (``llamarl/run/controller.py``, which says when the controller calls each):
    its checkpoints (resume, save, the runner's state in each: module docstring) and the controller's
    ``Upkeep``, composed with the run's logging (``on_tick``) and evaluations (``before_loop``,
    ``after_tick``)."""

    def __init__(self, checkpoint: CheckpointConfig, export: ExportConfig, *, run: RunConfig, run_dir: Path,
                 evaluations: Evaluations, ctx: ExecutorContext, reporter_rank: int, resume: ResumePoint,
                 on_tick: Callable[[int, dict[str, tuple[Executor, TickRecord]]], None],
                 identity: dict | None = None) -> None:
        """``reporter_rank``: the global rank that writes the runner's state and ``summary.json``
        (the evaluator's first rank, else 0). ``resume``: where this segment starts. ``on_tick``:
        each tick's metrics and progress (``RunLog.tick``). ``identity``: the run's
        (``llamarl/runtime/run_identity.py``), recorded in each checkpoint's marker by global rank 0 (None
        elsewhere). A failing rank's traceback goes to ``<run>/logs/``.

        The settings are not checked again here: ``CheckpointConfig`` / ``ExportConfig`` /
        ``RunConfig`` checked them when they were made, and the checkpoint directory is always set."""
        self.checkpoint_dir = run_dir / "checkpoints"
        self.every, self.keep, self.max_steps = checkpoint.every, checkpoint.keep, run.max_steps
        self.evaluations, self.ctx = evaluations, ctx
        self.reporter_rank, self.reporter = reporter_rank, ctx.rank == reporter_rank
        self.resume, self.start_step, self.tick = resume, resume.step, on_tick
        self.info = {"identity": identity} if identity is not None else {}
        self.upkeep = Upkeep(export_every=export.every,
                             export_dir=run_dir / "hf" if export.final or export.every else None,
                             export_final=export.final,
                             device_guard=run.device_guard, liveness_timeout_s=run.liveness_timeout_s,
                             traceback_dir=run_dir / "logs")

    def checkpoints_at(self, step: int) -> bool:
        """Whether the run checkpoints the state after ``step`` ticks (``--checkpoint.every``)."""
        return bool(self.every) and step % self.every == 0

    # ----- the controller's hooks, in the order it calls them -----
    def restore(self, executors: Mapping[str, Executor], at: At) -> None:
        """A resumed run: every executor loads its state from the checkpoint resumed."""
        if self.resume.directory is None:
            return
        for name, executor in executors.items():
            at("load_checkpoint", name)
            executor.load_checkpoint(Path(self.resume.directory) / name)

    def before_loop(self) -> None:
        """The base evaluation, on the ranks that evaluate (``Evaluations.base``)."""
        if self.evaluations.evaluates:
            self.evaluations.base()

    def on_tick(self, step: int, ticked: dict[str, tuple[Executor, TickRecord]]) -> None:
        """Tick ``step``'s metrics and progress (collective over WORLD), before its checkpoint."""
        self.tick(step, ticked)

    def save(self, step: int, executors: Mapping[str, Executor], at: At) -> None:
        """The checkpoint of the state after ``step`` ticks, when one is due: atomic across executors.

        Every executor writes into ``step_{n}.partial/{executor name}``, then the runner's state
        (``save_state``); after a WORLD barrier global rank 0 renames it to ``step_{n}`` and writes
        its completion marker, then deletes complete checkpoints beyond the newest ``keep`` (0
        keeps all) and leftovers of interrupted saves. Each rank records the digests of the files
        it writes (``llamarl/runtime/checkpoint_files.py``); a full disk is one line naming the directory,
        the step and the bytes needed."""
        if not self.checkpoints_at(step):
            return
        root = self.checkpoint_dir
        with recording(partial_dir(root, step), rank=self.ctx.rank):
            for name, executor in executors.items():
                at("checkpoint", name)
                directory = partial_dir(root, step) / name
                directory.mkdir(parents=True, exist_ok=True)
                try:
                    executor.save_checkpoint(directory)
                    fault_point("write", step)
                except Exception as exc:
                    if not is_disk_full(exc):
                        raise
                    raise self._disk_full(step, directory, prefix=name + "/") from None
            at("checkpoint")
            try:
                self.save_state(partial_dir(root, step))
            except Exception as exc:
                if not is_disk_full(exc):
                    raise
                raise self._disk_full(step, partial_dir(root, step), prefix="") from None
            fault_point("state", step)
        at("checkpoint barrier")
        world_barrier(self.ctx)  # every executor's files are on disk (WORLD: all ranks checkpoint together)
        if self.ctx.rank == 0:
            at("checkpoint commit")
            commit_step(root, step, {"executors": sorted(self.ctx.ranks), "world_size": self.ctx.world_size,
                                     "time": time.time(), **self.info})
            at("checkpoint prune")
            prune(root, keep=self.keep, current=step)

    def save_state(self, partial: Path) -> None:
        """The runner's state into the checkpoint being written (its ``partial`` directory), before
        the WORLD barrier that commits it."""
        if self.reporter:
            write_json(partial / RUNNER_STATE, self.evaluations.state())

    def _disk_full(self, step: int, directory: Path, *, prefix: str) -> OSError:
        steps = [s for s in complete_steps(self.checkpoint_dir) if s < step]
        previous = None
        if steps:
            try:
                previous = read_json(step_dir(self.checkpoint_dir, steps[-1]) / COMPLETE_MARKER)
            except ValueError:
                previous = None
        return disk_full_error(directory=directory, step=step, previous=previous, prefix=prefix)

    def after_tick(self, step: int) -> None:
        """After tick ``step``'s checkpoint and export: the evaluation due after ``step + 1`` ticks,
        and the runner's state of the checkpoint of that step updated with it."""
        done = step + 1
        if not self.evaluations.due(done):
            return
        checkpointed = self.checkpoints_at(done)
        if checkpointed and self.reporter_rank != 0:
            # Rank 0 has committed step_<done>, whose runner state the reporter updates below.
            world_barrier(self.ctx)
        self.evaluations.between_ticks(done)
        if checkpointed and self.reporter:
            # The marker lists the file's digest: rewritten with it (llamarl/runtime/checkpoint_files.py).
            replace_committed_file(step_dir(self.checkpoint_dir, done), RUNNER_STATE, self.evaluations.state(),
                                   marker_name=COMPLETE_MARKER)

    def after_final(self, *, start_step: int) -> None:
        """After the final evaluation, on every rank: the whole run's state into this segment's
        checkpoint of the last step, if it took one (``start_step``: where the segment began), as
        ``after_tick`` does for the evaluations between ticks."""
        if not (self.checkpoints_at(self.max_steps) and self.max_steps > start_step):
            return
        if self.reporter_rank != 0:
            world_barrier(self.ctx)  # rank 0 has committed step_<max_steps>
        last = step_dir(self.checkpoint_dir, self.max_steps)
        if self.reporter and (last / COMPLETE_MARKER).is_file():
            replace_committed_file(last, RUNNER_STATE, self.evaluations.state(), marker_name=COMPLETE_MARKER)
