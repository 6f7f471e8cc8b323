"""Checkpoints: reshardable pickle-free trainer state, atomic steps, keep-K, resume-latest, errors."""

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from launch import check, run_torchrun
from test_trainer import setup  # noqa: F401 - a fixture: tiny model + batch

from llamarl.runtime.checkpoint import (
    COMPLETE_MARKER,
    archive_after,
    commit_step,
    complete_steps,
    partial_dir,
    prune,
    resolve_resume,
)

# Resharding N -> M trainer ranks bitwise: tests/test_trainer_state.py, on a tied model (the layout
# users run; every other parameter exercises the untied path).


def test_truncated_state_file_is_an_error_naming_it(setup, tmp_path):  # noqa: F811
    _, model_dir, _ = setup
    batch_file = setup[0] / "batch.safetensors"
    ckpt = tmp_path / "ckpt"
    check(run_torchrun("reshard_world.py", nproc=1,
                       args=["--model-dir", str(model_dir), "--batch", str(batch_file),
                             "--job", str(ckpt), str(tmp_path / "s.st"), "save"]))
    shard = ckpt / "state" / "rank0.safetensors"
    shard.write_bytes(shard.read_bytes()[:1000])
    proc = run_torchrun("reshard_world.py", nproc=1,
                        args=["--model-dir", str(model_dir), "--batch", str(batch_file),
                              "--job", str(ckpt), str(tmp_path / "l.st"), "load"])
    assert proc.returncode != 0
    assert f"cannot read checkpoint file {shard}" in proc.stderr


def make_step(root, step, *, complete=True):
    partial_dir(root, step).mkdir(parents=True)
    (partial_dir(root, step) / "x").write_text("state")
    if complete:
        commit_step(root, step, {})


def test_only_marked_steps_count_and_keep_k_prunes(tmp_path):
    root = tmp_path / "checkpoints"
    for step in (2, 4, 6):
        make_step(root, step)
    make_step(root, 8, complete=False)  # a save interrupted before its rename
    (root / "step_10").mkdir()  # renamed but the marker never written
    assert complete_steps(root) == [2, 4, 6]
    assert resolve_resume("latest", root) == (root / "step_6", 6)
    prune(root, keep=2, current=12)
    assert sorted(p.name for p in root.iterdir()) == ["step_4", "step_6"]
    assert (root / "step_6" / COMPLETE_MARKER).is_file() and (root / "step_6" / "x").read_text() == "state"


def test_resume_errors_are_one_line_and_name_the_problem(tmp_path):
    with pytest.raises(ValueError, match="no complete checkpoint under"):
        resolve_resume("latest", tmp_path / "none")
    (tmp_path / "step_3").mkdir()
    with pytest.raises(ValueError, match="not a complete checkpoint"):
        resolve_resume(str(tmp_path / "step_3"), tmp_path)
    with pytest.raises(ValueError, match="'latest' or a .../step_<n>"):
        resolve_resume(str(tmp_path / "elsewhere"), tmp_path)


def test_archive_after_moves_only_what_follows_the_resumed_step(tmp_path):
    """Resuming at step 4 of a run that reached 8: its later checkpoints, exports, evaluation samples,
    final artefacts and metric records of ticks >= 4 move to one archive; its history up to 4 stays."""
    run = tmp_path / "run"
    root = run / "checkpoints"
    for step in (2, 4, 6, 8):
        make_step(root, step)
    make_step(root, 10, complete=False)
    for name in ("hf/step_4", "hf/step_8", "hf/final"):
        (run / name).mkdir(parents=True)
    for name in ("eval_base.jsonl", "eval_step_4.jsonl", "eval_step_6.jsonl", "eval_final.jsonl",
                 "summary.json"):
        (run / name).write_text("{}\n")
    (run / "metrics").mkdir()
    lines = [json.dumps({"step": t, "loss": float(t)}) for t in range(9)]
    cut = '{"step": 9, "lo'  # a write cut short by a kill
    (run / "metrics" / "trainer.jsonl").write_text("\n".join(lines) + "\n" + cut)
    (run / "metrics" / "reward.jsonl").write_text("\n".join(lines[:3]) + "\n")  # nothing after tick 3

    archive, moved = archive_after(run, 4)
    assert archive.parent == run and archive.name.startswith("abandoned-")
    assert complete_steps(root) == [2, 4] and sorted(p.name for p in root.iterdir()) == ["step_2", "step_4"]
    assert resolve_resume("latest", root) == (root / "step_4", 4)
    assert complete_steps(archive / "checkpoints") == [6, 8]
    assert (archive / "checkpoints" / "step_10.partial").is_dir()
    assert sorted(p.name for p in (run / "hf").iterdir()) == ["step_4"]
    assert sorted(p.name for p in (archive / "hf").iterdir()) == ["final", "step_8"]
    assert sorted(p.name for p in run.glob("*.json*")) == ["eval_base.jsonl", "eval_step_4.jsonl"]
    assert (archive / "summary.json").is_file() and (archive / "eval_final.jsonl").is_file()
    assert (run / "metrics" / "trainer.jsonl").read_text() == "".join(line + "\n" for line in lines[:4])
    assert (run / "metrics" / "reward.jsonl").read_text() == "".join(line + "\n" for line in lines[:3])
    assert (archive / "metrics" / "trainer.jsonl").read_text().splitlines() == [*lines[4:], cut]
    assert not (archive / "metrics" / "reward.jsonl").exists()
    assert "metrics/trainer.jsonl (6 records)" in moved and "checkpoints/step_6" in moved
    assert json.loads((archive / "ABANDONED.json").read_text())["resumed_at_step"] == 4
    # Nothing left after step 4: no second archive.
    assert archive_after(run, 4) is None
    # Resuming further back archives again, beside the first archive.
    second, _ = archive_after(run, 2)
    assert second != archive and complete_steps(root) == [2] and complete_steps(second / "checkpoints") == [4]
