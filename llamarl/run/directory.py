"""A run's directory and where the run resumes in it (part of ``llamarl/run/runner.py``).

Every rank of the job uses one run directory: ``--run.output-dir``, or
``runs/<recipe>-<time>`` with global rank 0's time broadcast to every rank, checked at start to be
the same filesystem on every node (``llamarl/runtime/shared_dir.py``). It holds ``config.json`` (written
by global rank 0; each later segment of a resumed run adds ``config.<k>.json`` beside it),
``logs/`` (a failing rank's traceback), ``checkpoints/``, ``metrics/``, ``timeline/``, the evaluation samples, the exports
under ``hf/`` and ``summary.json``.

Resuming (``--checkpoint.resume``) at step n continues one run, not a second one beside it:

- global rank 0 first chooses the checkpoint and proves it (``llamarl.runtime.checkpoint.choose_checkpoint``:
  every file's digest, ``--checkpoint.verify``; the run's identity, ``--checkpoint.allow-changes``;
  ``latest`` falling back past a checkpoint that does not verify) before anything on disk moves, and
  tells every rank the step it chose (a broadcast). A checkpoint that cannot be resumed ends the job
  with one ``llamarl:`` line on rank 0 and exit code 2 on every rank (``ResumeRefused``), and the
  run directory is as it was;

- what the run directory holds of the ticks after n (newer checkpoints of an abandoned run,
  their exports, evaluation samples, metric records, its summary) is first moved into
  ``<run>/abandoned-<time>/`` by global rank 0 (the rank that commits checkpoints), between two
  WORLD barriers, so no rank reads the directory while it changes; one line names what moved
  (``llamarl.runtime.checkpoint.archive_after``). Archived rather than refused: a resume from an older
  checkpoint is deliberate, and nothing of the abandoned run is lost;
- the runner's state saved in the checkpoint (``runner_state.json``) is restored: the summary of
  the resumed run describes the whole run (``llamarl/run/evaluations.py``);
- resuming a finished run from its newest checkpoint (``--checkpoint.resume latest`` after the run
  ended) with the same ``--run.max-steps`` N, which its ``summary.json`` reports, ends at once with
  ``run already finished at step N (<run>/summary.json); nothing to do`` and returns that summary:
  the final evaluation and export are not made again and the summary is not rewritten. A higher
  ``--run.max-steps`` trains on from there.
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from llamarl.run.config import CheckpointConfig, RunConfig
from llamarl.runtime.checkpoint import (
    RUNNER_STATE,
    ResumePoint,
    archive_after,
    complete_steps,
    resume_point,
    step_dir,
)
from llamarl.runtime.shared_dir import check_shared_run_dir
from llamarl.runtime.world import ExecutorContext, world_barrier

logger = logging.getLogger("llamarl.runner")


_held_locks: dict[Path, object] = {}  # this process's run-directory locks, until the run ends


def _lock(path: Path) -> None:
    """Hold ``<run>/.lock`` (``flock``) for this process's life: a second job writing the same run
    directory (a resume started while the first still runs, e.g. its torchrun agent killed but not
    its workers) stops with one line instead of interleaving checkpoints. The kernel releases the
    lock when the process ends, however it ends; a run that ends normally releases it
    (``release_lock``)."""
    import fcntl

    handle = open(path / ".lock", "a+")  # noqa: SIM115 - held open on purpose
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        handle.seek(0)
        holder = handle.read().strip() or "?"
        handle.close()
        raise ValueError(f"run directory {path} is in use by another job (pid {holder}, {path / '.lock'}): "
                         "wait for it or stop it, or use another --run.output-dir") from None
    handle.seek(0)
    handle.truncate()
    handle.write(str(os.getpid()))
    handle.flush()
    _held_locks[path] = handle


def release_lock(path: Path) -> None:
    """Release ``_lock``'s lock of ``path`` (the run ended; a no-op where none is held)."""
    handle = _held_locks.pop(path, None)
    if handle is not None:
        handle.close()


class ResumeRefused(ValueError):
    """The checkpoint to resume cannot be resumed: raised on every rank (the message on global rank 0,
    None elsewhere); the runner reports it as one line and exits 2."""


def current_config(run_dir: Path) -> Path:
    """The newest segment's ``config.json`` / ``config.<k>.json`` of ``run_dir`` (``RunDirectory.record``)."""
    path, k = run_dir / "config.json", 1
    while (run_dir / f"config.{k}.json").exists():
        path, k = run_dir / f"config.{k}.json", k + 1
    return path


@dataclass(frozen=True)
class RunDirectory:
    """This run's directory, the same on every rank (module docstring)."""

    path: Path
    """The one directory every rank sees (``open`` makes sure of it)."""

    @classmethod
    def open(cls, run: RunConfig, *, recipe: str, ctx: ExecutorContext) -> RunDirectory:
        """Create the run directory of ``run.output_dir`` (default ``runs/<recipe>-<time>``, global
        rank 0's time) and check that every rank sees the same one. Collective over WORLD."""
        if run.output_dir:
            path = Path(run.output_dir)
        else:  # rank 0's timestamp, broadcast as a tensor (nothing is unpickled)
            stamp = torch.tensor([int(time.time())], dtype=torch.int64, device=ctx.world_device)
            dist.broadcast(stamp, src=0)
            path = Path("runs") / f"{recipe}-{time.strftime('%Y%m%d-%H%M%S', time.localtime(int(stamp.item())))}"
        path.mkdir(parents=True, exist_ok=True)
        check_shared_run_dir(path, device=ctx.world_device)  # every node must see the same directory
        if ctx.rank == 0:
            _lock(path)
        return cls(path)

    def resume(self, checkpoint: CheckpointConfig, *, max_steps: int, ctx: ExecutorContext,
               identity: dict | None = None, defaults: dict | None = None) -> ResumePoint:
        """Where this segment of the run starts (``--checkpoint.resume``; ``llamarl.runtime.checkpoint.resume_point``),
        the run directory made one timeline for it. ``identity``: this run's (global rank 0's; None
        elsewhere), compared with the checkpoint's.

        Collective (a broadcast, WORLD barriers): global rank 0 chooses and verifies the checkpoint
        and moves what an abandoned later timeline left into ``<run>/abandoned-<time>/``; no rank
        reads the run directory before it is one timeline again. A finished run moves nothing.
        Raises ``ResumeRefused`` on every rank when the checkpoint cannot be resumed (rank 0's
        carries the message), before anything moved."""
        if not checkpoint.resume:
            steps = complete_steps(self.path / "checkpoints")
            if steps and ctx.rank == 0:
                logger.warning("%s already holds checkpoints (newest: step_%d) of an earlier run: this run starts "
                               "from scratch beside them (its checkpoints replace theirs, --checkpoint.keep prunes "
                               "both); --checkpoint.resume latest would have continued it", self.path, steps[-1])
            return ResumePoint()
        chosen = torch.zeros(2, dtype=torch.int64, device=ctx.world_device)  # (ok, step)
        refusal = None
        if ctx.rank == 0:
            try:
                point, notes = resume_point(checkpoint.resume, self.path, max_steps=max_steps, verify=checkpoint.verify,
                                            identity=identity, allow_changes=checkpoint.allowed_changes(),
                                            defaults=defaults)
            except ValueError as exc:
                refusal = str(exc)
            else:
                for note in notes:
                    logger.warning("%s", note)
                chosen[0], chosen[1] = 1, point.step
        dist.broadcast(chosen, src=0)
        if not int(chosen[0].item()):
            raise ResumeRefused(refusal)
        if ctx.rank != 0:  # rank 0's choice, read again here (files only: nothing verified twice)
            point, _ = resume_point(str(step_dir(self.path / "checkpoints", int(chosen[1].item()))), self.path,
                                    max_steps=max_steps, verify="off")
        if point.finished is not None and ctx.rank == 0:
            logger.info("run already finished at step %d (%s); nothing to do", max_steps, self.path / "summary.json")
        if point.finished is not None:
            return point
        world_barrier(ctx)
        if ctx.rank == 0:
            archived = archive_after(self.path, point.step)
            if archived is not None:
                logger.info("resuming at step %d: moved what an abandoned run left after it (%s) to %s",
                            point.step, ", ".join(archived[1]), archived[0])
        world_barrier(ctx)
        return point

    def record(self, config, *, resume: ResumePoint, ctx: ExecutorContext) -> None:
        """On global rank 0: ``config.json`` (``config``, a dataclass) and the run's first lines (the
        directory, the stages' ranks, the checkpoint resumed from)."""
        self.path.mkdir(parents=True, exist_ok=True)
        if ctx.rank != 0:
            return
        # Each segment's configuration is kept: config.json (the first), then config.<k>.json.
        path, k = self.path / "config.json", 1
        while path.exists():
            path, k = self.path / f"config.{k}.json", k + 1
        path.write_text(json.dumps(asdict(config), indent=2))
        logger.info("run directory %s (configuration: %s); stages %s", self.path, path.name,
                    ", ".join(f"{name} ranks {ranks}" for name, ranks in ctx.ranks.items()))
        if resume.directory is not None:
            logger.info("resuming from %s (tick %d)", resume.directory, resume.step)
            if not resume.restored:
                logger.warning("%s has no %s (saved by an older llamarl): summary.json describes the evaluations "
                               "and wall time from step %d on", resume.directory, RUNNER_STATE, resume.step)
