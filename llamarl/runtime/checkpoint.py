"""Checkpoints: atomic steps, keep-K, resume-latest, and the small JSON / safetensors files.

Nothing here unpickles: sharded trainer state is per-rank safetensors + JSON
(``llamarl/runtime/sharded_state.py``), small state is JSON, RNG states are safetensors.

A checkpoint of step n (the state after n ticks) is written by every executor into
``checkpoints/step_<n>.partial/<executor>/``; after a WORLD barrier one rank renames it to
``step_<n>/`` and writes ``step_<n>/COMPLETE.json``. Only directories with that marker are resumed
(``--checkpoint.resume latest``) or counted by ``--checkpoint.keep``. Per executor:

- trainer: ``state/`` (model + AdamW, sharded, every trainer rank), ``state.json`` (version);
- generator: ``state_rank<k>.json`` (data position, weight version, carried-over samples,
  unfinished groups) and ``rng_rank<k>.safetensors``;
- every executor: ``outputs_rank<k>.safetensors`` (batches produced but not yet sent);
- the runner (``llamarl/run/checkpoints.py``), beside the marker: ``runner_state.json`` (the
  evaluations made so far, the run's elapsed wall seconds, the steps it was resumed from), so that
  the summary of a resumed run describes the whole run.

Every file's size and xxh3-128 digest are recorded in ``COMPLETE.json`` as the files are written,
and a resume verifies them first (``llamarl/runtime/checkpoint_files.py``), with the run's identity
(``llamarl/runtime/run_identity.py``): ``choose_checkpoint`` falls back from a ``latest`` that does not
verify to the newest earlier one that does. A step is deleted (``prune``) by first renaming it out
of the ``step_<n>`` namespace (``step_<n>.deleting``), so a crash never leaves a marked checkpoint
without its files.

Resuming at step n makes the run directory describe one timeline again: ``archive_after`` moves
whatever an abandoned run left there of the ticks after n (newer checkpoints, exports, evaluation
samples, metric records, the final summary) into ``<run>/abandoned-<time>/``.
"""

from __future__ import annotations

import json
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from llamarl.runtime.checkpoint_files import (
    HASH,
    CheckpointInvalid,
    collect_files,
    fault_point,
    verify_checkpoint,
    written,
)
from llamarl.runtime.run_identity import check_identity

COMPLETE_MARKER = "COMPLETE.json"
RUNNER_STATE = "runner_state.json"
ARCHIVE_PREFIX = "abandoned-"
DELETING_SUFFIX = ".deleting"
VERIFY_MODES = ("full", "size", "off")


@dataclass(frozen=True)
class ResumePoint:
    """Where this segment of a run starts: the checkpoint it resumes from (None: a fresh run at step
    0), that checkpoint's step, the runner's state saved in it (``RUNNER_STATE``; empty when the
    checkpoint has none, or for a fresh run) and, when the run had already finished there, its
    summary (then nothing is run)."""

    directory: Path | None = None
    step: int = 0
    restored: dict = field(default_factory=dict)
    finished: dict | None = None

    def __post_init__(self) -> None:
        if self.step < 0:
            raise ValueError(f"a resume point's step must be >= 0, got {self.step}")
        if self.directory is None and (self.step or self.restored or self.finished is not None):
            raise ValueError("a fresh run (no checkpoint) starts at step 0 with no restored state")

    @property
    def resumed_at(self) -> int | None:
        """The step resumed from, or None for a fresh run."""
        return self.step if self.directory is not None else None


def step_dir(checkpoint_dir: Path, step: int) -> Path:
    """Where the checkpoint taken after ``step`` ticks lives (complete once it holds the marker)."""
    return checkpoint_dir / f"step_{step}"


def partial_dir(checkpoint_dir: Path, step: int) -> Path:
    """Where every executor writes the checkpoint of ``step`` before it is committed."""
    return checkpoint_dir / f"step_{step}.partial"


def commit_step(checkpoint_dir: Path, step: int, info: dict) -> Path:
    """Make the checkpoint of ``step`` visible: list its files with their digests, rename its partial
    directory, then write the marker (``info`` plus ``files`` and ``hash``).

    Called by one rank after a barrier that every executor passed once its files (and each rank's
    manifest of them, ``llamarl/runtime/checkpoint_files.py``) were on disk. A crash before the rename
    leaves only ``step_<n>.partial``; between the rename and the marker, a directory without a
    marker: neither is ever resumed or counted, and the next ``prune`` removes both.
    """
    final = step_dir(checkpoint_dir, step)
    partial = partial_dir(checkpoint_dir, step)
    files = collect_files(partial)
    if final.exists():  # a step written again (an abandoned timeline's): out of the namespace first
        _remove(final, current=step)
    fault_point("rename", step)
    partial.rename(final)
    fault_point("marker", step)
    write_json(final / COMPLETE_MARKER, {"step": step, **info, "hash": HASH, "files": files})
    return final


def _remove(path: Path, *, current: int) -> None:
    """Delete a step directory so that no crash leaves it half-deleted under its own name: renamed to
    ``<name>.deleting`` (which nothing resumes or counts) first, then removed (``current``: the step
    being committed, for ``fault_point``)."""
    doomed = path.with_name(path.name + DELETING_SUFFIX)
    if doomed.exists():
        shutil.rmtree(doomed, ignore_errors=True)
    path.rename(doomed)
    fault_point("prune", current)
    shutil.rmtree(doomed, ignore_errors=True)


def complete_steps(checkpoint_dir: Path) -> list[int]:
    """Steps with a complete checkpoint (marker present), ascending."""
    if not checkpoint_dir.is_dir():
        return []
    steps = []
    for path in checkpoint_dir.iterdir():
        name = path.name
        if name.startswith("step_") and name[5:].isdigit() and (path / COMPLETE_MARKER).is_file():
            steps.append(int(name[5:]))
    return sorted(steps)


def prune(checkpoint_dir: Path, *, keep: int, current: int) -> list[Path]:
    """Delete complete checkpoints beyond the newest ``keep`` (0 keeps all), every partial or
    unmarked directory older than ``current`` and whatever an interrupted deletion left
    (``step_<n>.deleting``); return what was deleted. Each goes out of the ``step_<n>`` namespace
    before its files do (``_remove``)."""
    removed = []
    steps = complete_steps(checkpoint_dir)
    doomed = set(steps[:-keep]) if keep and len(steps) > keep else set()
    for path in sorted(checkpoint_dir.iterdir()) if checkpoint_dir.is_dir() else []:
        if path.name.endswith(DELETING_SUFFIX) and path.name.startswith("step_"):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
            continue
        name = path.name.removesuffix(".partial")
        if not (name.startswith("step_") and name[5:].isdigit()):
            continue
        step = int(name[5:])
        stale = step < current and (path.name.endswith(".partial") or not (path / COMPLETE_MARKER).is_file())
        if step in doomed and not path.name.endswith(".partial") or stale:
            _remove(path, current=current)
            removed.append(path)
    return removed


def resolve_resume(resume: str, checkpoint_dir: Path) -> tuple[Path, int]:
    """``(directory, step)`` named by ``resume``: ``"latest"`` (the newest complete step under
    ``checkpoint_dir``) or a ``.../step_<n>`` directory, which must be complete. Nothing is verified
    (``choose_checkpoint`` does)."""
    return _candidates(resume, checkpoint_dir)[0]


def _candidates(resume: str, checkpoint_dir: Path) -> list[tuple[Path, int]]:
    """The checkpoints ``resume`` may resume from, in order of preference: for ``latest`` every
    complete step, newest first; else the one named.

    The name's form (``latest`` or ``.../step_<n>``) is also checked by ``CheckpointConfig`` when a
    run's flags are parsed; it is checked again here as the contract of the public functions that
    take ``resume`` as a plain string (``resolve_resume``, ``choose_checkpoint``, ``resume_point``).
    The marker is looked for each time: the files may have changed since an earlier check (the
    flags' check, the launch scripts' preflight). One call of ``resume_point`` runs this once."""
    if resume == "latest":
        steps = complete_steps(checkpoint_dir)
        if not steps:
            raise ValueError(f"--checkpoint.resume latest: no complete checkpoint under {checkpoint_dir}")
        return [(step_dir(checkpoint_dir, s), s) for s in reversed(steps)]
    path = Path(resume)
    name = path.name
    if not (name.startswith("step_") and name[5:].isdigit()):
        raise ValueError(f"--checkpoint.resume must be 'latest' or a .../step_<n> directory, got {resume!r}")
    if not (path / COMPLETE_MARKER).is_file():
        raise ValueError(f"--checkpoint.resume {resume}: not a complete checkpoint (no {COMPLETE_MARKER}; "
                         "the run died while saving it)")
    return [(path, int(name[5:]))]


def choose_checkpoint(resume: str, checkpoint_dir: Path, *, verify: str = "full", identity: dict | None = None,
                      allow_changes: tuple[str, ...] = (), defaults: dict | None = None,
                      ) -> tuple[Path, int, list[str]]:
    """``(directory, step, notes)``: the checkpoint this run resumes from, verified (``verify``: full /
    size / off, ``llamarl/runtime/checkpoint_files.py``) and of this run (``identity``, when given:
    ``llamarl/runtime/run_identity.py``; ``allow_changes``: the fields it may differ in). ``notes`` are lines
    to log (a fallback, an unverifiable older checkpoint, allowed changes).

    ``latest`` falls back, newest first, past checkpoints that do not verify, and says so; a step
    named explicitly is resumed as named or not at all. Another run's checkpoint is refused, not
    skipped (its older steps are of the same run). Each failure is a one-line ValueError. Reads
    files only."""
    return _choose(resume, _candidates(resume, checkpoint_dir), checkpoint_dir, verify=verify, identity=identity,
                   allow_changes=allow_changes, defaults=defaults)


def _choose(resume: str, candidates: list[tuple[Path, int]], checkpoint_dir: Path, *, verify: str,
            identity: dict | None, allow_changes: tuple[str, ...], defaults: dict | None,
            ) -> tuple[Path, int, list[str]]:
    """``choose_checkpoint`` among ``candidates`` (``_candidates(resume, checkpoint_dir)``)."""
    notes: list[str] = []
    failures: list[str] = []
    for path, step in candidates:
        try:
            marker = read_json(path / COMPLETE_MARKER)
        except ValueError as exc:
            failures.append(str(exc))
            continue
        if identity is not None and not failures:
            changed = check_identity(marker.get("identity"), identity, allow=allow_changes, where=path,
                                     defaults=defaults)
            if changed == ["<no identity>"]:
                notes.append(f"{path} records no run identity (written by an older llamarl): not compared")
            elif changed:
                notes.append(f"resuming {path} with changes allowed by --checkpoint.allow-changes: {'; '.join(changed)}")
        try:
            verified = verify_checkpoint(path, marker, mode=verify)
        except CheckpointInvalid as exc:
            failures.append(str(exc))
            continue
        if failures:
            notes.append(f"checkpoint verification failed ({'; '.join(failures)}): falling back to {path}")
        if not verified:
            notes.append(f"{path} has no file digests (written by an older llamarl): not verified")
        return path, step, notes
    if resume != "latest":
        raise ValueError(f"--checkpoint.resume {resume} does not verify: {failures[0]}; resume another step "
                         "(--checkpoint.resume latest falls back to the newest one that verifies)")
    raise ValueError(f"--checkpoint.resume latest: no checkpoint under {checkpoint_dir} verifies "
                     f"({'; '.join(failures)})")


def resume_point(resume: str | None, run_dir: Path, *, max_steps: int, verify: str = "full",
                 identity: dict | None = None, allow_changes: tuple[str, ...] = (),
                 defaults: dict | None = None) -> tuple[ResumePoint, list[str]]:
    """Where a run of ``run_dir`` starts with ``--checkpoint.resume`` ``resume`` (None: a fresh
    run), and the lines to log about it: the checkpoint (``choose_checkpoint`` under
    ``run_dir/checkpoints``: verified, of this run), the runner's state saved in it, and the summary
    of a run that already finished there (``finished_summary``; then nothing is read or verified:
    nothing is run, even if its newest checkpoint were damaged). Reads files only; moves nothing
    (``archive_after`` does)."""
    if not resume:
        return ResumePoint(), []
    checkpoints = run_dir / "checkpoints"
    candidates = _candidates(resume, checkpoints)  # for ``latest`` the newest complete step first
    finished = finished_summary(run_dir, *candidates[0], max_steps)
    if finished is not None:
        return ResumePoint(*candidates[0], finished=finished), []
    directory, step, notes = _choose(resume, candidates, checkpoints, verify=verify, identity=identity,
                                     allow_changes=allow_changes, defaults=defaults)
    return ResumePoint(directory, step, restored=read_runner_state(directory) or {}), notes


def finished_summary(run_dir: Path, resume_dir: Path, step: int, max_steps: int) -> dict | None:
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


def _step_of(name: str, prefix: str, suffixes: tuple[str, ...] = ("",)) -> int | None:
    """``n`` of a name ``<prefix><n><suffix>`` for one of ``suffixes``, else None."""
    for suffix in suffixes:
        core = name.removesuffix(suffix) if suffix else name
        if (not suffix or name.endswith(suffix)) and core.startswith(prefix) and core[len(prefix):].isdigit():
            return int(core[len(prefix):])
    return None


def archive_after(run_dir: Path, step: int) -> tuple[Path, list[str]] | None:
    """Move what ``run_dir`` holds of ticks after ``step`` into ``run_dir/abandoned-<time>/``; return
    that directory and a short description of each thing moved, or None when there was nothing.

    Called once (one rank, before any rank reads the run directory) when a run resumes at ``step``:
    whatever an earlier run did after that step belongs to a timeline the resumed run abandons, and
    would otherwise be mixed with the new one (``--checkpoint.resume latest`` and keep-K prefer newer
    checkpoints; metric files would hold two records of a tick). Nothing is deleted: the archive
    keeps the run directory's layout. Moved:

    - ``checkpoints/step_<m>`` (complete or not) and ``step_<m>.partial`` for m > ``step``;
    - ``hf/step_<m>`` for m > ``step``, ``eval_step_<m>.jsonl`` for m > ``step``, and the abandoned
      run's end: ``hf/final``, ``eval_final.jsonl``, ``summary.json`` (the resumed run rewrites them);
    - the records of ticks >= ``step`` of every ``metrics/*.jsonl`` (tick t leads to the state after
      t + 1 ticks, so those ticks are run again), and unreadable lines (a write cut by a kill), into
      the archive's ``metrics/`` file of the same name.

    TensorBoard event files cannot be cut: the resumed run's writers purge their steps >= ``step``
    instead (``MetricsLogger``). What describes ticks up to ``step`` stays: it is the resumed run's
    own history.
    """
    moves: list[Path] = []
    checkpoints = run_dir / "checkpoints"
    for path in sorted(checkpoints.iterdir()) if checkpoints.is_dir() else []:
        m = _step_of(path.name, "step_", (".partial", ""))
        if m is not None and m > step:
            moves.append(path)
    hf = run_dir / "hf"
    for path in sorted(hf.iterdir()) if hf.is_dir() else []:
        m = _step_of(path.name, "step_")
        if path.name == "final" or m is not None and m > step:
            moves.append(path)
    for path in sorted(run_dir.glob("eval_*.jsonl")):
        m = _step_of(path.name, "eval_step_", (".jsonl",))
        if path.name == "eval_final.jsonl" or m is not None and m > step:
            moves.append(path)
    if (run_dir / "summary.json").is_file():
        moves.append(run_dir / "summary.json")
    cut: dict[Path, tuple[list[str], list[str]]] = {}  # metrics file -> (kept lines, moved lines)
    for path in sorted((run_dir / "metrics").glob("*.jsonl")):
        kept, moved = [], []
        for line in path.read_text(encoding="utf-8").splitlines():
            if not line.strip():
                continue
            try:
                tick = json.loads(line).get("step", 0)
            except (json.JSONDecodeError, AttributeError):
                tick = step  # unreadable: not a record of this timeline
            (moved if tick >= step else kept).append(line)
        if moved:
            cut[path] = kept, moved
    if not moves and not cut:
        return None
    stamp = time.strftime("%Y%m%d-%H%M%S")
    archive = run_dir / f"{ARCHIVE_PREFIX}{stamp}"
    suffix = 1
    while archive.exists():
        archive, suffix = run_dir / f"{ARCHIVE_PREFIX}{stamp}-{suffix}", suffix + 1
    described = []
    for path in moves:
        target = archive / path.relative_to(run_dir)
        target.parent.mkdir(parents=True, exist_ok=True)
        path.rename(target)
        described.append(str(path.relative_to(run_dir)))
        fault_point("archive", step)
    for path, (kept, moved) in cut.items():
        target = archive / path.relative_to(run_dir)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text("".join(line + "\n" for line in moved), encoding="utf-8")
        tmp = path.with_suffix(path.suffix + ".tmp")
        tmp.write_text("".join(line + "\n" for line in kept), encoding="utf-8")
        tmp.replace(path)
        described.append(f"{path.relative_to(run_dir)} ({len(moved)} record{'s' * (len(moved) != 1)})")
    write_json(archive / "ABANDONED.json", {"resumed_at_step": step, "time": time.time(), "moved": described})
    return archive, described


def read_runner_state(directory: Path) -> dict | None:
    """The runner's state saved with the checkpoint ``directory`` (``RUNNER_STATE``), or None when the
    checkpoint has none (written before the runner saved it); a corrupt file is a one-line ValueError."""
    path = directory / RUNNER_STATE
    return read_json(path) if path.is_file() else None


def write_json(path: Path, value: dict) -> None:
    """Atomically write JSON (temp file + rename) so a killed run never leaves half a file."""
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(value))
    tmp.replace(path)
    written(path)


def read_json(path: Path) -> dict:
    """Read a JSON checkpoint file; a missing or corrupt file is a one-line ValueError."""
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"cannot read checkpoint file {path}: {exc}") from None


def save_rng(path: Path, generator: torch.Generator) -> None:
    save_file({"state": generator.get_state()}, str(path))
    written(path)


def load_rng(path: Path, generator: torch.Generator) -> None:
    try:
        state = load_file(str(path))["state"]
    except (OSError, SafetensorError, KeyError) as exc:
        raise ValueError(f"cannot read checkpoint file {path}: {exc}") from None
    generator.set_state(state)
