"""Rollouts you can read (issue 38 item 4): the turns of an episode, training samples in
``samples.jsonl`` (``--run.log-samples``), evaluation files with the same split, tool errors in the
progress line, and no accuracy for a run without evaluation."""

from __future__ import annotations

import json

import torch
from conftest import read_jsonl
from launch import check, run_colocated_runs

from llamarl.runtime.batch import TensorBatch
from llamarl.runtime.progress import progress_text
from llamarl.runtime.sample_log import sample_rows, turns_of

ENV = {"LLAMARL_TEST_SCORER": "scorers_for_tests:first_char_even"}


def test_turns_split_policy_text_from_observations():
    segments = [{"text": "2+2=", "trained": True}, {"text": " 4", "trained": False},
                {"text": " so 4", "trained": True}]
    assert turns_of(segments) == [{"policy": "2+2=", "observation": " 4"}, {"policy": " so 4", "observation": None}]
    assert turns_of([{"text": "x", "trained": False}]) == [{"policy": "", "observation": "x"}]
    assert turns_of([]) == []


def test_sample_rows_of_a_scored_batch():
    segments = [{"text": "a1", "trained": True}, {"text": " ok", "trained": False}, {"text": "b", "trained": True}]
    batch = TensorBatch({
        "input_ids": torch.tensor([[5, 6, 7, 8, 9], [5, 6, 7, 8, 0]]),
        "prompt_len": torch.tensor([2, 2]), "group_ids": torch.tensor([3, 3]),
        "loss_mask": torch.tensor([[0, 0, 1, 0, 1], [0, 0, 1, 1, 0]], dtype=torch.uint8),
        "versions": torch.tensor([[-1, -1, 4, -1, 5], [-1, -1, 5, 5, -1]]),
        "rewards": torch.tensor([1.0, 0.0])})
    trajectory = {"segments": segments, "finish_reason": "stop", "num_turns": 1, "env_reward": None, "env_state": {}}
    batch.set_strings("trajectory", [json.dumps(trajectory)] * 2)
    batch.set_strings("question", ["q0", "q1"])

    class Tokenizer:
        def decode(self, ids):
            return " ".join(map(str, ids))

    rows = sample_rows(batch, limit=1, step=7, tokenizer=Tokenizer())
    assert rows == [{"step": 7, "group": 3, "reward": 1.0, "weights_version": 5, "oldest_weights_version": 4,
                     "question": "q0", "prompt": "5 6", "turns": [{"policy": "a1", "observation": " ok"},
                                                                 {"policy": "b", "observation": None}],
                     "finish_reason": "stop", "num_turns": 1, "env_reward": None}]
    assert len(sample_rows(batch, limit=5, step=0)) == 2 and sample_rows(batch, limit=0, step=0) == []


def test_progress_text_shows_tool_failures_of_the_tick():
    shown = {"generator/gen_tokens_per_s": 10.0, "generator/env_tool_errors": 30.0,
             "generator/env_tool_timeouts": 2.0, "generator/env_tool_calls": 32.0, "generator/env_turns_mean": 2.0,
             "reward/reward_mean": 0.0}
    assert progress_text(shown) == ("generator/gen_tokens_per_s=10 generator/tool_err=32/32 generator/turns=2 "
                                    "reward/reward_mean=0")


def test_broken_tools_samples_and_no_evaluation(tmp_path, model_dir):
    """Two one-process colocated runs: (a) an environment whose tool always raises, with
    ``--run.log-samples 3``: the progress line shows every call failed, the env counters are per tick
    with cumulative ``_total``s, samples.jsonl holds 3 samples a tick split into turns, the
    evaluation files the same split; (b) ``--run.num-eval-problems 0``: no accuracy anywhere."""
    broken, no_eval = tmp_path / "broken", tmp_path / "no_eval"
    common = ["--model.name", str(model_dir), "--run.schedule", "colocated", "--run.max-steps", "2",
              "--generator.num-prompts-per-step", "2", "--generator.max-new-tokens", "16",
              "--reward.num-workers", "0", "--run.device-guard"]
    proc = run_colocated_runs([
        [*common, "--run.output-dir", str(broken), "--run.num-eval-problems", "2", "--run.log-samples", "3",
         "--env.name", "envs_for_tests:BrokenToolEnv", "--env.num-tool-workers", "0", "--env.max-turns", "2",
         "--generator.max-new-tokens", "64"],
        [*common, "--run.output-dir", str(no_eval), "--run.num-eval-problems", "0"],
    ], plan_file=tmp_path / "plan.json", env=ENV)
    check(proc)
    output = proc.stdout + proc.stderr

    generator = read_jsonl(broken / "metrics" / "generator.jsonl")
    calls = [r["env_tool_calls"] for r in generator]
    assert sum(calls) > 0 and [r["env_tool_errors"] for r in generator] == calls, generator
    assert [r["env_tool_calls_total"] for r in generator] == [sum(calls[: i + 1]) for i in range(len(calls))]
    assert [r["env_tool_errors_total"] for r in generator] == [r["env_tool_calls_total"] for r in generator]
    ticked = [line for line in output.splitlines() if "tick 1 (2/2 done" in line and "tool_err=" in line]
    assert ticked and f"generator/tool_err={calls[1]:.4g}/{calls[1]:.4g}" in ticked[0], output[-3000:]
    assert output.count("every tool call failed") == 1, output[-3000:]
    # Each evaluation draws its tqdm bar (rank 0, stderr), finished: the base and the final policy's.
    bars = [part for part in proc.stderr.replace("\r", "\n").splitlines() if part.startswith("eval of weights")]
    assert any(b.startswith("eval of weights version 0: 100%") and "2/2 [" in b for b in bars), proc.stderr[-3000:]

    samples = read_jsonl(broken / "samples.jsonl")
    assert [s["step"] for s in samples] == [0, 0, 0, 1, 1, 1], samples
    for s in samples:
        assert s["question"] and s["question"] in s["prompt"], s
        assert s["reward"] in (0.0, 1.0) and s["weights_version"] == s["step"]  # colocated: on-policy
        assert s["turns"] and all(set(t) == {"policy", "observation"} for t in s["turns"])
        observed = [t["observation"] for t in s["turns"] if t["observation"] is not None]
        assert all("[tool error: RuntimeError: the tool is broken]" in o for o in observed), s
        assert len(observed) <= s["num_turns"]  # an observation past the token budget is cut off
    assert any(t["observation"] for s in samples for t in s["turns"]), "no episode called the broken tool"
    for name in ("eval_base.jsonl", "eval_final.jsonl"):
        episodes = read_jsonl(broken / name)
        assert len(episodes) == 2 and all(e["turns"] for e in episodes)
        for e in episodes:
            assert all(o in e["completion"] for o in (t["observation"] for t in e["turns"]) if o), e

    summary = json.loads((no_eval / "summary.json").read_text())
    assert not {"base_accuracy", "final_accuracy", "evals"} & set(summary), summary
    assert summary["num_steps"] == 2
    assert not list(no_eval.glob("eval_*.jsonl"))
    assert not (no_eval / "samples.jsonl").exists()  # --run.log-samples 0
    no_eval_lines = output.split(str(no_eval))[-1] if str(no_eval) in output else output
    assert "greedy accuracy" not in no_eval_lines and "final accuracy" not in no_eval_lines, output[-3000:]
