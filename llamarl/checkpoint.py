"""Checkpoints: atomic steps, keep-K, resume-latest, and the small JSON / safetensors files.

Nothing here unpickles: sharded trainer state is per-rank safetensors + JSON
(``llamarl/sharded_state.py``), small state is JSON, RNG states are safetensors.

A checkpoint of step n (the state after n ticks) is written by every executor into
``checkpoints/step_<n>.partial/<executor>/``; after a WORLD barrier one rank renames it to
``step_<n>/`` and writes ``step_<n>/COMPLETE.json``. Only directories with that marker are resumed
(``--checkpoint.resume latest``) or counted by ``--checkpoint.keep``. Per executor:

- trainer: ``state/`` (model + AdamW, sharded, every trainer rank), ``state.json`` (version);
- generator: ``state_rank<k>.json`` (data position, weight version, carried-over samples,
  unfinished groups) and ``rng_rank<k>.safetensors``;
- every executor: ``outputs_rank<k>.safetensors`` (batches produced but not yet sent).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

COMPLETE_MARKER = "COMPLETE.json"


def step_dir(checkpoint_dir: Path, step: int) -> Path:
    """Where the checkpoint taken after ``step`` ticks lives (complete once it holds the marker)."""
    return checkpoint_dir / f"step_{step}"


def partial_dir(checkpoint_dir: Path, step: int) -> Path:
    """Where every executor writes the checkpoint of ``step`` before it is committed."""
    return checkpoint_dir / f"step_{step}.partial"


def commit_step(checkpoint_dir: Path, step: int, info: dict) -> Path:
    """Make the checkpoint of ``step`` visible: rename its partial directory, then write the marker.

    Called by one rank after a barrier that every executor passed once its files were on disk. A
    crash before the rename leaves only ``step_<n>.partial``; between the rename and the marker, a
    directory without a marker: neither is ever resumed or counted.
    """
    final = step_dir(checkpoint_dir, step)
    if final.exists():
        shutil.rmtree(final)
    partial_dir(checkpoint_dir, step).rename(final)
    write_json(final / COMPLETE_MARKER, {"step": step, **info})
    return final


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
    """Delete complete checkpoints beyond the newest ``keep`` (0 keeps all) and every partial or
    unmarked directory older than ``current``; return what was deleted."""
    removed = []
    steps = complete_steps(checkpoint_dir)
    doomed = set(steps[:-keep]) if keep and len(steps) > keep else set()
    for path in sorted(checkpoint_dir.iterdir()) if checkpoint_dir.is_dir() else []:
        name = path.name.removesuffix(".partial")
        if not (name.startswith("step_") and name[5:].isdigit()):
            continue
        step = int(name[5:])
        stale = step < current and (path.name.endswith(".partial") or not (path / COMPLETE_MARKER).is_file())
        if step in doomed and not path.name.endswith(".partial") or stale:
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


def resolve_resume(resume: str, checkpoint_dir: Path) -> tuple[Path, int]:
    """``(directory, step)`` to resume from: ``"latest"`` (the newest complete step under
    ``checkpoint_dir``) or a ``.../step_<n>`` directory, which must be complete."""
    if resume == "latest":
        steps = complete_steps(checkpoint_dir)
        if not steps:
            raise ValueError(f"--checkpoint.resume latest: no complete checkpoint under {checkpoint_dir}")
        return step_dir(checkpoint_dir, steps[-1]), steps[-1]
    path = Path(resume)
    name = path.name
    if not (name.startswith("step_") and name[5:].isdigit()):
        raise ValueError(f"--checkpoint.resume must be 'latest' or a .../step_<n> directory, got {resume!r}")
    if not (path / COMPLETE_MARKER).is_file():
        raise ValueError(f"--checkpoint.resume {resume}: not a complete checkpoint (no {COMPLETE_MARKER}; "
                         "the run died while saving it)")
    return path, int(name[5:])


def write_json(path: Path, value: dict) -> None:
    """Atomically write JSON (temp file + rename) so a killed run never leaves half a file."""
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(value))
    tmp.replace(path)


def read_json(path: Path) -> dict:
    """Read a JSON checkpoint file; a missing or corrupt file is a one-line ValueError."""
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"cannot read checkpoint file {path}: {exc}") from None


def save_rng(path: Path, generator: torch.Generator) -> None:
    save_file({"state": generator.get_state()}, str(path))


def load_rng(path: Path, generator: torch.Generator) -> None:
    try:
        state = load_file(str(path))["state"]
    except (OSError, SafetensorError, KeyError) as exc:
        raise ValueError(f"cannot read checkpoint file {path}: {exc}") from None
    generator.set_state(state)
