"""Checkpoints under faults (llamarl/runtime/checkpoint.py, llamarl/runtime/checkpoint_files.py, llamarl/runtime/run_identity.py).

End to end, one-process colocated runs of the tiny model (tests/worlds/colocated_runs.py, several
runs a process): a SIGKILL at each phase of writing a checkpoint (``state``: this rank's files
written; ``rename``: before the partial directory's rename; ``marker``: before ``COMPLETE.json``;
``prune``: an old step renamed aside; ``archive``: mid-way through a resume's archiving), for full
fine-tuning and LoRA, then ``--checkpoint.resume`` again: every resumed run trains tick for tick the
losses of an uninterrupted one. A corrupted newest checkpoint falls back to the one before, with a
line saying so; a full disk is one line naming the path; a resume into another run's checkpoint or
with nothing complete is one line and exit code 2, and nothing moves.

In process: each file kind of a real checkpoint truncated or flipped (same size), the marker itself
corrupted, a checkpoint whose marker survived a deletion (what today's ``prune`` left after a kill),
and the identity's fields.
"""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from launch import REPO, run_colocated_runs

from llamarl.runtime.checkpoint import COMPLETE_MARKER, choose_checkpoint, complete_steps, prune, resume_point
from llamarl.runtime.checkpoint_files import disk_full_error, verify_checkpoint

STEPS = 3
PHASES = ("state", "rename", "marker", "prune", "archive")
SCORER = {"LLAMARL_TEST_SCORER": "scorers_for_tests:first_char_even"}


def flags(model_dir, out, *extra, lora=False, keep=1):
    return ["--model.name", str(model_dir), "--run.schedule", "colocated", "--run.max-steps", str(STEPS),
            "--run.num-eval-problems", "2", "--run.output-dir", str(out), "--generator.num-prompts-per-step", "2",
            "--reward.num-workers", "0", "--generator.token-budget", "5", "--trainer.lr", "1e-3",
            "--checkpoint.every", "1", "--checkpoint.keep", str(keep), "--trainer.num-threads", "1",
            "--export.no-final", *(["--trainer.lora.rank", "4"] if lora else []), *extra]


def killed(args, phase, step, action="kill"):
    return {"args": args, "env": {"LLAMARL_FAULT": f"{phase}@{step}", "LLAMARL_FAULT_ACTION": action}}


def losses(out):
    path = out / "metrics" / "trainer.jsonl"
    return {r["step"]: r["loss"] for r in map(json.loads, path.read_text().splitlines()) if "loss" in r}


def run_process(plan, root, name):
    return run_colocated_runs(plan, plan_file=root / f"{name}.json", env=SCORER, timeout_s=600)


@pytest.fixture(scope="module")
def faults(tmp_path_factory, model_dir):
    """Every end-to-end scenario, chained so that each process ends with the run it kills."""
    root = tmp_path_factory.mktemp("faults")
    out = {name: root / name for name in ("straight_full", "straight_lora")}
    procs = {}
    scenarios = [(mode, phase) for mode in ("full", "lora") for phase in PHASES]
    pending = [{"args": flags(model_dir, out["straight_full"], keep=0), "env": {}},
               {"args": flags(model_dir, out["straight_lora"], keep=0, lora=True), "env": {}}]
    for i, (mode, phase) in enumerate(scenarios):
        lora = mode == "lora"
        target = root / f"{mode}_{phase}"
        out[(mode, phase)] = target
        if phase == "archive":  # a finished run resumed from step 1, killed while it archives
            shutil.copytree(out[f"straight_{mode}"], target)
            resume = ["--checkpoint.resume", str(target / "checkpoints" / "step_1")]
            plan = [*pending, killed(flags(model_dir, target, *resume, keep=0, lora=lora), "archive", 1)]
            pending = [{"args": flags(model_dir, target, *resume, keep=0, lora=lora), "env": {}}]
        else:
            plan = [*pending, killed(flags(model_dir, target, lora=lora), phase, 2)]
            pending = [{"args": flags(model_dir, target, "--checkpoint.resume", "latest", lora=lora), "env": {}}]
        procs[(mode, phase)] = run_process(plan, root, f"p{i}")
    # A corrupted newest checkpoint (same size), then a full disk at step 2's checkpoint.
    corrupt = out["corrupt"] = root / "corrupt"
    shutil.copytree(out["straight_full"], corrupt)
    (corrupt / "summary.json").unlink()  # as if the run died after its step-3 checkpoint
    state = corrupt / "checkpoints" / "step_3" / "trainer" / "state" / "rank0.safetensors"
    data = bytearray(state.read_bytes())
    middle = len(data) // 2
    data[middle:middle + 256] = data[middle + 256:middle + 512] + data[middle:middle + 256]
    state.write_bytes(bytes(data))
    full = out["full_disk"] = root / "full_disk"
    procs["corrupt"] = run_process([*pending, {"args": flags(model_dir, corrupt, "--checkpoint.resume", "latest",
                                                             keep=0), "env": {}},
                                    killed(flags(model_dir, full), "write", 2, action="enospc")], root, "pc")
    # Another run's settings: refused, one line, nothing moved; then allowed by name.
    other = out["other"] = root / "other"
    shutil.copytree(out["straight_full"], other)
    (other / "summary.json").unlink()
    procs["refused"] = run_process([{"args": flags(model_dir, other, "--checkpoint.resume",
                                                   str(other / "checkpoints" / "step_1"), "--trainer.lr", "2e-3",
                                                   "--algo.rho", "3"), "env": {}}], root, "pr")
    procs["allowed"] = run_process([{"args": flags(model_dir, other, "--checkpoint.resume",
                                                   str(other / "checkpoints" / "step_1"), "--trainer.lr", "2e-3",
                                                   "--algo.rho", "3", "--checkpoint.allow-changes",
                                                   "trainer.lr,algo"), "env": {}}], root, "pa")
    # The launch scripts' preflight refuses it in one process, before torchrun (exit 2, one line).
    (other / "summary.json").unlink()  # as if the allowed run died after its last checkpoint
    procs["preflight"] = subprocess.run(
        [sys.executable, "-m", "llamarl.runtime.preflight", "--world-size", "1", "--", "-m", "recipes.arithmetic",
         *flags(model_dir, other, "--checkpoint.resume", "latest", "--trainer.lr", "5e-3")],
        cwd=REPO, capture_output=True, text=True, timeout=300, check=False,
        env={**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"})
    nothing = out["nothing"] = root / "nothing"
    (nothing / "checkpoints" / "step_1.partial").mkdir(parents=True)
    procs["nothing"] = run_process([{"args": flags(model_dir, nothing, "--checkpoint.resume", "latest"), "env": {}}],
                                   root, "pn")
    return out, procs


@pytest.mark.parametrize("mode", ["full", "lora"])
@pytest.mark.parametrize("phase", PHASES)
def test_a_kill_at_any_phase_of_a_checkpoint_resumes_exactly(faults, phase, mode):
    out, procs = faults
    target = out[(mode, phase)]
    assert procs[(mode, phase)].returncode != 0  # the kill happened (the chain's last run)
    assert (target / "summary.json").is_file(), "the resume after the kill did not finish"
    assert losses(target) == losses(out[f"straight_{mode}"])
    steps = complete_steps(target / "checkpoints")
    assert steps[-1] == STEPS
    leftovers = [p.name for p in (target / "checkpoints").iterdir() if not p.name.startswith("step_")
                 or p.name.endswith((".partial", ".deleting"))]
    assert leftovers == []  # the next commits pruned what the kill left
    for step in steps:  # every checkpoint left verifies
        path = target / "checkpoints" / f"step_{step}"
        assert verify_checkpoint(path, json.loads((path / COMPLETE_MARKER).read_text()), mode="full")


def test_a_corrupted_checkpoint_falls_back_to_the_one_before_with_a_line(faults):
    out, procs = faults
    text = procs["corrupt"].stdout + procs["corrupt"].stderr
    assert "checkpoint verification failed" in text and "step_3/trainer/state/rank0.safetensors" in text
    assert "falling back to" in text and str(out["corrupt"] / "checkpoints" / "step_2") in text
    assert losses(out["corrupt"]) == losses(out["straight_full"])  # tick 2 trained again, the same
    assert sorted(out["corrupt"].glob("abandoned-*/checkpoints/step_3"))  # kept, moved aside


def test_a_full_disk_is_one_line_naming_the_path_step_and_bytes(faults):
    out, procs = faults
    err = procs["corrupt"].stderr
    lines = [line for line in err.splitlines() if line.startswith("llamarl:")]
    assert len(lines) == 1, err[-3000:]
    assert "no space left on device writing checkpoint step_2 into" in lines[0]
    assert str(out["full_disk"] / "checkpoints" / "step_2.partial" / "generator") in lines[0]
    assert "MiB (the last checkpoint's)" in lines[0] and "MiB free there" in lines[0]
    assert "Traceback" not in err  # it is in the run's logs, named by the line
    traceback_file = out["full_disk"] / "logs" / "rank0.traceback.txt"
    assert f"(traceback: {traceback_file})" in lines[0] and "Traceback" in traceback_file.read_text()
    assert complete_steps(out["full_disk"] / "checkpoints") == [1]


def test_another_runs_settings_are_refused_in_one_line_and_nothing_moves(faults):
    out, procs = faults
    refused = procs["refused"]
    assert refused.returncode == 2
    lines = [line for line in refused.stderr.splitlines() if line.startswith("llamarl:")]
    assert len(lines) == 1 and "Traceback" not in refused.stderr, refused.stderr[-3000:]
    assert "belongs to another run (--checkpoint.allow-changes algo.rho,trainer.lr accepts it" in lines[0]
    assert "algo.rho: 4.0 -> 3.0" in lines[0] and "trainer.lr: 0.001 -> 0.002" in lines[0]
    # The refused resume moved nothing; the allowed one (run after it) archived steps 2 and 3.
    allowed = procs["allowed"]
    assert allowed.returncode == 0, allowed.stderr[-3000:]
    assert ("changes allowed by --checkpoint.allow-changes: algo.rho: 4.0 -> 3.0; trainer.lr: 0.001 -> 0.002"
            in allowed.stdout + allowed.stderr)
    archives = sorted(out["other"].glob("abandoned-*"))
    assert len(archives) == 1 and (archives[0] / "checkpoints" / "step_3").is_dir()
    configs = sorted(p.name for p in out["other"].glob("config*.json"))
    assert configs == ["config.1.json", "config.json"]  # each segment's configuration kept
    assert json.loads((out["other"] / "config.1.json").read_text())["trainer"]["lr"] == 2e-3


def test_the_preflight_refuses_another_runs_checkpoint_before_torchrun(faults):
    _, procs = faults
    proc = procs["preflight"]
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    lines = [line for line in (proc.stdout + proc.stderr).splitlines() if line.startswith("llamarl:")]
    assert len(lines) == 1 and "belongs to another run" in lines[0] and "trainer.lr: 0.002 -> 0.005" in lines[0]
    assert "Traceback" not in proc.stderr


def test_resume_latest_with_nothing_complete_is_one_line(faults):
    _, procs = faults
    proc = procs["nothing"]
    assert proc.returncode == 2
    lines = [line for line in proc.stderr.splitlines() if line.startswith("llamarl:")]
    assert lines == [lines[0]] and "no complete checkpoint under" in lines[0]
    assert "Traceback" not in proc.stderr


# ----- in process: each file kind of a real checkpoint -----

def _corrupt(path: Path, how: str) -> None:
    data = bytearray(path.read_bytes())
    if how == "truncate":
        path.write_bytes(bytes(data[: len(data) // 2]))
    else:  # same size: flip bits in the middle
        middle = len(data) // 2
        data[middle] ^= 0x20
        data[-1] ^= 0x01
        path.write_bytes(bytes(data))


KINDS = ["trainer/state/rank0.safetensors", "trainer/state/rank0.json", "trainer/state/meta.json",
         "trainer/rng_rank0.safetensors", "trainer/state.json", "generator/outputs_rank0.safetensors",
         "generator/rng_rank0.safetensors", "runner_state.json"]


@pytest.mark.parametrize("how", ["truncate", "flip"])
@pytest.mark.parametrize("kind", KINDS)
def test_each_file_kind_corrupted_falls_back_or_stops_with_the_file_named(faults, tmp_path, kind, how):
    out, _ = faults
    run = tmp_path / "run"
    shutil.copytree(out["straight_full"] / "checkpoints", run / "checkpoints")
    newest = run / "checkpoints" / "step_3"
    assert (newest / kind).is_file(), sorted(str(p.relative_to(newest)) for p in newest.rglob("*"))
    _corrupt(newest / kind, how)
    directory, step, notes = choose_checkpoint("latest", run / "checkpoints")
    assert (directory, step) == (run / "checkpoints" / "step_2", 2)
    assert len(notes) == 1 and str(newest / kind) in notes[0] and "falling back to" in notes[0]
    with pytest.raises(ValueError, match=f"does not verify: {newest / kind}"):
        choose_checkpoint(str(newest), run / "checkpoints")
    if how == "truncate":  # sizes alone catch a truncation, not a same-size flip
        assert choose_checkpoint("latest", run / "checkpoints", verify="size")[1] == 2
    assert choose_checkpoint("latest", run / "checkpoints", verify="off")[1] == 3


def test_a_corrupted_marker_and_no_verifiable_checkpoint(faults, tmp_path):
    out, _ = faults
    run = tmp_path / "run"
    shutil.copytree(out["straight_full"] / "checkpoints", run / "checkpoints")
    (run / "checkpoints" / "step_3" / COMPLETE_MARKER).write_text("{not json")
    assert choose_checkpoint("latest", run / "checkpoints")[1] == 2
    for step in (1, 2):
        _corrupt(run / "checkpoints" / f"step_{step}" / "trainer" / "state" / "rank0.safetensors", "flip")
    with pytest.raises(ValueError, match="no checkpoint under .* verifies"):
        choose_checkpoint("latest", run / "checkpoints")


def test_a_marked_checkpoint_whose_files_a_deletion_removed_is_not_resumed(faults, tmp_path):
    """What today's prune left after a kill mid-``rmtree``: the marker, not the state. Verification
    catches it; the new prune never leaves it (renamed aside first, the e2e ``prune`` phase)."""
    out, _ = faults
    run = tmp_path / "run"
    shutil.copytree(out["straight_full"] / "checkpoints", run / "checkpoints")
    shutil.rmtree(run / "checkpoints" / "step_3" / "trainer" / "state")
    _, step, notes = choose_checkpoint("latest", run / "checkpoints")
    assert step == 2 and "missing" in notes[0]
    (run / "checkpoints" / "step_1.deleting").mkdir()  # an interrupted deletion
    assert complete_steps(run / "checkpoints") == [1, 2, 3]
    removed = prune(run / "checkpoints", keep=0, current=4)
    assert [p.name for p in removed] == ["step_1.deleting"]


def test_identity_names_recipe_dataset_and_model_changes(faults, tmp_path):
    from llamarl.runtime.run_identity import check_identity

    out, _ = faults
    marker = json.loads((out["straight_full"] / "checkpoints" / "step_3" / COMPLETE_MARKER).read_text())
    saved = marker["identity"]
    assert {"recipe", "dataset", "model.weights", "trainer.lr", "model.name"} <= set(saved)
    assert not {"run.max_steps", "checkpoint.keep", "generator.num_ranks", "trainer.num_threads"} & set(saved)
    changed = {**saved, "recipe": "gsm8k", "dataset": "0" * 32, "model.weights": "1" * 32}
    with pytest.raises(ValueError, match="dataset: .* model.weights: .* recipe: "):
        check_identity(saved, changed, allow=(), where=tmp_path)
    allowed = check_identity(saved, changed, allow=("recipe", "dataset", "model"), where=tmp_path)
    assert [line.split(":")[0] for line in allowed] == ["dataset", "model.weights", "recipe"]
    assert allowed[2] == 'recipe: "arithmetic" -> "gsm8k"'


def test_disk_full_error_names_what_is_needed(tmp_path):
    previous = {"files": {"trainer/state/rank0.safetensors": {"bytes": 3 << 20}, "generator/x.json": {"bytes": 10}}}
    error = disk_full_error(directory=tmp_path / "step_4.partial" / "trainer", step=4, previous=previous,
                            prefix="trainer/")
    assert "step_4 into" in str(error) and "about 3.0 MiB" in str(error) and "MiB free there" in str(error)


def test_identity_accepts_a_new_field_at_its_default_and_refuses_a_typo(faults, tmp_path):
    from llamarl.runtime.run_identity import check_identity

    out, _ = faults
    saved = json.loads((out["straight_full"] / "checkpoints" / "step_3" / COMPLETE_MARKER).read_text())["identity"]
    older = {k: v for k, v in saved.items() if k != "algo.mismatch"}  # written before the field existed
    assert check_identity(older, saved, allow=(), where=tmp_path, defaults={"algo.mismatch": "none"}) == []
    with pytest.raises(ValueError, match=r"algo.mismatch: <absent> -> \"icepop\""):
        check_identity(older, {**saved, "algo.mismatch": "icepop"}, allow=(), where=tmp_path,
                       defaults={"algo.mismatch": "none"})
    with pytest.raises(ValueError, match="names no field of the run's identity: trainer.lrr"):
        check_identity(saved, saved, allow=("trainer.lrr",), where=tmp_path)
    assert check_identity(saved, saved, allow=("trainer",), where=tmp_path) == []  # a section


def test_a_finished_run_is_finished_even_if_its_last_checkpoint_is_damaged(faults, tmp_path):
    out, _ = faults
    run = tmp_path / "run"
    shutil.copytree(out["straight_full"], run)
    _corrupt(run / "checkpoints" / "step_3" / "trainer" / "state" / "rank0.safetensors", "truncate")
    point, _ = resume_point("latest", run, max_steps=STEPS)
    assert point.finished is not None and point.step == STEPS


def test_a_run_directory_is_locked_by_the_job_using_it(tmp_path):
    from llamarl.run.directory import _lock, release_lock

    _lock(tmp_path)
    with pytest.raises(ValueError, match=f"run directory {tmp_path} is in use by another job \\(pid {os.getpid()}"):
        _lock(tmp_path)
    release_lock(tmp_path)
    _lock(tmp_path)
    release_lock(tmp_path)
