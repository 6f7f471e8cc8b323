"""Dynamic sampling with refill (``--algo.max-refill``) in every schedule, with exact resume, on
three real gloo ranks: colocated (three replicas of every stage), sync and async lag 1 (two
generator replicas, the trainer and the reward on the third rank) and async lag 2 with partial
rollouts in flight. All eight runs share one torchrun world (``tests/worlds/schedule_runs.py``).

Per schedule: a 4-tick run checkpointing at ticks 2 and 4, then the same run resumed from its
step-2 checkpoint in its own directory (the abandoned ticks are archived, llamarl/run/directory.py).
The resumed ticks must equal the uninterrupted ones: data position, kept / dropped groups and
refill rounds, reward mean, loss. And dynamic sampling must have worked end to end: some groups
dropped and refilled, every tick's batch full unless all its rounds ran, and the trainer never
received a sample with zero advantage (with 2 samples per prompt about half the groups tie)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from launch import check, run_torchrun

STEPS, RESUME_AT, PROMPTS, MAX_REFILL = 4, 2, 2, 3
# schedule name -> (flags, generator replicas)
SCHEDULES = {
    "colocated": (["--run.schedule", "colocated"], 3),
    "sync": (["--run.schedule", "sync", "--generator.num-ranks", "2"], 2),
    "async1": (["--run.schedule", "async", "--run.async-lag", "1", "--generator.num-ranks", "2"], 2),
    "async2": (["--run.schedule", "async", "--run.async-lag", "2", "--generator.num-ranks", "2",
                "--generator.token-budget", "5"], 2),
}
KEYS = {"generator": ("gen_data_position", "dynamic_sampling_kept", "dynamic_sampling_dropped",
                      "dynamic_sampling_refill_rounds"),
        "reward": ("reward_mean",), "trainer": ("loss",)}


def args(model_dir: Path, out: Path, schedule: str) -> list[str]:
    return ["--model.name", str(model_dir), "--run.max-steps", str(STEPS), "--run.num-eval-problems", "2",
            "--run.output-dir", str(out), "--generator.num-prompts-per-step", str(PROMPTS),
            "--generator.samples-per-prompt", "2", "--algo.max-refill", str(MAX_REFILL), "--reward.num-workers", "0",
            "--checkpoint.every", str(RESUME_AT), "--checkpoint.keep", "0", "--export.no-final",
            "--trainer.lr", "1e-3", "--generator.dtype", "float32", *SCHEDULES[schedule][0]]


def records(path: Path) -> dict[int, dict]:
    return {r["step"]: r for r in map(json.loads, path.read_text().splitlines())}


@pytest.fixture(scope="module")
def runs(tmp_path_factory, model_dir):
    tmp = tmp_path_factory.mktemp("dynamic")
    plan = []
    for schedule in SCHEDULES:
        out = tmp / schedule
        plan += [args(model_dir, out, schedule),
                 [*args(model_dir, out, schedule), "--checkpoint.resume", str(out / "checkpoints" / f"step_{RESUME_AT}")]]
    (tmp / "plan.json").write_text(json.dumps(plan))
    check(run_torchrun("schedule_runs.py", nproc=3, timeout_s=900,
                       env={"LLAMARL_TEST_SCORER": "scorers_for_tests:first_char_even"},
                       args=["--plan", str(tmp / "plan.json")]))
    return tmp


@pytest.mark.parametrize("schedule", list(SCHEDULES))
def test_refill_in_every_schedule_resumes_exactly(runs, schedule):
    out = runs / schedule
    archives = sorted(out.glob("abandoned-*"))
    assert len(archives) == 1, sorted(p.name for p in out.iterdir())
    replicas = SCHEDULES[schedule][1]
    for executor, keys in KEYS.items():
        resumed, abandoned = records(out / "metrics" / f"{executor}.jsonl"), \
            records(archives[0] / "metrics" / f"{executor}.jsonl")
        # The same ticks logged (lag 2's reward and trainer have nothing to report at first).
        assert sorted(s for s in resumed if s >= RESUME_AT) == sorted(abandoned), executor
        assert abandoned or executor != "generator"
        for step in abandoned:
            for key in keys:
                if key in abandoned[step] or key in resumed[step]:
                    assert resumed[step][key] == pytest.approx(abandoned[step][key], rel=1e-6, abs=1e-9), \
                        (executor, step, key)
    generator = {**records(out / "metrics" / "generator.jsonl"), **records(archives[0] / "metrics" / "generator.jsonl")}
    for step, record in generator.items():
        if record["dynamic_sampling_refill_rounds"] < MAX_REFILL:  # full: each replica kept its prompts' worth
            assert record["dynamic_sampling_kept"] >= PROMPTS * replicas, (step, record)
    assert sum(r["dynamic_sampling_dropped"] for r in generator.values()) > 0
    assert sum(r["dynamic_sampling_refill_rounds"] for r in generator.values()) > 0
    # Every prompt consumed is counted once, kept or dropped (under partial rollouts some are in flight).
    consumed = max(r["gen_data_position"] for r in generator.values())
    counted = sum(r["dynamic_sampling_kept"] + r["dynamic_sampling_dropped"] for r in generator.values())
    assert counted == consumed if schedule != "async2" else counted <= consumed
    trainer = records(out / "metrics" / "trainer.jsonl")
    trained = [r for r in trainer.values() if "loss" in r]
    assert trained and all(r["zero_advantage_samples"] == 0 for r in trained), trainer
