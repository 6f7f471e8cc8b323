"""llamarl/rl/task.py: a recipe's task as one object, its scorer reference resolved once."""

from __future__ import annotations

import dataclasses

import pytest

import llamarl.rl.task as task_module
from llamarl.data.prompts import Problem, arithmetic_prompt
from llamarl.executors.config import RewardConfig
from llamarl.rewards import arithmetic, gsm8k
from llamarl.rl.arithmetic_task import ArithmeticConfig, arithmetic_task
from llamarl.rl.standard_pipeline import evaluation_score
from llamarl.rl.task import Task
from llamarl.runtime.run_identity import dataset_fingerprint


def test_the_scorer_reference_is_resolved_once(monkeypatch):
    calls = []

    def resolve(name):
        calls.append(name)
        return arithmetic.score

    monkeypatch.setattr(task_module, "resolve_scorer", resolve)
    task = Task(None, scorer="arithmetic")
    assert task.score is arithmetic.score and task.score is arithmetic.score
    assert calls == ["arithmetic"]
    assert Task(None).score is None
    with pytest.raises(dataclasses.FrozenInstanceError):
        task.scorer = "gsm8k"


def test_reward_flags_replace_the_tasks_scorer_in_evaluations():
    config = ArithmeticConfig()
    task = arithmetic_task(config)
    assert task.for_reward(config.reward) is task
    assert evaluation_score(config, task) is arithmetic.score
    config.reward = RewardConfig(scorer="gsm8k")
    assert task.for_reward(config.reward).scorer == "gsm8k" and task.scorer == "arithmetic"
    assert evaluation_score(config, task) is gsm8k.score


def test_heldout_problems_and_fingerprint():
    config = ArithmeticConfig()
    task = arithmetic_task(config)
    assert task.prompt_fn is arithmetic_prompt
    assert task.eval_problems(5) == task.sampler.heldout(5)
    assert task.sample(3) == task.sampler.sample(3)
    assert task.fingerprint == dataset_fingerprint(task.sampler)
    problems = [Problem(question=str(i), answer=str(i)) for i in range(4)]
    listed = Task(task.sampler, heldout=problems)
    assert listed.eval_problems(2) == problems[:2] and listed.eval_problems(9) == problems
