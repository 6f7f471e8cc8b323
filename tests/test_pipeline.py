"""Pipelines as data: validation of the description, and a four-stage toy pipeline with a
user-written executor run through ``run_pipeline`` in a real 5-rank gloo world."""

from __future__ import annotations

import json

import pytest
from launch import check, run_torchrun

from llamarl.run.stages import ChannelSpec, Pipeline, Stage


def _stage(name, num_ranks=1):
    return Stage(name, build=lambda ctx: None, num_ranks=num_ranks)


def test_specs_give_the_rest_to_the_open_stage():
    pipeline = Pipeline([_stage("a", 2), _stage("b", None), _stage("c", 1)], [])
    assert [(s.name, s.num_ranks) for s in pipeline.specs(7)] == [("a", 2), ("b", 4), ("c", 1)]
    with pytest.raises(ValueError, match=r"^stage 'a' 2 \+ stage 'c' 1 \+ at least 1 b rank = 4 > the world size 3"):
        pipeline.specs(3)


@pytest.mark.parametrize("stages, channels, message", [
    ([], [], "at least one stage"),
    (["a", "a"], [], "unique"),
    (["a", "b"], [ChannelSpec("x", "a", "z", "scatter")], "names executor 'z', which is not one of"),
    (["a", "b"], [ChannelSpec("x", "b", "a", "scatter", same_tick=True)], "must go forward"),
    (["a", "b"], [ChannelSpec("x", "a", "b", "scatter"), ChannelSpec("x", "b", "a", "weights")], "channel names"),
])
def test_bad_pipelines_are_refused(stages, channels, message):
    with pytest.raises(ValueError, match=message):
        Pipeline([_stage(s) for s in stages], channels)


def test_bad_stage_and_channel_fields_are_refused():
    with pytest.raises(ValueError, match="num_ranks must be >= 1"):
        _stage("a", 0)
    with pytest.raises(ValueError, match="kind must be one of"):
        ChannelSpec("x", "a", "b", "multicast")
    with pytest.raises(ValueError, match="channel 'x' goes from 'a' to itself"):
        Pipeline([_stage("a", 1)], [ChannelSpec("x", "a", "a", "broadcast")])
    with pytest.raises(ValueError, match="two stages take the remaining|at most one stage"):
        Pipeline([_stage("a", None), _stage("b", None)], [])
    with pytest.raises(ValueError, match="evaluator 'z'"):
        Pipeline([_stage("a")], [], evaluator="z")


def test_four_stage_toy_pipeline_runs_through_the_library_entry_point(tmp_path):
    run_dir = tmp_path / "run"
    proc = run_torchrun("pipeline_world.py", nproc=5, args=["--run-dir", str(run_dir)], timeout_s=240)
    check(proc)
    # source emits 10t + [0, 1, 2, 3] at tick t; double doubles it in the same tick; sink (2 ranks)
    # receives it one tick later, split by SCATTER into whole groups (value // 2 before doubling).
    seen = [json.loads((run_dir / f"sink_rank{r}.json").read_text()) for r in (3, 4)]
    assert [sorted(a + b) for a, b in zip(*seen)] == [[], [0, 2, 4, 6], [20, 22, 24, 26]]
    assert all(len(part) in (0, 2) for rank in seen for part in rank)
    # The fourth executor's metrics are logged like any other's.
    audit = [json.loads(line) for line in (run_dir / "metrics" / "audit.jsonl").read_text().splitlines()]
    assert [r["audited_total"] for r in audit] == [12, 12 + 92, 12 + 92 + 172]
    # Sink's declared reductions over its two ranks: rows summed, the rank maxed, the mean weighted
    # by each rank's rows (an empty rank does not count).
    sink = [json.loads(line) for line in (run_dir / "metrics" / "sink.jsonl").read_text().splitlines()]
    assert [r["received"] for r in sink] == [0, 4, 4] and [r["sink_rank"] for r in sink] == [4, 4, 4]
    assert "value_mean" not in sink[0] and [r["value_mean"] for r in sink[1:]] == [3.0, 23.0]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["pipeline"] == "toy" and summary["base_accuracy"] == summary["final_accuracy"] == 0.5
    # Rank 0's one progress line per tick carries every stage's headline numbers.
    # Tick 2 is the files' "step": 2, after which 3 of 3 ticks are done.
    assert [r["step"] for r in audit] == [0, 1, 2]
    lines = [line for line in proc.stdout.splitlines() if "tick 2 (3/3 done, " in line and " s/tick, ~0 s left)" in line]
    assert lines and "source/emitted=4" in lines[0] and "audit/audited_total=276" in lines[0] \
        and "sink/received=4" in lines[0], proc.stdout[-2000:]
    assert (run_dir / "timeline.png").is_file()


def test_roles_are_checked_with_the_stage_named():
    """A weights channel's ends and the evaluator must play their roles (llamarl/runtime/executor.py)."""
    from types import SimpleNamespace

    from llamarl.channels.in_memory import InMemoryWeights
    from llamarl.runtime.executor import Executor, check_roles

    class Source(Executor):
        version = 0

        def get_model(self):
            return None

    class Sink(Executor):
        def set_weights_version(self, version):
            self.version = version

    ctx = SimpleNamespace()
    weights = [InMemoryWeights("weights", "trainer", "generator")]
    check_roles({"trainer": Source(ctx), "generator": Sink(ctx)}, weight_channels=weights, evaluator=None)
    with pytest.raises(TypeError, match=r"stage 'generator' \(Executor\) is the sink of weights channel 'weights'"):
        check_roles({"trainer": Source(ctx), "generator": Executor(ctx)}, weight_channels=weights, evaluator=None)
    with pytest.raises(TypeError, match="stage 'generator' .* is the pipeline's evaluator but lacks the Evaluator role"):
        check_roles({"generator": Sink(ctx)}, weight_channels=[], evaluator="generator")
