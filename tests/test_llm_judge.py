"""recipes/llm_judge.py: an LLM judge as the reward, the rule-based scorer kept as its auditor.

* the judge's probability: answer tokens, the chat / plain prompt, p(yes) / (p(yes) + p(no)) equal
  to an explicit softmax over the two answer sets, deterministic, independent of the micro-batch;
* the executor's rewards (soft, hard, a prompt too long to judge) and its audit metrics, on one
  rank without a world (its step has no collectives);
* a real 4-executor gloo world (generator, reward, judge, trainer) on tiny random Llamas, the judge
  a different model from the policy: metrics/judge.jsonl, and every reward the trainer received is
  the judge's, recomputed here from the tapped batch.
"""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parent / "worlds"))
from conftest import read_jsonl
from launch import check, run_torchrun
from middle_stage import check_middle_stage_pipeline
from scorers_for_tests import first_char_even
from taps import read_taps
from tiny_model import save_tiny_model

from llamarl.data.arithmetic import ArithmeticTask
from llamarl.models.loading import load_causal_lm
from llamarl.runtime.batch import TensorBatch
from recipes.llm_judge import (
    DEFAULT_JUDGE_PROMPT,
    JudgeConfig,
    JudgeExecutor,
    LLMJudgeConfig,
    answer_token_ids,
    check_llm_judge,
    judge_prompt_ids,
    judge_yes_probability,
    llm_judge_pipeline,
)

JUDGE_KEYS = ("judge_reward_mean", "judge_yes_prob_mean", "judge_answer_mass_mean", "judge_agreement",
              "rule_reward_mean", "judge_seconds")


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("llm_judge")
    return save_tiny_model(root / "policy", seed=0), save_tiny_model(root / "judge", seed=1)


@pytest.fixture(scope="module")
def judge(models):
    model, tokenizer = load_causal_lm(str(models[1]), dtype=torch.float32)
    return model, tokenizer


def prompts_for(tokenizer, completions, question="What is 12 + 30?", reference="42"):
    return [judge_prompt_ids(tokenizer, DEFAULT_JUDGE_PROMPT, question=question, reference=reference, completion=c)
            for c in completions]


def test_answer_tokens_and_prompt(judge):
    _, tokenizer = judge
    yes, no = answer_token_ids(tokenizer)
    # Character-level tokenizer: " yes" and " no" both start with a space, which is dropped.
    assert tokenizer.convert_ids_to_tokens(yes) == ["Y", "y"] and tokenizer.convert_ids_to_tokens(no) == ["N", "n"]
    text = tokenizer.decode(prompts_for(tokenizer, ["the answer is 42"])[0])
    assert text == ("Question: What is 12 + 30?\nReference answer: 42\nStudent answer: the answer is 42\n"
                    "Is the student's answer correct? Answer yes or no.\nAnswer:")
    with pytest.raises(ValueError, match="no distinct first token"):
        answer_token_ids(tokenizer, yes_words=(" yes",), no_words=(" no",))


def test_judge_probability_is_the_normalised_yes_of_one_forward(judge):
    model, tokenizer = judge
    yes, no = answer_token_ids(tokenizer)
    prompts = prompts_for(tokenizer, ["42", "41", "The answer is 42.", "", "x" * 40])
    kwargs = {"yes_ids": yes, "no_ids": no, "pad_token_id": tokenizer.pad_token_id, "device": "cpu"}
    p_yes, mass = judge_yes_probability(model, prompts, max_tokens_per_microbatch=4096, **kwargs)
    assert p_yes.dtype == torch.float32 and p_yes.shape == (5,)
    assert ((p_yes >= 0) & (p_yes <= 1)).all() and ((mass > 0) & (mass <= 1)).all()
    for i, prompt in enumerate(prompts):
        with torch.no_grad():
            probs = torch.softmax(model(input_ids=torch.tensor([prompt])).logits[0, -1].double(), dim=-1)
        p, q = float(probs[yes].sum()), float(probs[no].sum())
        # yes and no normalised to 1: p_yes is p(yes) / (p(yes) + p(no)), its complement the "no".
        assert float(p_yes[i]) == pytest.approx(p / (p + q), abs=1e-6)
        assert float(1 - p_yes[i]) == pytest.approx(q / (p + q), abs=1e-6)
        assert float(mass[i]) == pytest.approx(p + q, abs=1e-6)
    # Deterministic, and the same whatever the micro-batching (one prompt per forward here).
    again, _ = judge_yes_probability(model, prompts, max_tokens_per_microbatch=4096, **kwargs)
    assert torch.equal(again, p_yes)
    alone, _ = judge_yes_probability(model, prompts, max_tokens_per_microbatch=max(map(len, prompts)), **kwargs)
    torch.testing.assert_close(alone, p_yes, atol=1e-6, rtol=0)
    with pytest.raises(ValueError, match="exceed the micro-batch budget"):
        judge_yes_probability(model, prompts, max_tokens_per_microbatch=10, **kwargs)


def _executor(judge, config):
    """A JudgeExecutor on one rank without a world (its step has no collectives)."""
    ctx = SimpleNamespace(device=torch.device("cpu"), local_rank=0, local_world_size=1, rank=0)
    executor = JudgeExecutor(ctx, config=config, model_name="unused", question_of=lambda g: f"What is {g} + 1?")
    executor.model, executor.tokenizer = judge
    executor.yes_ids, executor.no_ids = answer_token_ids(judge[1])
    executor.pad_token_id = judge[1].pad_token_id
    executor.max_prompt_tokens = config.max_tokens_per_microbatch
    return executor


def _batch(completions, references, rule):
    n = len(completions)
    batch = TensorBatch({"group_ids": torch.tensor([7, 7, 9, 9][:n]), "num_tokens": torch.full((n,), 20),
                         "rewards": torch.tensor(rule, dtype=torch.float32)}, {"group_size": 2})
    batch.set_strings("completion", completions)
    batch.set_strings("reference", references)
    return batch


@pytest.mark.parametrize("hard", [False, True])
def test_executor_rewards_and_audit(judge, hard):
    config = JudgeConfig(hard=hard, threshold=0.5)
    executor = _executor(judge, config)
    completions, references, rule = ["8", "9", "10", "zz"], ["8", "8", "10", "10"], [1.0, 0.0, 1.0, 0.0]
    executor.set_input("ruled", _batch(completions, references, rule))
    executor.step()
    out = executor.get_output("scored")
    p_yes, _, _ = executor.judge([f"What is {g} + 1?" for g in (7, 7, 9, 9)], references, completions)
    assert torch.equal(out["judge_yes_prob"], p_yes)
    expected = (p_yes >= 0.5).float() if hard else p_yes
    assert torch.equal(out["rewards"], expected) and torch.equal(out["rule_reward"], torch.tensor(rule))
    m = executor.metrics
    assert m["judge_samples"] == 4 and m["rule_reward_mean"] == 0.5 and m["judge_too_long"] == 0
    assert m["judge_reward_mean"] == pytest.approx(float(expected.mean()))
    assert m["judge_agreement"] == pytest.approx(float(((p_yes >= 0.5) == torch.tensor([1, 0, 1, 0]).bool()).float().mean()))
    # balance_tokens: 0 only for a group whose judge rewards all tie.
    for rows in ([0, 1], [2, 3]):
        tie = bool((out["rewards"][rows] == out["rewards"][rows[0]]).all())
        assert out["balance_tokens"][rows].tolist() == ([0, 0] if tie else [20, 20])


def test_a_prompt_too_long_to_judge_scores_zero_and_is_counted(judge):
    executor = _executor(judge, JudgeConfig(max_tokens_per_microbatch=150))
    completions = ["8", "x" * 200]
    executor.set_input("ruled", _batch(completions, ["8", "8"], [1.0, 0.0]))
    executor.step()
    out = executor.get_output("scored")
    assert out["rewards"][1] == 0 and out["judge_yes_prob"][1] == 0 and 0 < out["rewards"][0] < 1
    assert executor.metrics["judge_too_long"] == 1


def test_config_and_schedule_are_checked(tmp_path):
    for kwargs, message in [({"num_ranks": 0}, "--judge.num-ranks"), ({"threshold": 1.0}, "--judge.threshold"),
                            ({"prompt": "Is {answer} right?"}, "--judge.prompt must contain"),
                            ({"prompt": "Is it right?"}, "--judge.prompt must contain"),
                            ({"prompt": "Is {completion right?"}, "not a valid format template"),
                            ({"max_tokens_per_microbatch": 0}, "--judge.max-tokens-per-microbatch"),
                            ({"model": " "}, "--judge.model")]:
        with pytest.raises(ValueError, match=message):
            JudgeConfig(**kwargs)
    check_middle_stage_pipeline(LLMJudgeConfig, llm_judge_pipeline, middle="judge",
                                channels=("rollouts", "ruled", "scored"))
    config = LLMJudgeConfig()
    config.run.output_dir = str(tmp_path)
    config.judge.model = str(tmp_path / "no-such-judge")
    with pytest.raises(ValueError, match="--judge.model .*no such model directory"):
        check_llm_judge(config)


def test_four_executor_world_trains_on_the_judges_rewards(tmp_path, models, judge):
    policy_dir, judge_dir = models
    out, taps_dir = tmp_path / "run", tmp_path / "taps"
    check(run_torchrun("stage_recipe_world.py", nproc=4, timeout_s=300, env={"LLAMARL_TEST_TAPS": str(taps_dir)}, args=[
        "--recipe", "llm_judge", "--tap", "trainer", "--",
        "--model.name", str(policy_dir), "--judge.model", str(judge_dir), "--run.max-steps", "3",
        "--run.schedule", "async", "--run.async-lag", "1", "--run.num-eval-problems", "4",
        "--run.output-dir", str(out), "--generator.num-prompts-per-step", "4", "--reward.num-workers", "0",
        "--export.no-final", "--run.device-guard"]))
    records = read_jsonl(out / "metrics" / "judge.jsonl")
    # async lag 1: rollouts are scored and judged within their tick, trained at the next one.
    assert [r["step"] for r in records] == [0, 1, 2]
    for r in records:
        assert all(key in r for key in JUDGE_KEYS), r
        assert all(0 <= r[key] <= 1 for key in JUDGE_KEYS if key != "judge_seconds"), r
        assert r["judge_samples"] == 16 and r["judge_too_long"] == 0
    trainer = [r for r in read_jsonl(out / "metrics" / "trainer.jsonl") if "loss" in r]
    assert [r["step"] for r in trainer] == [1, 2] and all(r["optimizer_steps"] == 1 for r in trainer)
    taps = read_taps(taps_dir, "trainer", "scored")
    assert sorted(taps) == [1, 2]
    model, tokenizer = judge
    yes, no = answer_token_ids(tokenizer)
    task = ArithmeticTask(num_digits=2, seed=0)
    for step, batch in taps.items():
        completions, references = batch.get_strings("completion"), batch.get_strings("reference")
        # The rule scorer audited: rule_reward is what it gives each completion.
        rule = torch.tensor([first_char_even(c, r) for c, r in zip(completions, references)])
        assert torch.equal(batch["rule_reward"], rule.float())
        # The trainer received the judge's rewards (soft: p_yes), recomputed here with the judge model.
        prompts = [judge_prompt_ids(tokenizer, DEFAULT_JUDGE_PROMPT, question=task.sample(g).question, reference=r,
                                    completion=c)
                   for g, r, c in zip(batch["group_ids"].tolist(), references, completions)]
        p_yes, _ = judge_yes_probability(model, prompts, yes_ids=yes, no_ids=no, pad_token_id=tokenizer.pad_token_id,
                                         max_tokens_per_microbatch=4096, device="cpu")
        assert torch.equal(batch["rewards"], batch["judge_yes_prob"])
        torch.testing.assert_close(batch["rewards"], p_yes, atol=1e-5, rtol=0)
        metrics = records[step - 1]
        assert metrics["judge_reward_mean"] == pytest.approx(float(p_yes.mean()), abs=1e-5)
        assert metrics["rule_reward_mean"] == pytest.approx(float(rule.mean()))
        assert metrics["judge_agreement"] == pytest.approx(float(((p_yes >= 0.5) == (rule >= 0.5)).float().mean()))
