"""recipes/dapo_filter.py: a user's own stage (a DAPO-style filter between reward and trainer) runs
in a one-process colocated run, every stage on the one rank, and gives the same samples and the
same filter decisions as the same pipeline with a rank per stage (sync, at learning rate 0).

What the trainer receives is exactly the filter's input without its zero-signal groups (taps on
both stages), and the filter's metrics count them."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parent / "worlds"))
from launch import check, run_torchrun
from taps import read_taps

from llamarl.rl.arithmetic_task import arithmetic_task
from llamarl.runtime.batch import TensorBatch
from recipes.dapo_filter import DapoFilterConfig, FilterExecutor, dapo_filter_pipeline, zero_signal_groups


def run_world(tmp_path, model_dir, name, *, nproc, args=()):
    out, taps = tmp_path / name, tmp_path / f"{name}_taps"
    check(run_torchrun("stage_recipe_world.py", nproc=nproc, timeout_s=300,
                       env={"LLAMARL_TEST_TAPS": str(taps), "LLAMARL_TEST_ZERO_LR": "1"}, args=[
        "--recipe", "dapo_filter", "--tap", "filter", "--tap", "trainer", "--",
        "--model.name", str(model_dir), "--run.output-dir", str(out), "--run.num-eval-problems", "4",
        "--run.max-steps", "3", "--generator.num-prompts-per-step", "4", "--generator.dtype", "float32",
        "--trainer.param-dtype", "float32", "--reward.num-workers", "0", "--export.no-final",
        "--run.device-guard", *args]))
    return out, read_taps(taps, "filter", "scored"), read_taps(taps, "trainer", "filtered")


def rows(batch: TensorBatch) -> list[tuple]:
    """Each row as (group id, reward, its tokens): comparable across runs and rank splits."""
    return sorted((int(batch["group_ids"][r]), float(batch["rewards"][r]),
                   tuple(batch["input_ids"][r, : int(batch["num_tokens"][r])].tolist())) for r in range(len(batch)))


def test_a_user_stage_runs_colocated_in_one_process_as_on_its_own_ranks(tmp_path, model_dir):
    colocated, filter_in, trainer_in = run_world(tmp_path, model_dir, "colocated", nproc=1,
                                                 args=["--run.schedule", "colocated"])
    sync, sync_filter_in, sync_trainer_in = run_world(tmp_path, model_dir, "sync", nproc=4,
                                                      args=["--run.schedule", "sync"])
    assert sorted(filter_in) == [0, 1, 2]
    kept_total = dropped_total = 0
    for step in range(3):
        received = filter_in[step]
        dropped = zero_signal_groups(received)
        kept = [r for r in rows(received) if r[0] not in dropped]
        # Exactly the groups with signal, rows unchanged (a tick whose groups all dropped sends nothing).
        assert (rows(trainer_in[step]) if step in trainer_in else []) == kept, step
        kept_total += len({r[0] for r in kept})
        dropped_total += len(dropped)
        # The same samples and the same decisions as with a rank per stage.
        assert rows(received) == rows(sync_filter_in[step]), step
        assert (rows(sync_trainer_in[step]) if step in sync_trainer_in else []) == kept, step
    assert kept_total > 0 and dropped_total > 0, (kept_total, dropped_total)  # both branches taken
    for run_dir in (colocated, sync):
        metrics = [json.loads(line) for line in (run_dir / "metrics" / "filter.jsonl").read_text().splitlines()]
        assert sum(m["filter_groups_kept"] for m in metrics) == kept_total, run_dir.name
        assert sum(m["filter_groups_dropped"] for m in metrics) == dropped_total, run_dir.name
    summary = json.loads((colocated / "summary.json").read_text())
    assert summary["schedule"] == "colocated" and "final_accuracy" in summary
    trace = json.loads((colocated / "timeline.json").read_text())
    assert {e["pid"] for e in trace["traceEvents"]} == {"generator", "reward", "filter", "trainer"}


def test_the_filter_drops_exactly_the_groups_without_signal():
    batch = TensorBatch({"group_ids": torch.tensor([0, 0, 1, 1, 2, 2]),
                         "rewards": torch.tensor([1.0, 1.0, 0.0, 1.0, 0.5, 0.5]),
                         "num_tokens": torch.tensor([3, 4, 5, 6, 7, 8])})
    executor = FilterExecutor(ctx=None)
    executor.set_input("scored", batch)
    executor.step()
    out = executor.get_output("filtered")
    assert out["group_ids"].tolist() == [1, 1] and out["balance_tokens"].tolist() == [5, 6]
    assert executor.metrics == {"filter_groups_kept": 1.0, "filter_groups_dropped": 2.0}


def test_colocated_places_every_stage_on_every_rank():
    config = DapoFilterConfig()
    config.run.schedule = "colocated"
    pipeline = dapo_filter_pipeline(config, arithmetic_task(config))
    assert [s.colocate_with for s in pipeline.stages] == [None, "generator", "generator", "generator"]
    assert [s.num_ranks for s in pipeline.specs(2)] == [2, 2, 2, 2]
    assert all(pipeline.in_memory(c) for c in pipeline.channels)
    assert all(c.same_tick for c in pipeline.channels if c.kind != "weights")
