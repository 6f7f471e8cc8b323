"""A run's checkpoints and exports, and the runner's own state in each checkpoint (part of
``llamarl/runner.py``).

The controller writes the checkpoints (``--checkpoint.every``, ``--checkpoint.keep``) and the
exports (``--export.every``, ``--export.final``, under ``<run>/hf/``) as its ``Upkeep`` says
(``llamarl/controller.py``, ``llamarl/checkpoint.py`` for the files). Beside the executors' state,
every checkpoint holds the runner's (``runner_state.json``: the evaluations made so far, the
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

from pathlib import Path

from llamarl.checkpoint import COMPLETE_MARKER, RUNNER_STATE, step_dir, write_json
from llamarl.checkpoint_files import replace_committed_file
from llamarl.config import CheckpointConfig, ExportConfig, RunConfig
from llamarl.controller import Upkeep
from llamarl.eval_history import Evaluations
from llamarl.world import ExecutorContext, world_barrier


class RunCheckpoints:
    """The controller's ``Upkeep`` for a run and its hooks that keep the runner's state in each
    checkpoint (module docstring)."""

    def __init__(self, checkpoint: CheckpointConfig, export: ExportConfig, *, run: RunConfig, run_dir: Path,
                 evaluations: Evaluations, ctx: ExecutorContext, reporter_rank: int,
                 identity: dict | None = None) -> None:
        """``reporter_rank``: the global rank that writes the runner's state and ``summary.json``
        (the evaluator's first rank, else 0). ``identity``: the run's (``llamarl/run_identity.py``),
        recorded in each checkpoint's marker by global rank 0 (None elsewhere). A failing rank's
        traceback goes to ``<run>/logs/``."""
        self.checkpoint_dir = run_dir / "checkpoints"
        self.every, self.max_steps = checkpoint.every, run.max_steps
        self.evaluations, self.ctx = evaluations, ctx
        self.reporter_rank, self.reporter = reporter_rank, ctx.rank == reporter_rank
        self.upkeep = Upkeep(checkpoint_every=checkpoint.every, checkpoint_keep=checkpoint.keep,
                             checkpoint_dir=self.checkpoint_dir, export_every=export.every,
                             export_dir=run_dir / "hf" if export.final or export.every else None,
                             device_guard=run.device_guard, liveness_timeout_s=run.liveness_timeout_s,
                             checkpoint_info={"identity": identity} if identity is not None else {},
                             traceback_dir=run_dir / "logs")

    def save_state(self, partial: Path) -> None:
        """The controller's ``on_checkpoint``: the runner's state into the checkpoint being written
        (its ``partial`` directory), before the WORLD barrier that commits it."""
        if self.reporter:
            write_json(partial / RUNNER_STATE, self.evaluations.state())

    def after_tick(self, step: int) -> None:
        """The controller's ``after_tick`` for tick ``step``: the evaluation due after ``step + 1``
        ticks, and the runner's state of the checkpoint of that step updated with it."""
        done = step + 1
        if not self.evaluations.due(done):
            return
        checkpointed = bool(self.every) and done % self.every == 0
        if checkpointed and self.reporter_rank != 0:
            # Rank 0 has committed step_<done>, whose runner state the reporter updates below.
            world_barrier(self.ctx)
        self.evaluations.between_ticks(done)
        if checkpointed and self.reporter:
            # The marker lists the file's digest: rewritten with it (llamarl/checkpoint_files.py).
            replace_committed_file(step_dir(self.checkpoint_dir, done), RUNNER_STATE, self.evaluations.state(),
                                   marker_name=COMPLETE_MARKER)

    def after_final(self, *, start_step: int) -> None:
        """After the final evaluation, on every rank: the whole run's state into this segment's
        checkpoint of the last step, if it took one (``start_step``: where the segment began), as
        ``after_tick`` does for the evaluations between ticks."""
        if not (self.every and self.max_steps % self.every == 0 and self.max_steps > start_step):
            return
        if self.reporter_rank != 0:
            world_barrier(self.ctx)  # rank 0 has committed step_<max_steps>
        last = step_dir(self.checkpoint_dir, self.max_steps)
        if self.reporter and (last / COMPLETE_MARKER).is_file():
            replace_committed_file(last, RUNNER_STATE, self.evaluations.state(), marker_name=COMPLETE_MARKER)
