"""Multi-turn episodes (llamarl/environments/): the calculator's safe evaluator, tools that raise or
hang (counted, the run goes on), and episodes on the native engine: the transcript is exactly the
sampled ids plus the observation ids, observations carry loss mask 0 / version -1, and the trainer's
gradient does not depend on anything at observation positions."""

from __future__ import annotations

import time

import pytest
import torch

from llamarl.data.prompts import Problem
from llamarl.engines.base import Request, SamplingParams
from llamarl.engines.torch_engine import TorchEngine
from llamarl.environments.base import Turn, register_environment
from llamarl.environments.calculator import CalculatorEnvironment, evaluate
from llamarl.environments.episode_engine import EpisodeRunner
from llamarl.environments.tool_workers import ToolRunner
from llamarl.executors.generator import completions_to_batch
from llamarl.models.loading import load_causal_lm


def test_the_calculator_evaluates_arithmetic_and_nothing_else():
    assert evaluate("347*23") == 7981 and evaluate("(12 + 3) / 4") == 3.75 and evaluate("-7 // 2") == -4
    for bad in ("9**9**9", "__import__('os')", "2 ** 3", "x + 1", "1/0", "10000000 * 10000000 * 100"):
        with pytest.raises(ValueError):
            evaluate(bad)
    env = CalculatorEnvironment()
    assert env.step({"calls": 0}, "so 347 * 23=") == Turn(observation=" 7981", state={"calls": 1})
    assert env.step({"calls": 1}, "what=").observation == " ?"


class FlakyTools:
    """A test environment whose tool raises on 'boom', hangs on 'hang', else echoes the turn's length."""

    def stop_texts(self) -> list[str]:
        return ["="]

    def end_texts(self) -> list[str]:
        return []

    def reset(self, problem: Problem) -> dict:
        return {"n": 0}

    def step(self, state: dict, turn: str) -> Turn:
        if "boom" in turn:
            raise RuntimeError("the tool broke")
        if "hang" in turn:
            time.sleep(60)
        return Turn(observation=f"<{len(turn)}>", state={"n": state["n"] + 1})


@pytest.mark.parametrize("num_workers", [0, 1])
def test_a_tool_that_raises_or_hangs_is_counted_and_the_episode_goes_on(num_workers):
    runner = ToolRunner("test_environments:FlakyTools", timeout_s=1.0, num_workers=num_workers)
    try:
        turns = runner.run([({"n": 0}, "ab="), ({"n": 4}, "boom="), ({"n": 2}, "hang="), ({"n": 1}, "abcd=")])
    finally:
        runner.close()
    assert [t.observation for t in turns[::3]] == ["<3>", "<5>"] and [t.state for t in turns[::3]] == [{"n": 1}, {"n": 2}]
    assert turns[1].observation == "[tool error: RuntimeError: the tool broke]" and turns[1].state == {"n": 4}
    assert turns[2].observation.startswith("[tool error: step timed out") and turns[2].state == {"n": 2}
    assert (runner.num_calls, runner.num_errors, runner.num_timeouts) == (4, 1, 1)


@register_environment("test_first_token")
class FirstTokenEnvironment:
    """Ends each policy turn at one chosen token and answers with a fixed observation; done after
    two observations."""

    stop = "a"

    def stop_texts(self) -> list[str]:
        return [self.stop]

    def end_texts(self) -> list[str]:
        return []

    def reset(self, problem: Problem) -> dict:
        return {"seen": 0, "question": problem.question}

    def step(self, state: dict, turn: str) -> Turn:
        seen = state["seen"] + 1
        return Turn(observation=f" [{seen}] ", state={**state, "seen": seen}, done=seen > 2)


@pytest.fixture(scope="module")
def tiny(model_dir):
    model, tokenizer = load_causal_lm(str(model_dir))
    return model.eval(), tokenizer


def test_an_episode_is_the_sampled_ids_plus_the_observation_ids_exactly(tiny):
    """Greedy, fp32: each policy turn of the episode is what the engine samples from the transcript so
    far as a plain prompt; observations sit between turns with mask 0, log-prob 0 and version -1."""
    model, tokenizer = tiny
    engine = TorchEngine(model, eos_token_ids=[tokenizer.eos_token_id], pad_token_id=tokenizer.pad_token_id)
    prompt = tokenizer("7 + 8 =")["input_ids"]
    greedy = SamplingParams(temperature=0.0, max_new_tokens=40)
    # The stop token: the third token greedy decoding makes, so every turn has a few tokens.
    free = engine.generate([Request(sample_id=0, prompt_ids=prompt)], sampling=greedy, version=0)[0]
    stop_id = free.completion_ids[2]
    FirstTokenEnvironment.stop = tokenizer.decode([stop_id])
    tools = ToolRunner("test_first_token", timeout_s=5.0, num_workers=0)
    runner = EpisodeRunner(engine, environment=FirstTokenEnvironment(), tools=tools, tokenizer=tokenizer,
                           max_turns=4, problem_of=lambda sample_id: Problem(question="7 + 8 =", answer="15"))
    episode = runner.generate([Request(sample_id=0, prompt_ids=prompt)], sampling=greedy, version=3)[0]
    # Rebuild it turn by turn with the bare engine: sample until the stop id, append the observation.
    context, expected_ids, expected_mask, observations = list(prompt), [], [], 0
    while True:
        turn = engine.generate([Request(sample_id=0, prompt_ids=context)], version=3, sampling=SamplingParams(
            temperature=0.0, max_new_tokens=40 - len(expected_ids), stop_token_ids=[stop_id]))[0]
        expected_ids += turn.completion_ids
        expected_mask += [1] * len(turn.completion_ids)
        context += turn.completion_ids
        if turn.finish_reason != "stop" or turn.completion_ids[-1] != stop_id or observations == 2:
            break
        observations += 1
        obs = tokenizer(f" [{observations}] ", add_special_tokens=False)["input_ids"]
        expected_ids += obs
        expected_mask += [0] * len(obs)
        context += obs
    assert observations == 2, "the test must cross two observations"
    assert episode.completion_ids == expected_ids and episode.loss_mask == expected_mask
    assert episode.episode["turns"] == 3 and episode.episode["state"]["seen"] == 3
    assert all(v == (3 if m else -1) for v, m in zip(episode.versions, episode.loss_mask))
    assert all(lp == 0.0 for lp, m in zip(episode.logprobs, episode.loss_mask) if not m)
    assert tools.num_calls == 3
    # The rollout batch: the trained positions are exactly the sampled ones.
    batch = completions_to_batch([episode], group_ids=[0], references=["15"], texts=["x"],
                                 pad_token_id=tokenizer.pad_token_id, group_size=1)
    p = len(prompt)
    assert batch["input_ids"][0, : p + len(expected_ids)].tolist() == prompt + expected_ids
    assert batch["loss_mask"][0, p : p + len(expected_ids)].tolist() == expected_mask
    assert (batch["versions"][0, p : p + len(expected_ids)] == torch.tensor(
        [3 if m else -1 for m in expected_mask])).all()


def test_observation_tokens_contribute_no_gradient(tiny, model_dir):
    """On an episode batch, the AIPO loss as the trainer computes it (llamarl.algorithms.losses, the
    batch's loss_mask) has zero gradient at observation positions, does not change when anything is
    written at them, and its parameter gradient equals a reference REINFORCE over the sampled tokens
    only (on-policy: the behaviour log-probs are the model's, so the AIPO weight is 1)."""
    from llamarl.algorithms.losses import aipo_loss

    model, tokenizer = tiny
    engine = TorchEngine(model, eos_token_ids=[tokenizer.eos_token_id], pad_token_id=tokenizer.pad_token_id)
    FirstTokenEnvironment.stop = " "
    runner = EpisodeRunner(engine, environment=FirstTokenEnvironment(),
                           tools=ToolRunner("test_first_token", timeout_s=5.0, num_workers=0), tokenizer=tokenizer,
                           max_turns=4, problem_of=lambda sample_id: Problem(question="q", answer=""))
    prompts = [tokenizer(q)["input_ids"] for q in ("1 + 2 =", "30 + 4 =")]
    episodes = runner.generate([Request(sample_id=i, prompt_ids=prompts[i // 2]) for i in range(4)],
                               sampling=SamplingParams(temperature=1.0, max_new_tokens=30), version=0,
                               generator=torch.Generator().manual_seed(0))
    assert sum(e.loss_mask.count(0) for e in episodes) >= 4, "the episodes must cross observations"
    batch = completions_to_batch(episodes, group_ids=[0, 0, 1, 1], references=[""] * 4, texts=[""] * 4,
                                 pad_token_id=tokenizer.pad_token_id, group_size=2)
    ids, mask = batch["input_ids"], batch["loss_mask"].bool()
    observation = torch.zeros_like(mask)
    for row, e in enumerate(episodes):
        p = len(e.prompt_ids)
        observation[row, p : p + len(e.loss_mask)] = torch.tensor([m == 0 for m in e.loss_mask])
    advantages = torch.tensor([1.0, -1.0, -1.0, 1.0])[:, None].expand_as(mask).contiguous()

    def loss_and_grads(behav_logp: torch.Tensor):
        fresh, _ = load_causal_lm(str(model_dir))
        logits = fresh(input_ids=ids).logits[:, :-1].float()
        shifted = torch.log_softmax(logits, dim=-1).gather(-1, ids[:, 1:, None]).squeeze(-1)
        logp = torch.cat([torch.zeros_like(shifted[:, :1]), shifted], dim=1)  # logp[t]: token t given ids[:t]
        logp.retain_grad()
        loss, _ = aipo_loss(logp=logp, behav_logp=behav_logp, advantages=advantages, mask=mask)
        loss.backward()
        return loss, logp.grad, {n: q.grad.clone() for n, q in fresh.named_parameters()}, logp.detach()

    loss, logp_grad, grads, logp = loss_and_grads(batch["behav_logp"])
    assert (logp_grad[observation] == 0).all() and (logp_grad[mask] != 0).any()
    garbage = batch["behav_logp"].masked_fill(observation, -123.0)
    loss_g, _, grads_g, _ = loss_and_grads(garbage)
    assert torch.equal(loss_g, loss) and all(torch.equal(grads_g[n], g) for n, g in grads.items())
    # The behaviour log-probs the engine reported are the model's own at the sampled positions.
    torch.testing.assert_close(batch["behav_logp"][mask], logp[mask], atol=1e-4, rtol=0)
    reference, _ = load_causal_lm(str(model_dir))
    logits = reference(input_ids=ids).logits[:, :-1].float()
    ref_logp = torch.log_softmax(logits, dim=-1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    sampled = mask[:, 1:].float()
    (-(advantages[:, 1:] * ref_logp * sampled).sum() / sampled.sum()).backward()
    for name, param in reference.named_parameters():
        torch.testing.assert_close(grads[name], param.grad, atol=1e-5, rtol=1e-4)


def test_a_repeated_tool_failure_is_printed_once_and_counted_every_time(caplog):
    """A policy repeating one mistake must not flood the console (a new user's run printed 21 such
    lines): one warning per kind of failure, every failure counted."""
    runner = ToolRunner("test_environments:FlakyTools", timeout_s=1.0, num_workers=0)
    try:
        with caplog.at_level("WARNING", logger="llamarl.environments.tool_workers"):
            turns = runner.run([({"n": 0}, "boom="), ({"n": 1}, "boom="), ({"n": 2}, "ab="), ({"n": 3}, "boom=")])
    finally:
        runner.close()
    assert [t.error is not None for t in turns] == [True, True, False, True]
    assert runner.num_errors == 3
    warned = [r.getMessage() for r in caplog.records if "the tool broke" in r.getMessage()]
    assert len(warned) == 1 and "further RuntimeError failures are counted" in warned[0], warned
