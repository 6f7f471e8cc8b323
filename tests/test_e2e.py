"""End to end: the arithmetic recipe on a tiny random model in a 3-rank gloo world, both schedules.

Every run here uses ``--run.device-guard``, so any tensor made on an implicit device on these paths
(steps, channels, weight syncs, evaluations) fails the test on CPU rather than a user's GPU run."""

import itertools
import json
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file

sys.path.insert(0, str(Path(__file__).parent))
from conftest import read_jsonl
from launch import check, run_torchrun
from scorers_for_tests import first_char_even

MAX_STEPS = 5


# LoRA (rank 4: only the adapters train and sync, merged on the generator) in three of the four.
LORA = ["--trainer.lora.rank", "4", "--trainer.lr", "1e-3"]


@pytest.mark.parametrize(("schedule", "extra"), [
    ("async2", ["--algo.loss", "aipo", "--run.async-lag", "2", *LORA]),
    ("async1", ["--algo.loss", "aipo", "--run.eval-every", "2"]),  # lag 1 is the default
    ("sync", ["--algo.loss", "decoupled_ppo", "--algo.prox", "recompute", "--generator.token-budget", "5", *LORA]),
    # Two optimizer steps per tick; wait mode plans with the pipeline's lag (1 tick x 2 steps + 1 = 3).
    ("async1-minibatches", ["--run.async-lag", "1", "--trainer.num-minibatches", "2", "--algo.loss", "decoupled_ppo",
                            "--algo.prox", "recompute", "--algo.max-staleness", "3", "--algo.stale-policy", "wait",
                            *LORA]),
])
def test_recipe_runs_and_reports(tmp_path, model_dir, schedule, extra):
    out = tmp_path / "run"
    # A reward a random model earns about half the time, so (almost) every tick really trains.
    env = {"LLAMARL_TEST_SCORER": "scorers_for_tests:first_char_even"}
    check(run_torchrun("e2e_arithmetic.py", nproc=3, timeout_s=300, env=env, args=[
        "--model.name", str(model_dir), "--run.max-steps", str(MAX_STEPS), "--run.schedule", schedule.split("-")[0].rstrip("12"),
        "--run.num-eval-problems", "8", "--run.output-dir", str(out), "--generator.num-prompts-per-step", "4",
        "--reward.num-workers", "1", "--run.device-guard", *extra]))
    summary = json.loads((out / "summary.json").read_text())
    for key in ("base_accuracy", "final_accuracy", "num_steps", "wall_seconds", "gen_tokens_per_s_mean",
                "train_tokens_per_s_mean"):
        assert key in summary, key
    assert summary["num_steps"] == MAX_STEPS
    # Each reported accuracy is the mean of the scores of the completions written beside it, and
    # each of those scores is what the run's scorer gives the written completion.
    for stage in ("base", "final"):
        records = read_jsonl(out / f"eval_{stage}.jsonl")
        assert len(records) == 8
        assert all(r["score"] == first_char_even(r["completion"], r["reference"]) for r in records)
        assert summary[f"{stage}_accuracy"] == pytest.approx(sum(r["score"] for r in records) / len(records))
    reward = read_jsonl(out / "metrics" / "reward.jsonl")
    trainer = [r for r in read_jsonl(out / "metrics" / "trainer.jsonl") if "loss" in r]
    assert all("reward_mean" in r and "accuracy" in r for r in reward)
    assert trainer and all("staleness_mean" in r and "clip_fraction" in r for r in trainer)
    if schedule == "sync":
        # A 12-token sample under a 5-token budget needs 3 ticks, so training starts at tick 2
        # (the tiny random model rarely stops early). Sync is on-policy except for the carried
        # tokens: the first batch's tokens are all version 0 = the trainer's version.
        assert [r["step"] for r in trainer] == [2, 3, 4]
        assert trainer[0]["staleness_max"] == 0 and all(r["staleness_max"] <= 2 for r in trainer)
        # No weight moves while the trainer has not stepped: ticks 0-2 skip the sync (the version is
        # the one sent at start-up); from tick 3 every tick follows an update and sends.
        generator = read_jsonl(out / "metrics" / "generator.jsonl")
        assert [r["weight_sync_skipped"] for r in generator] == [1, 1, 1, 0, 0]
        # Under LoRA a sync moves the adapters alone to the one generator rank, in its bf16 (the
        # recipe's default --generator.dtype): r x (in + out) per linear of the decoder layers; a
        # skipped one moves nothing.
        weights = load_file(str(model_dir / "model.safetensors"))
        adapter_bytes = 2 * 4 * sum(sum(t.shape) for n, t in weights.items() if ".layers." in n and t.dim() == 2)
        assert adapter_bytes < 0.2 * 2 * sum(t.numel() for t in weights.values())
        assert [r["weight_sync_bytes"] for r in generator] == [0, 0, 0, adapter_bytes, adapter_bytes]
    if "--trainer.lora.rank" in extra:
        # The export is the PEFT adapter directory, and the checkpoint-free run trained adapters only.
        assert sorted(p.name for p in (out / "hf" / "final").glob("adapter_*")) == ["adapter_config.json",
                                                                                  "adapter_model.safetensors"]
        assert all(".lora_" in k for k in load_file(str(out / "hf" / "final" / "adapter_model.safetensors")))
    elif schedule == "async1-minibatches":
        assert all(r["optimizer_steps"] == 2 and r["num_minibatches"] == 2 for r in trainer)
        assert all(r["staleness_max"] <= 3 and r["dropped_stale_samples"] == 0 for r in trainer)
        assert max(r["staleness_max"] for r in trainer) >= 2  # the second minibatch trains a version later
    elif schedule == "async1":
        # Rollouts are scored within their tick: training starts at tick 1, then every trained
        # token is exactly one version old (tick 1 trains the base model's own samples).
        assert [r["step"] for r in trainer] == [1, 2, 3, 4]
        assert [r["staleness_max"] for r in trainer] == [0, 1, 1, 1]
        assert [r["staleness_mean"] for r in trainer] == [0, 1, 1, 1]
        # Evaluations before, during (every 2 ticks) and after training, with the generator's version.
        evals = summary["evals"]
        assert [e["step"] for e in evals] == [0, 2, 4, 5]
        # The generator's weights after tick t are the trainer's of tick t-1 (trained from tick 1 on):
        # versions 0 after tick 2, 2 after tick 4; the final evaluation follows the last sync (4).
        assert [e["version"] for e in evals] == [0, 0, 2, 4]
        assert evals[0]["accuracy"] == summary["base_accuracy"] and evals[-1]["accuracy"] == summary["final_accuracy"]
        assert all(a["seconds"] < b["seconds"] for a, b in itertools.pairwise(evals))
        assert len(read_jsonl(out / "eval_step_2.jsonl")) == 8
    else:
        assert len(trainer) == MAX_STEPS - 2  # the pipeline is two ticks deep
        # Warm-up, then the steady lag: data of tick t-2 made with version t-4 vs the trainer's t-2.
        assert [r["staleness_max"] for r in trainer] == [0, 1, 2]
        assert [r["staleness_mean"] for r in trainer] == [0, 1, 2]
    trace = json.loads((out / "timeline.json").read_text())
    assert {e["pid"] for e in trace["traceEvents"]} == {"generator", "reward", "trainer"}
    # Per rank, step and channel spans never overlap (one thread does one thing at a time), and
    # each executor both works (steps) and talks (channels); the weight sync is its own kind.
    for rank in {e["tid"] for e in trace["traceEvents"]}:
        events = sorted((e for e in trace["traceEvents"] if e["tid"] == rank), key=lambda e: e["ts"])
        assert all(a["ts"] + a["dur"] <= b["ts"] + 1e-3 for a, b in itertools.pairwise(events)), rank
        assert any(" step " in e["name"] for e in events) and any(" step " not in e["name"] for e in events)
    assert any(e["name"].startswith("trainer weights") for e in trace["traceEvents"])
    assert (out / "timeline.png").stat().st_size > 10_000
