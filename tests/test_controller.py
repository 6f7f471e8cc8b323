"""The controller over several ticks in real 4-rank gloo worlds: async lag, sync order, failures."""

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from launch import check, run_torchrun

from llamarl.run.controller import ExecutorController

MAX_STEPS = 5


SCHEDULES = ("async", "async1", "sync")


@pytest.fixture(scope="module")
def schedules(tmp_path_factory):
    """Every schedule, one after the other in ONE 4-rank world (a controller and fresh executors each):
    ``{schedule: {rank: what its executor saw per tick}}``."""
    out = tmp_path_factory.mktemp("schedules")
    check(run_torchrun("controller_world.py", nproc=4,
                       args=["--out", str(out), "--schedule", *SCHEDULES, "--max-steps", str(MAX_STEPS)]))
    return {s: {r: json.loads((out / s / f"rank{r}.json").read_text()) for r in range(4)} for s in SCHEDULES}


def train_seen(seen):
    """Per tick: the union of generator ticks both trainer ranks saw, and their row counts."""
    return [(sorted(set(a["gen_steps"]) | set(b["gen_steps"])), a["rows"] + b["rows"],
             sorted(set(a["versions"]) | set(b["versions"])))
            for a, b in zip(seen[2], seen[3])]


def test_async_schedule_lags_by_the_pipeline_depth(schedules):
    seen = schedules["async"]
    # The generator uses the weights the trainer produced one tick earlier (version = tick).
    assert [s["version"] for s in seen[0]] == [0, 1, 2, 3, 4]
    # Reward scores the rollouts of the previous tick.
    assert [s["gen_steps"] for s in seen[1]] == [[], [0], [1], [2], [3]]
    # The trainer trains on rollouts generated two ticks earlier, split over its two ranks.
    assert train_seen(seen) == [([], 0, []), ([], 0, []), ([0], 4, [0]), ([1], 4, [1]), ([2], 4, [2])]
    assert all(s["rows"] == 2 for s in seen[2][2:]), "SCATTER should give each trainer rank one group"


def test_sync_schedule_is_strictly_on_policy(schedules):
    seen = schedules["sync"]
    assert [s["version"] for s in seen[0]] == [0, 1, 2, 3, 4]
    assert [s["gen_steps"] for s in seen[1]] == [[0], [1], [2], [3], [4]]
    # Tick t trains on tick t's rollouts, generated with version t = the trainer's own version.
    assert train_seen(seen) == [([t], 4, [t]) for t in range(MAX_STEPS)]


def test_a_rank_that_raises_takes_the_world_down_with_a_named_message(tmp_path):
    # No duration is asserted (time is noisy under load); a world that hangs instead of going down
    # hits the subprocess timeout and fails the test.
    proc = run_torchrun("controller_world.py", nproc=4, timeout_s=120, args=[
        "--out", str(tmp_path), "--schedule", "async", "--max-steps", "8", "--fail-rank", "3", "--fail-step", "3"])
    assert proc.returncode != 0
    assert "executor 'train' (rank 3, local rank 1) failed at step 3 during step: RuntimeError: boom" in proc.stderr
    assert not list(tmp_path.glob("rank*.json")), "no rank should have finished normally"


def test_async_lag_one_scores_within_the_tick_and_trains_one_version_behind(schedules):
    seen = schedules["async1"]
    assert [s["version"] for s in seen[0]] == [0, 1, 2, 3, 4]
    # Rollouts are scored within the tick they were generated ...
    assert [s["gen_steps"] for s in seen[1]] == [[0], [1], [2], [3], [4]]
    # ... and trained on at the next tick: data made with version t-1 while the trainer makes t+1
    # from version t, i.e. exactly one version old; training starts at tick 1.
    assert train_seen(seen) == [([], 0, []), ([0], 4, [0]), ([1], 4, [1]), ([2], 4, [2]), ([3], 4, [3])]


def test_a_same_tick_channel_against_the_data_order_is_a_value_error():
    from types import SimpleNamespace

    from llamarl.channels.base import CommunicationChannel

    back = CommunicationChannel("back", "b", "a", same_tick=True)
    with pytest.raises(ValueError, match=r"same-tick channels \['back'\] must go forward"):
        ExecutorController(SimpleNamespace(ranks={"a": [0], "b": [1]}), None, [back], max_steps=1,
                           executor_order=["a", "b"])
