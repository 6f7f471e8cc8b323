"""Dynamic sampling with refill (``--algo.max-refill``, llamarl/executors/dynamic_sampling.py).

* The generator alone, in process: every group it emits has a spread of rewards (checked with the
  scorer itself, on the emitted text); every prompt consumed is scored exactly once, in data order;
  each refill round takes exactly the missing number of prompts; the groups kept are exactly the
  scored ones with a spread; the data position counts every consumed prompt; and a generator saved
  after two ticks and resumed gives the next ticks' batches and data positions bitwise. With partial
  rollouts (a token budget) as well.
* The flags: ``--algo.max-refill`` is validated, the ``dapo`` preset turns it on (a flag wins), and a
  pipeline whose rewards the generator cannot compute (an LLM judge) is refused with one line.

Every schedule (colocated, sync, async lag 1 and 2) with exact resume, on real ranks:
tests/test_dynamic_sampling_schedules.py."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from scorers_for_tests import first_char_even

from llamarl.algorithms.config import AlgoConfig
from llamarl.data.prompts import Problem
from llamarl.executors.config import GeneratorConfig, RewardConfig
from llamarl.executors.dynamic_sampling import DynamicSampling, tied_groups
from llamarl.executors.generator import GeneratorExecutor
from llamarl.models.config import ModelConfig
from llamarl.runtime.batch import TensorBatch

SCORER = "scorers_for_tests:first_char_even"
SAMPLES, PROMPTS, MAX_REFILL = 2, 3, 3


class Questions:
    def sample(self, index: int) -> Problem:
        return Problem(question=f"{index} + {index} =", answer="")


def prompt_fn(tokenizer, question: str) -> list[int]:
    return list(tokenizer(question)["input_ids"])


class Spy(DynamicSampling):
    """Records every group scored (id, rewards by the scorer on the text) and every refill's counts."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.scored: list[tuple[int, tuple[float, ...]]] = []
        self.rounds: list[list[int]] = []

    def keep(self, groups, *, to_batch):
        if groups:
            batch = to_batch(groups)
            texts, ids = batch.get_strings("completion"), batch["group_ids"].tolist()
            for g, _, _ in groups:
                self.scored.append((g, tuple(first_char_even(t, "") for t, i in zip(texts, ids) if i == g)))
        return super().keep(groups, to_batch=to_batch)


def generator(model_dir, *, token_budget=None) -> tuple[GeneratorExecutor, Spy]:
    ctx = SimpleNamespace(device=torch.device("cpu"), dp_rank=0, dp_size=1, tp_rank=0, tp_size=1, local_rank=0,
                          executor="generator", ranks={"generator": [0]})
    config = GeneratorConfig(num_prompts_per_step=PROMPTS, samples_per_prompt=SAMPLES, max_new_tokens=4,
                             token_budget=token_budget, temperature=1.0)
    spy = Spy(reward=RewardConfig(num_workers=0), scorer=SCORER, target=PROMPTS, max_refill=MAX_REFILL)
    gen = GeneratorExecutor(ctx, model_config=ModelConfig(name=str(model_dir)), config=config, task=Questions(),
                            prompt_fn=prompt_fn, seed=3, dynamic=spy)
    gen.init()
    return gen, spy


def tick(gen: GeneratorExecutor) -> tuple[TensorBatch, dict]:
    gen.step()
    return gen.outputs.pop("rollouts", TensorBatch()), dict(gen.metrics)


@pytest.mark.parametrize("token_budget", [None, 2])
def test_the_generator_keeps_groups_with_signal_and_refills_them_in_data_order(model_dir, token_budget):
    gen, spy = generator(model_dir, token_budget=token_budget)
    refill = gen._refill

    def counted(counts):
        spy.rounds.append((list(counts), len(spy.scored)))  # the round's counts, the groups scored before it
        return refill(counts)

    gen._refill = counted
    total_dropped = total_rounds = 0
    for _ in range(4):
        scored_before, position_before, rounds_before = len(spy.scored), gen.data_position, len(spy.rounds)
        batch, metrics = tick(gen)
        scored = spy.scored[scored_before:]
        spread = [g for g, rewards in scored if len(set(rewards)) > 1]
        emitted = sorted(set(batch["group_ids"].tolist())) if len(batch) else []
        # Exactly the scored groups with a spread are emitted, each with its rewards' spread.
        assert emitted == sorted(spread)
        for g in emitted:
            rewards = {first_char_even(t, "") for t, i in zip(batch.get_strings("completion"),
                                                                batch["group_ids"].tolist()) if i == g}
            assert len(rewards) == 2, g
        assert metrics["dynamic_sampling_kept"] == len(emitted)
        assert metrics["dynamic_sampling_dropped"] == len(scored) - len(spread)
        assert metrics["dynamic_sampling_refill_rounds"] == len(spy.rounds) - rounds_before
        # Each round took exactly the groups still missing; the batch is full unless every round ran.
        for counts, scored_at in spy.rounds[rounds_before:]:
            kept_so_far = sum(len(set(r)) > 1 for _, r in spy.scored[scored_before:scored_at])
            assert counts == [PROMPTS - kept_so_far] and counts[0] > 0
        if metrics["dynamic_sampling_refill_rounds"] < MAX_REFILL:
            assert len(emitted) >= PROMPTS
        consumed = PROMPTS + sum(c[0] for c, _ in spy.rounds[rounds_before:])
        assert gen.data_position == position_before + consumed
        if token_budget is None:  # every consumed prompt finished and was scored, in data order
            assert [g for g, _ in scored] == list(range(position_before, position_before + consumed))
        total_dropped += metrics["dynamic_sampling_dropped"]
        total_rounds += metrics["dynamic_sampling_refill_rounds"]
    # Every prompt scored once over the run; both branches taken.
    assert len({g for g, _ in spy.scored}) == len(spy.scored)
    assert total_dropped > 0 and total_rounds > 0


def test_a_resumed_generator_continues_its_refills_bitwise(model_dir, tmp_path):
    straight, _ = generator(model_dir, token_budget=2)
    expected = [tick(straight) for _ in range(4)]
    first, _ = generator(model_dir, token_budget=2)
    for _ in range(2):
        tick(first)
    first.save_checkpoint(tmp_path)
    resumed, _ = generator(model_dir, token_budget=2)
    resumed.load_checkpoint(tmp_path)
    for step in (2, 3):
        batch, metrics = tick(resumed)
        want_batch, want = expected[step]
        assert metrics["gen_data_position"] == want["gen_data_position"], step
        for key in ("dynamic_sampling_kept", "dynamic_sampling_dropped", "dynamic_sampling_refill_rounds"):
            assert metrics[key] == want[key], (step, key)
        assert sorted(batch.fields) == sorted(want_batch.fields)
        for name in ("input_ids", "group_ids", "behav_logp"):
            assert torch.equal(batch[name], want_batch[name]), (step, name)
    assert sum(m["dynamic_sampling_refill_rounds"] for _, m in expected) > 0


def test_tied_groups_are_those_whose_rewards_are_all_equal():
    batch = TensorBatch({"group_ids": torch.tensor([4, 4, 9, 9, 2, 2]),
                         "rewards": torch.tensor([1.0, 1.0, 0.0, 1.0, 0.5, 0.5])})
    assert tied_groups(batch) == {4, 2}


def test_max_refill_is_validated_and_the_dapo_preset_turns_it_on():
    with pytest.raises(ValueError, match="--algo.max-refill must be >= 0"):
        AlgoConfig(max_refill=-1)
    with pytest.raises(ValueError, match="--algo.entropy-coef must be finite"):
        AlgoConfig(entropy_coef=float("nan"))
    assert AlgoConfig().max_refill == 0 and AlgoConfig(preset="dapo").max_refill == 10
    assert AlgoConfig(preset="dapo", max_refill=3).max_refill == 3


def test_a_pipeline_whose_rewards_the_generator_cannot_compute_is_refused(model_dir, tmp_path):
    from llamarl.rl.standard_pipeline import dynamic_sampling
    from llamarl.rl.task import Task
    from recipes.llm_judge import LLMJudgeConfig, llm_judge_pipeline

    config = LLMJudgeConfig()
    config.model = ModelConfig(name=str(model_dir))
    config.run = dataclasses.replace(config.run, output_dir=str(tmp_path))
    config.algo = AlgoConfig(max_refill=2)
    with pytest.raises(ValueError, match=r"^--algo.max-refill 2: .* its stage 'judge', which the generator cannot"):
        llm_judge_pipeline(config, Task(Questions(), prompt_fn=prompt_fn, scorer="arithmetic"))
    with pytest.raises(ValueError, match="needs a scorer the generator can call"):
        dynamic_sampling(config, scorer=None)
    assert dynamic_sampling(config, scorer="arithmetic").target == config.generator.num_prompts_per_step
    config.algo = AlgoConfig()
    assert dynamic_sampling(config, scorer=None) is None
    llm_judge_pipeline(config, Task(Questions(), prompt_fn=prompt_fn, scorer="arithmetic"))  # off: accepted
