"""The sample source (llamarl/executors/sample_source.py) on its own: chosen once from ``--env``, the
single turn is the engine and keeps nothing; episodes keep their tools' counters, report them per tick,
present the tools in the prompt and keep an evaluation's problems and calls out of the training's.
No model, no processes (tools inline)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from tools_for_tests import qwen_tokenizer

from llamarl.data.prompts import Problem, build_chat_prompt
from llamarl.engines.base import Completion
from llamarl.environments.config import EnvConfig
from llamarl.environments.episode_engine import EpisodeRunner
from llamarl.executors.sample_source import Episodes, SingleTurn, choose_sample_source

ENGINE = SimpleNamespace(pad_token_id=0)  # nothing here generates


def choose(env: EnvConfig | None, tokenizer=None):
    training = Problem(question="training", answer="")
    return choose_sample_source(ENGINE, env, tokenizer=tokenizer, problem_of=lambda sample_id: training,
                                device=None)


def episode(turns: int, *, observed: bool = False, truncated: bool = False) -> Completion:
    return Completion(sample_id=0, prompt_ids=[1], completion_ids=[5, 6, 7], logprobs=[0.0] * 3, versions=[0] * 3,
                      finish_reason="stop", loss_mask=[1, 0, 1] if observed else [1, 1, 1],
                      episode={"turns": turns, **({"truncated": True} if truncated else {})})


@pytest.mark.parametrize("env", [None, EnvConfig()])
def test_without_an_environment_the_source_is_the_engine_and_keeps_nothing(env):
    source = choose(env)
    assert isinstance(source, SingleTurn) and source.engine is ENGINE
    assert source.prompt_fn(build_chat_prompt) is build_chat_prompt
    source.restore_counts({"calls": 3})
    assert source.counts() == {} and source.metrics({}, [episode(2)], emits=True) == {}
    with source.evaluating([Problem(question="q", answer="a")]):
        pass


def test_episodes_count_their_tools_report_each_tick_and_resume_the_counters():
    source = choose(EnvConfig(name="calculator", num_tool_workers=0), qwen_tokenizer())
    assert isinstance(source, Episodes) and isinstance(source.engine, EpisodeRunner)
    assert source.engine.engine is ENGINE and source.prompt_fn(build_chat_prompt) is build_chat_prompt  # it presents no tools
    assert source.counts() == {"calls": 0, "errors": 0, "timeouts": 0}
    source.restore_counts({"calls": 7, "errors": 1})  # a checkpoint's; a missing key is 0
    assert source.counts() == {"calls": 7, "errors": 1, "timeouts": 0}
    before = {"calls": 4, "errors": 1, "timeouts": 0}
    emitted = [episode(2, observed=True), episode(0, truncated=True)]
    assert source.metrics(before, emitted, emits=True) == {
        "env_tool_calls": 3.0, "env_tool_calls_total": 7.0, "env_tool_errors": 0.0, "env_tool_errors_total": 1.0,
        "env_tool_timeouts": 0.0, "env_tool_timeouts_total": 0.0,
        "env_samples_with_observation": 1.0, "env_truncated": 1.0, "env_turns_mean": 1.0}
    peer = source.metrics(before, emitted, emits=False)  # a TP peer emits nothing: no per-episode counts
    assert peer["env_samples_with_observation"] == peer["env_truncated"] == 0.0 and "env_turns_mean" not in peer


def test_an_evaluation_starts_episodes_from_its_problems_and_leaves_the_training_counters_as_they_were():
    source = choose(EnvConfig(name="calculator", num_tool_workers=0), qwen_tokenizer())
    runner, problems = source.engine, [Problem(question="1+1", answer="2"), Problem(question="2+2", answer="4")]
    source.restore_counts({"calls": 5})
    with source.evaluating(problems):
        assert runner.problem_of(1) is problems[1]
        runner.tools.num_calls += 3  # the evaluation's calls
    assert runner.problem_of(1).question == "training" and source.counts()["calls"] == 5
    with pytest.raises(RuntimeError, match="broke"), source.evaluating(problems):
        runner.tools.num_errors += 1
        raise RuntimeError("the evaluation broke")
    assert runner.problem_of(0).question == "training" and source.counts() == {"calls": 5, "errors": 0, "timeouts": 0}


def test_tools_are_presented_in_every_prompt_in_the_format_the_template_speaks():
    tokenizer = qwen_tokenizer()
    source = choose(EnvConfig(tools="tools_for_tests:convert,tools_for_tests:shout", num_tool_workers=0), tokenizer)
    assert isinstance(source, Episodes) and source.engine.tools.name.startswith("tools@hermes:")
    presented = source.prompt_fn(build_chat_prompt)(tokenizer, "what is 3 feet in metres?")
    assert "convert" in tokenizer.decode(presented) and "convert" not in tokenizer.decode(build_chat_prompt(tokenizer, "x"))
