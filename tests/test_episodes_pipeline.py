"""Episodes through the whole pipeline on the tiny model: a colocated one-process run and an async
three-rank run call the tools and train, and a run checkpointed mid-episode (partial rollouts carry
episodes between ticks) resumes to the same final policy, bitwise."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import read_jsonl
from launch import check, run_torchrun
from safetensors.torch import load_file

ENV = {"LLAMARL_TEST_SCORER": "scorers_for_tests:first_char_even"}


def flags(model_dir, out, *extra):
    return ["--model.name", str(model_dir), "--run.num-eval-problems", "2", "--run.output-dir", str(out),
            "--generator.num-prompts-per-step", "2", "--generator.max-new-tokens", "24", "--reward.num-workers", "0",
            "--trainer.lr", "1e-3", "--env.name", "envs_for_tests:DigitsEnv", "--env.num-tool-workers", "1",
            "--run.device-guard", *extra]


@pytest.mark.parametrize(("nproc", "schedule"), [
    (1, ["--run.schedule", "colocated", "--trainer.lora.rank", "4"]),  # LoRA: adapters synced and merged
    (3, ["--run.schedule", "async", "--run.async-lag", "2", "--trainer.lora.rank", "4"]),
    (3, ["--run.schedule", "sync", "--generator.token-budget", "6"]),  # episodes carried between ticks
    # lag 1 with wait: groups whose carried episode would be too stale restart from their prompt
    (3, ["--run.schedule", "async", "--run.async-lag", "1", "--generator.token-budget", "12",
         "--algo.max-staleness", "1", "--algo.stale-policy", "wait"]),
], ids=["colocated-lora", "async2-lora", "sync-partial", "async1-wait"])
def test_episodes_call_the_tools_and_train(tmp_path, model_dir, nproc, schedule):
    out = tmp_path / "run"
    check(run_torchrun("e2e_arithmetic.py", nproc=nproc, timeout_s=300, env=ENV,
                       args=flags(model_dir, out, "--run.max-steps", "3", *schedule)))
    generator = read_jsonl(out / "metrics" / "generator.jsonl")
    calls, totals = [r["env_tool_calls"] for r in generator], [r["env_tool_calls_total"] for r in generator]
    assert totals == sorted(totals) and totals[-1] >= 6, totals  # cumulative, and the tools were used
    assert [sum(calls[: i + 1]) for i in range(len(calls))] == totals, (calls, totals)  # per tick
    if nproc == 1:  # every episode of a tick is emitted in it: the calls are the emitted episodes' turns
        # (the base evaluation's episodes, before tick 0, are not counted)
        turns = [r.get("env_turns_mean", 0) * r["gen_emitted_samples"] for r in generator]
        assert calls == pytest.approx(turns), (calls, turns)
    assert all(r["env_tool_errors"] == 0 and r["env_tool_timeouts"] == 0 for r in generator)
    assert all(r["env_tool_errors_total"] == 0 and r["env_tool_timeouts_total"] == 0 for r in generator)
    assert all(0 <= r["env_samples_with_observation"] <= r["gen_emitted_samples"] for r in generator)
    assert sum(r["env_samples_with_observation"] for r in generator) > 0
    trainer = [r for r in read_jsonl(out / "metrics" / "trainer.jsonl") if "loss" in r]
    assert trainer and all(torch.isfinite(torch.tensor(r["loss"])) for r in trainer)
    assert json.loads((out / "summary.json").read_text())["num_steps"] == 3


def test_a_run_checkpointed_mid_episode_resumes_to_the_same_policy(tmp_path, model_dir):
    common = ["--run.schedule", "colocated", "--run.max-steps", "6", "--checkpoint.every", "3",
              "--generator.token-budget", "4", "--generator.dtype", "float32",
              "--trainer.num-threads", "1"]  # one thread, as every test process (the recipe's 2 spin beside another)
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    check(run_torchrun("e2e_arithmetic.py", nproc=1, timeout_s=300, env=ENV, args=flags(model_dir, straight, *common)))
    state = json.loads((straight / "checkpoints" / "step_3" / "generator" / "state_rank0.json").read_text())
    mid_episode = [r for r in state["carried"] if r["episode"] and 0 in r["loss_mask"]]
    assert mid_episode, "the checkpoint must hold an episode carried after an observation"
    check(run_torchrun("e2e_arithmetic.py", nproc=1, timeout_s=300, env=ENV, args=flags(
        model_dir, resumed, *common, "--checkpoint.resume", str(straight / "checkpoints" / "step_3"))))
    final_straight = load_file(str(straight / "hf" / "final" / "model.safetensors"))
    final_resumed = load_file(str(resumed / "hf" / "final" / "model.safetensors"))
    for name, tensor in final_straight.items():
        assert torch.equal(final_resumed[name], tensor), name
    losses = {r["step"]: r["loss"] for r in read_jsonl(straight / "metrics" / "trainer.jsonl") if "loss" in r}
    again = {r["step"]: r["loss"] for r in read_jsonl(resumed / "metrics" / "trainer.jsonl") if "loss" in r}
    assert again and all(losses[step] == loss for step, loss in again.items())  # it trained after the resume


def test_the_calculator_recipe_runs_as_documented(tmp_path, model_dir):
    """``recipes/calculator.py`` end to end on the tiny model (one colocated process; the plain prompt
    here, the chat prompt in test_the_calculator_prompts)."""
    for style in ("plain",):
        out = tmp_path / style
        check(run_torchrun("run_module.py", nproc=1, timeout_s=300, args=["--module", "recipes.calculator", "--",
            "--model.name", str(model_dir), "--run.schedule", "colocated", "--run.max-steps", "2",
            "--run.num-eval-problems", "4", "--run.output-dir", str(out), "--generator.num-prompts-per-step", "2",
            "--reward.num-workers", "0", "--env.num-tool-workers", "1", "--task.prompt", style]))
        generator = read_jsonl(out / "metrics" / "generator.jsonl")
        assert len(generator) == 2 and all("env_tool_calls" in r for r in generator)
        summary = json.loads((out / "summary.json").read_text())
        assert summary["num_steps"] == 2 and 0 <= summary["final_accuracy"] <= 1


def test_the_guess_number_recipe_runs_as_documented(tmp_path, model_dir):
    """``recipes/guess_number.py`` end to end on the tiny model: episodes of the guessing game, scored
    by the environment's reward through the ``env`` trajectory scorer, training and evaluation."""
    out = tmp_path / "guess"
    check(run_torchrun("run_module.py", nproc=1, timeout_s=300, args=["--module", "recipes.guess_number", "--",
        "--model.name", str(model_dir), "--run.schedule", "colocated", "--run.max-steps", "2",
        "--run.num-eval-problems", "4", "--run.output-dir", str(out), "--generator.num-prompts-per-step", "2",
        "--generator.max-new-tokens", "24", "--reward.num-workers", "1", "--env.num-tool-workers", "0"]))
    reward = read_jsonl(out / "metrics" / "reward.jsonl")
    assert len(reward) == 2 and all(r["reward_errors"] == 0 for r in reward)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["num_steps"] == 2 and 0 <= summary["final_accuracy"] <= 1


def test_the_calculator_prompts(model_dir):
    """Both prompt styles end with the question, the plain one with the two worked examples before it."""
    from tiny_model import tiny_tokenizer

    from recipes.calculator import EXAMPLES, CalculatorConfig, chat_prompt_fn, prompt_fn

    tokenizer = tiny_tokenizer()
    plain = tokenizer.decode(prompt_fn(tokenizer, "What is 347 * 23?"))
    assert plain == "".join(f"Q: What is {a} * {b}?\nA: {a}*{b}= {int(a) * int(b)}\n" for a, b in EXAMPLES) + \
        "Q: What is 347 * 23?\nA:"
    assert "Q: What is 347 * 23?" in tokenizer.decode(chat_prompt_fn(tokenizer, "What is 347 * 23?"))
    with pytest.raises(ValueError, match="--task.prompt must be plain or chat"):
        CalculatorConfig().task.__class__(prompt="xml")
