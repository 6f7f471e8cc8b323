"""A run that learns nothing says so (llamarl/executors/no_signal.py): a warning after 3 ticks
without signal, and ``--run.stop-on-no-signal K`` ends it with one line and exit code 3."""

import logging
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from launch import run_colocated_runs

from llamarl.executors.no_signal import NoSignal, SignalWatch


def test_the_watch_warns_once_after_three_ticks_and_stops_at_k(caplog):
    watch = SignalWatch(stop_after=5)
    with caplog.at_level(logging.WARNING, logger="llamarl.trainer"):
        watch.observe(had_batch=False, signal=False, reward_mean=0.0, ended_fraction=0.0, version=0)  # async lag
        for _ in range(4):
            watch.observe(had_batch=True, signal=False, reward_mean=0.0, ended_fraction=0.25, version=0)
    warnings = [r for r in caplog.records if "no learning signal for 3 ticks" in r.getMessage()]
    assert len(warnings) == 1 and "25% ended before the token limit" in warnings[0].getMessage()
    watch.observe(had_batch=True, signal=True, reward_mean=0.5, ended_fraction=1.0, version=1)
    assert watch.streak == 0
    for _ in range(4):
        watch.observe(had_batch=True, signal=False, reward_mean=0.0, ended_fraction=0.0, version=1)
    with pytest.raises(NoSignal, match=r"no learning signal for 5 ticks in a row") as caught:
        watch.observe(had_batch=True, signal=False, reward_mean=0.0, ended_fraction=0.0, version=1)
    assert caught.value.exit_code == 3
    restored = SignalWatch(stop_after=None)
    restored.load(watch.state())
    assert restored.streak == 5


def test_a_run_whose_scorer_never_matches_warns_then_stops_with_exit_code_3(model_dir, tmp_path):
    out = tmp_path / "run"
    args = ["--model.name", str(model_dir), "--run.schedule", "colocated", "--run.max-steps", "8",
            "--run.num-eval-problems", "2", "--run.output-dir", str(out), "--generator.num-prompts-per-step", "2",
            "--reward.num-workers", "0", "--generator.max-new-tokens", "4", "--trainer.num-threads", "1",
            "--export.no-final", "--run.stop-on-no-signal", "4"]
    proc = run_colocated_runs([args], plan_file=tmp_path / "plan.json",
                              env={"LLAMARL_TEST_SCORER": "scorers_for_tests:always_zero"})
    assert proc.returncode == 3, proc.stderr[-3000:]
    assert "no learning signal for 3 ticks in a row" in proc.stdout + proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.startswith("llamarl:")]
    assert len(lines) == 1 and "no learning signal for 4 ticks in a row (--run.stop-on-no-signal 4)" in lines[0]
    assert "failed at step 3" in lines[0]  # ticks 0-3: the fourth tick without signal
