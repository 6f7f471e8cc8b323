"""What a resume does to its run directory and summary (llamarl/run/directory.py,
llamarl/run/checkpoints.py): resuming from an older checkpoint archives the abandoned run's later
state; the summary describes the whole run; resuming a finished run does nothing.

One-process colocated runs of the tiny untied model (fast, and deterministic: a resumed run's
evaluations equal an uninterrupted run's). One 3-tick run checkpointing and evaluating after every
tick is made once; each test resumes a copy of it."""

import json
import shutil
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from launch import check, run_torchrun

from llamarl.runtime.checkpoint import COMPLETE_MARKER
from llamarl.runtime.checkpoint_files import replace_committed_file

STEPS = 3


def run(model_dir, out, *extra, expect_ok=True):
    proc = run_torchrun("e2e_arithmetic.py", nproc=1, timeout_s=300,
                        env={"LLAMARL_TEST_SCORER": "scorers_for_tests:first_char_even"}, args=[
        "--model.name", str(model_dir), "--run.schedule", "colocated", "--run.max-steps", str(STEPS),
        "--run.num-eval-problems", "4", "--run.output-dir", str(out), "--generator.num-prompts-per-step", "2",
        "--reward.num-workers", "0", "--generator.token-budget", "5", "--trainer.lr", "1e-3",
        "--checkpoint.every", "1", "--checkpoint.keep", "0", "--run.eval-every", "1", "--export.every", "1",
        "--run.device-guard", "--trainer.num-threads", "1",  # one thread, as every test process
        # A schedule the resume must continue (1e-3 x 0.5, 1, 1 at versions 0, 1, 2; a restart would
        # warm up again): test_a_resumed_run_continues_the_lr_schedule.
        "--trainer.lr-schedule", "linear", "--trainer.warmup-steps", "2", "--trainer.lr-decay-steps", "4", *extra])
    if expect_ok:
        check(proc)
    return proc


def summary(out):
    return json.loads((out / "summary.json").read_text())


def ticks(path):
    return [json.loads(line)["step"] for line in path.read_text().splitlines()]


@pytest.fixture(scope="module")
def finished(tmp_path_factory, model_dir):
    """A finished 3-tick run: checkpoints, exports and evaluations after every tick."""
    out = tmp_path_factory.mktemp("resume") / "finished"
    run(model_dir, out)
    return out


@pytest.fixture(scope="module")
def resumed_at_one(tmp_path_factory, model_dir, finished):
    """A copy of ``finished`` resumed into its own directory from its step-1 checkpoint."""
    out = tmp_path_factory.mktemp("resume") / "resumed"
    shutil.copytree(finished, out)
    proc = run(model_dir, out, "--checkpoint.resume", str(out / "checkpoints" / "step_1"))
    return out, proc


def test_resume_from_an_older_checkpoint_archives_the_abandoned_timeline(finished, resumed_at_one):
    out, proc = resumed_at_one
    archives = sorted(out.glob("abandoned-*"))
    assert len(archives) == 1
    archive = archives[0]
    lines = [line for line in proc.stdout.splitlines() if "moved what an abandoned run left" in line]
    assert len(lines) == 1, proc.stdout[-3000:]
    assert "resuming at step 1: " in lines[0] and str(archive) in lines[0]
    # The abandoned run's checkpoints, exports and evaluations after step 1 and its end are archived...
    assert sorted(p.name for p in (archive / "checkpoints").iterdir()) == ["step_2", "step_3"]
    assert sorted(p.name for p in (archive / "hf").iterdir()) == ["final", "step_2", "step_3"]
    archived = {p.name for p in archive.glob("*.json*")}
    assert {"eval_step_2.jsonl", "eval_final.jsonl", "summary.json"} <= archived
    assert json.loads((archive / "summary.json").read_text()) == summary(finished)
    # ... with its metric records of ticks 1 and 2, which the resumed run ran again.
    assert ticks(archive / "metrics" / "generator.jsonl") == [1, 2]
    # The run directory holds one timeline: each tick once, and the latest checkpoint is the resumed run's.
    assert ticks(out / "metrics" / "generator.jsonl") == [0, 1, 2]
    latest = json.loads((out / "checkpoints" / "step_3" / "runner_state.json").read_text())
    assert latest["resumed_from_step"] == [1]
    assert sorted(p.name for p in (out / "hf").iterdir()) == ["final", "step_1", "step_2", "step_3"]


def test_a_resumed_run_continues_the_lr_schedule(finished, resumed_at_one):
    """The learning rate is a pure function of the trainer's version, which the checkpoint holds:
    the resumed ticks run at the uninterrupted run's rates (warm-up 2, linear decay to 0 at 4)."""
    def rates(out):
        records = [json.loads(line) for line in (out / "metrics" / "trainer.jsonl").read_text().splitlines()]
        return {r["step"]: (r["version"], r["lr"]) for r in records if "lr" in r}

    straight, got = rates(finished), rates(resumed_at_one[0])
    hand = {1: 0.5e-3, 2: 1e-3, 3: 1e-3}  # by the version after the step: warm-up (1/2, 2/2), then p = 0
    assert straight and all(lr == pytest.approx(hand[v]) for v, lr in straight.values()), straight
    assert got == straight


def test_summary_after_a_resume_describes_the_whole_run(finished, resumed_at_one):
    out, _ = resumed_at_one
    straight, got = summary(finished), summary(out)
    assert straight["resumed_from_step"] == [] and got["resumed_from_step"] == [1]
    # Every evaluation, those before the checkpoint included, equal to the uninterrupted run's.
    assert [e["step"] for e in got["evals"]] == [0, 1, 2, 3]

    def made(evals):
        return [(e["step"], e["accuracy"], e["version"]) for e in evals]

    assert made(got["evals"]) == made(straight["evals"])
    # Evaluations up to step 1 are the first run's own records; time runs on across the resume.
    assert got["evals"][:2] == straight["evals"][:2]
    seconds = [e["seconds"] for e in got["evals"]]
    assert seconds == sorted(seconds)
    state = json.loads((finished / "checkpoints" / "step_1" / "runner_state.json").read_text())
    assert got["wall_seconds"] > state["elapsed_seconds"] and got["wall_seconds"] > seconds[-1]
    assert got["base_accuracy"] == straight["base_accuracy"]


def test_an_evaluation_the_interrupted_run_did_not_record_is_made_on_resume(tmp_path, model_dir,
                                                                             resumed_at_one):
    """A second resume (step 2 of the resumed run) whose checkpoint lost its step-2 evaluation (as if
    the run died during it): the resumed run makes it, and the summary lists both resumes."""
    out = tmp_path / "twice"
    shutil.copytree(resumed_at_one[0], out)
    state_path = out / "checkpoints" / "step_2" / "runner_state.json"
    state = json.loads(state_path.read_text())
    state["evals"] = [e for e in state["evals"] if e["step"] < 2]
    # As the commit wrote it, before the step's evaluation: the marker lists its digest.
    replace_committed_file(state_path.parent, state_path.name, state, marker_name=COMPLETE_MARKER)
    run(model_dir, out, "--checkpoint.resume", str(out / "checkpoints" / "step_2"))
    got, before = summary(out), summary(resumed_at_one[0])
    assert got["resumed_from_step"] == [1, 2]
    assert [(e["step"], e["accuracy"], e["version"]) for e in got["evals"]] == \
        [(e["step"], e["accuracy"], e["version"]) for e in before["evals"]]
    assert got["evals"][2]["seconds"] > state["elapsed_seconds"]  # made by the second resume
    assert len(sorted(out.glob("abandoned-*"))) == 2


def test_resuming_a_finished_run_does_nothing(tmp_path, model_dir, finished):
    out = tmp_path / "again"
    shutil.copytree(finished, out)
    before = {p: p.stat().st_mtime_ns for p in out.rglob("*") if p.is_file()}
    proc = run(model_dir, out, "--checkpoint.resume", "latest")
    assert f"run already finished at step {STEPS} ({out / 'summary.json'}); nothing to do" in proc.stdout
    # No evaluation, export, checkpoint or summary is made again: not a file changed or added (but
    # the run directory's lock, which every job takes: llamarl/run/directory.py).
    after = {p: p.stat().st_mtime_ns for p in out.rglob("*") if p.is_file() and p.name != ".lock"}
    assert after == {p: t for p, t in before.items() if p.name != ".lock"}


def test_only_the_newest_checkpoint_of_an_ended_run_with_its_step_count_is_finished(tmp_path):
    """Without a checkpoint at the last step (every 3 of 10 ticks), ``latest`` of an ended run is
    finished too; an older checkpoint, another run's, or more steps than the summary's train on."""
    from llamarl.runtime.checkpoint import commit_step, partial_dir
    from llamarl.runtime.checkpoint import finished_summary as _finished_summary

    run_dir = tmp_path / "run"
    for step in (6, 9):
        partial_dir(run_dir / "checkpoints", step).mkdir(parents=True)
        commit_step(run_dir / "checkpoints", step, {})
    latest, older = run_dir / "checkpoints" / "step_9", run_dir / "checkpoints" / "step_6"
    assert _finished_summary(run_dir, latest, 9, 10) is None  # no summary: the run did not end
    (run_dir / "summary.json").write_text(json.dumps({"num_steps": 10}))
    assert _finished_summary(run_dir, latest, 9, 10) == {"num_steps": 10}
    assert _finished_summary(run_dir, older, 6, 10) is None
    assert _finished_summary(run_dir, latest, 9, 12) is None
    assert _finished_summary(tmp_path / "elsewhere", latest, 9, 10) is None
