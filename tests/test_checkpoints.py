"""Checkpoints: reshardable pickle-free trainer state, atomic steps, keep-K, resume-latest, errors."""

import json
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

sys.path.insert(0, str(Path(__file__).parent))
from launch import check, run_torchrun
from test_trainer import setup  # noqa: F401 - a fixture: tiny model + batch

from llamarl.checkpoint import (
    COMPLETE_MARKER,
    commit_step,
    complete_steps,
    partial_dir,
    prune,
    resolve_resume,
)


def saved(path):
    with safe_open(str(path), "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}, json.loads(f.metadata()["version"])  # noqa: SIM118


@pytest.mark.parametrize(("save_ranks", "load_ranks"), [(2, 1), (1, 2), (2, 2)])
def test_trainer_state_reshards_bitwise(setup, tmp_path, save_ranks, load_ranks):  # noqa: F811
    """Weights and every AdamW moment saved by N ranks load onto M ranks unchanged."""
    _, model_dir, _ = setup
    batch_file = setup[0] / "batch.safetensors"
    ckpt = tmp_path / "ckpt"
    check(run_torchrun("reshard_world.py", nproc=save_ranks,
                       args=[str(model_dir), str(batch_file), str(ckpt), str(tmp_path / "saved.st"), "save"]))
    check(run_torchrun("reshard_world.py", nproc=load_ranks,
                       args=[str(model_dir), str(batch_file), str(ckpt), str(tmp_path / "loaded.st"), "load"]))
    before, version_before = saved(tmp_path / "saved.st")
    after, version_after = saved(tmp_path / "loaded.st")
    assert version_before == version_after == 1
    assert sorted(before) == sorted(after) and any(k.startswith("exp_avg_sq.") for k in before)
    for key, tensor in before.items():
        assert torch.equal(after[key], tensor), key
    # Nothing in the checkpoint needs unpickling: only safetensors and JSON files.
    assert {p.suffix for p in (ckpt / "state").iterdir()} == {".safetensors", ".json"}


def test_truncated_state_file_is_an_error_naming_it(setup, tmp_path):  # noqa: F811
    _, model_dir, _ = setup
    batch_file = setup[0] / "batch.safetensors"
    ckpt = tmp_path / "ckpt"
    check(run_torchrun("reshard_world.py", nproc=1,
                       args=[str(model_dir), str(batch_file), str(ckpt), str(tmp_path / "s.st"), "save"]))
    shard = ckpt / "state" / "rank0.safetensors"
    shard.write_bytes(shard.read_bytes()[:1000])
    proc = run_torchrun("reshard_world.py", nproc=1,
                        args=[str(model_dir), str(batch_file), str(ckpt), str(tmp_path / "l.st"), "load"])
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
