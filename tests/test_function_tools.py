"""Tools as plain Python functions through the chat template (llamarl/environments/function_tools.py),
and the environment contract's programming errors (one line naming the environment and the method).

A tiny random Qwen2 with Qwen2.5's own chat template (tests/tools_for_tests.py): the prompt shows
the tools' schemas, a tool call parsed from ``<tool_call>`` JSON runs the function, its answer is
the template's tool message, and the trained ids are exactly the sampled ids plus the observation
ids (mask 0 on the observation, no gradient from it)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tools_for_tests import convert, plain_chat_tokenizer, qwen_tokenizer, tiny_qwen2

from llamarl.data.prompts import Problem, build_chat_prompt
from llamarl.engines.base import Completion, Request, SamplingParams, sampled_mask
from llamarl.engines.torch_engine import TorchEngine
from llamarl.environments.base import EnvironmentContractError, Turn, check_tool_schemas
from llamarl.environments.building import build_environment
from llamarl.environments.config import EnvConfig
from llamarl.environments.episode_engine import EpisodeRunner
from llamarl.environments.function_tools import (
    FunctionToolsEnvironment,
    presenting_tools,
    resolve_tools,
    tool_observation_format,
    tool_schema,
)
from llamarl.environments.tool_workers import ToolRunner
from llamarl.executors.generator import completions_to_batch
from llamarl.rl.config_checks import check_environment

TOOLS = "tools_for_tests:convert,tools_for_tests:shout"
CALL = '<tool_call>\n{"name": "convert", "arguments": {"value": 2, "from_unit": "m", "to_unit": "cm"}}\n</tool_call>'


def test_the_schema_comes_from_the_signature_and_docstring():
    schema = tool_schema(convert)
    assert schema["function"]["name"] == "convert"
    assert schema["function"]["description"] == "Convert a length between units."
    assert schema["function"]["parameters"]["required"] == ["value", "from_unit", "to_unit"]
    assert schema["function"]["parameters"]["properties"]["value"]["type"] == "number"
    assert [f.__name__ for f in resolve_tools(TOOLS)] == ["convert", "shout"]


@pytest.mark.parametrize(("spec", "match"), [
    ("tools_for_tests:no_docstring", r"--env.tools tools_for_tests:no_docstring: .*no docstring"),
    ("tools_for_tests:no_type_hints", r"--env.tools tools_for_tests:no_type_hints: .*type hint"),
    ("no_such_module_xyz:f", r"--env.tools: cannot import tool function 'no_such_module_xyz:f'"),
    ("tools_for_tests:nope", r"--env.tools: cannot import tool function 'tools_for_tests:nope'"),
    ("convert", r"--env.tools takes module:function"),
    ("tools_for_tests:convert,tools_for_tests:convert", r"two tools are called 'convert'"),
])
def test_a_bad_tool_reference_is_one_line_at_the_flag(spec, match):
    with pytest.raises(ValueError, match=match) as info:
        check_environment(EnvConfig(tools=spec))
    assert "\n" not in str(info.value)


@pytest.mark.parametrize(("name", "match"), [
    ("no_such_module_xyz:Env", r"cannot import environment 'no_such_module_xyz:Env'"),
    ("tools_for_tests:Nope", r"cannot import environment 'tools_for_tests:Nope'"),
    ("tools_for_tests:NotAnEnvironment", r"is not an environment: it has no stop_texts, end_texts, reset, step"),
    ("calculater", r"--env.name must be one of \['calculator', 'guess_number'"),
])
def test_a_bad_environment_reference_is_one_line_at_the_flag(name, match):
    with pytest.raises(ValueError, match=match) as info:
        check_environment(EnvConfig(name=name))
    assert "\n" not in str(info.value)
    with pytest.raises(ValueError, match="--env.tools and --env.name are two environments"):
        EnvConfig(name="calculator", tools=TOOLS)


def test_the_flags_exit_2_before_the_model_loads_and_help_lists_every_environment():
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1", "COLUMNS": "200"}
    root = Path(__file__).resolve().parents[1]
    bad = subprocess.run([sys.executable, "-m", "recipes.calculator", "--env.name", "None", "--env.tools",
                          "tools_for_tests:no_docstring"], check=False, cwd=root, env=env,
                         capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2, bad.stderr[-2000:]
    assert "no_docstring" in bad.stderr and "docstring" in bad.stderr
    shown = subprocess.run([sys.executable, "-m", "recipes.calculator", "--help"], check=False, cwd=root,
                           env=env, capture_output=True, text=True, timeout=300)
    text = " ".join(shown.stdout.replace("│", " ").split())
    assert shown.returncode == 0 and "--env.tools" in text
    # The names a fresh process registers: this one may hold the tests' own environments too.
    program = "from llamarl.environments.base import environment_names as n; print(' '.join(n()))"
    builtin = subprocess.run([sys.executable, "-c", program], check=True, cwd=root, env=env, capture_output=True,
                             text=True, timeout=300).stdout.split()
    assert builtin and all(name in text for name in builtin), (builtin, text)


def test_the_prompt_presents_the_tools_through_the_template():
    tokenizer = qwen_tokenizer()
    schemas = FunctionToolsEnvironment.from_reference(TOOLS).chat_tools()
    ids = presenting_tools(build_chat_prompt, schemas)(tokenizer, "How many cm in 2 m?")
    assert ids == tokenizer.apply_chat_template([{"role": "user", "content": "How many cm in 2 m?"}], tools=schemas,
                                                tokenize=True, add_generation_prompt=True)["input_ids"]
    text = tokenizer.decode(ids)
    assert "<tools>\n" + json.dumps(schemas[0]) in text and text.endswith("<|im_start|>assistant\n")
    # A template without tool support: the default format's system message, the same tags.
    plain = plain_chat_tokenizer()
    text = plain.decode(presenting_tools(build_chat_prompt, schemas)(plain, "q"))
    assert text.startswith("<|im_start|>system\nYou may call one or more functions") and json.dumps(schemas[1]) in text
    # A prompt built without the chat template would show no tools: refused.
    with pytest.raises(ValueError, match="did not call apply_chat_template"):
        presenting_tools(lambda tok, q: tok(q)["input_ids"], schemas)(tokenizer, "q")


def test_the_observation_is_the_templates_tool_message():
    schemas = FunctionToolsEnvironment.from_reference(TOOLS).chat_tools()
    # From the end of the call message (its EOS, the last token the policy samples) to the next header.
    expected = ("\n<|im_start|>user\n<tool_response>\n", "\n</tool_response><|im_end|>\n<|im_start|>assistant\n")
    assert tool_observation_format(qwen_tokenizer(), schemas) == expected
    assert tool_observation_format(plain_chat_tokenizer(), schemas) == expected  # the default format


class ForcedToolCall:
    """An engine whose first turn of each episode is ``call`` (forced, log-prob -0.5) and whose later
    turns the real engine samples (greedy) from the transcript so far."""

    def __init__(self, engine: TorchEngine, call_ids: list[int]) -> None:
        self.engine, self.call_ids, self.pad_token_id = engine, call_ids, engine.pad_token_id

    def generate(self, requests, *, sampling, version, generator=None, token_budget=None):
        first = [r for r in requests if r.episode["turns"] == 0]
        later = [r for r in requests if r.episode["turns"] > 0]
        outs = {r.sample_id: Completion(
            sample_id=r.sample_id, prompt_ids=r.prompt_ids, completion_ids=r.completion_ids + self.call_ids,
            logprobs=r.logprobs + [-0.5] * len(self.call_ids), versions=r.versions + [version] * len(self.call_ids),
            finish_reason="stop", loss_mask=sampled_mask(r) + [1] * len(self.call_ids), episode=dict(r.episode))
            for r in first}
        if later:
            outs.update({o.sample_id: o for o in self.engine.generate(later, sampling=sampling, version=version)})
        return [outs[r.sample_id] for r in requests]

    def weights_updated(self, model) -> None: ...

    def close(self) -> None: ...


@pytest.mark.parametrize("num_workers", [0, 1])
def test_a_tool_call_trains_the_sampled_ids_and_never_the_observation(num_workers):
    tokenizer = qwen_tokenizer()
    model = tiny_qwen2(tokenizer)
    engine = TorchEngine(model, eos_token_ids=[tokenizer.eos_token_id], pad_token_id=tokenizer.pad_token_id)
    reference = "tools:" + TOOLS
    environment = build_environment(reference)
    prompt = presenting_tools(build_chat_prompt, environment.chat_tools())(tokenizer, "How many cm in 2 m?")
    call_ids = tokenizer("I will convert.\n" + CALL + "<|im_end|>", add_special_tokens=False)["input_ids"]
    assert call_ids[-1] == tokenizer.eos_token_id  # the call message ends as any message: at EOS
    tools = ToolRunner(reference, timeout_s=30.0, num_workers=num_workers)
    runner = EpisodeRunner(ForcedToolCall(engine, call_ids), environment=environment, tools=tools,
                           tokenizer=tokenizer, max_turns=3,
                           problem_of=lambda sample_id: Problem(question="How many cm in 2 m?", answer="200"))
    try:
        out = runner.generate([Request(sample_id=0, prompt_ids=prompt)],
                              sampling=SamplingParams(temperature=0.0, max_new_tokens=160), version=4)[0]
    finally:
        runner.close()
    obs_text = "\n<|im_start|>user\n<tool_response>\n200.0\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    obs = tokenizer(obs_text, add_special_tokens=False)["input_ids"]
    # The answer turn: what the bare engine samples (greedy) after the call and the observation.
    answer = engine.generate([Request(sample_id=0, prompt_ids=prompt + call_ids + obs)], version=4, sampling=SamplingParams(
        temperature=0.0, max_new_tokens=160 - len(call_ids) - len(obs)))[0].completion_ids
    assert answer and out.completion_ids == call_ids + obs + answer  # id by id
    assert out.loss_mask == [1] * len(call_ids) + [0] * len(obs) + [1] * len(answer)
    assert out.versions == [4] * len(call_ids) + [-1] * len(obs) + [4] * len(answer)
    assert out.episode["turns"] == 1 and out.episode["state"] == {"calls": 1}
    assert tools.counts() == {"calls": 1, "errors": 0, "timeouts": 0}
    batch = completions_to_batch([out], group_ids=[0], references=["200"], texts=["x"],
                                 pad_token_id=tokenizer.pad_token_id, group_size=1)
    p, n = len(prompt), len(out.completion_ids)
    assert batch["input_ids"][0, : p + n].tolist() == prompt + call_ids + obs + answer
    assert batch["loss_mask"][0, p : p + n].tolist() == out.loss_mask
    # Training on it: no gradient reaches the log-probs of the observation's positions.
    from llamarl.algorithms.losses import aipo_loss

    ids, mask = batch["input_ids"], batch["loss_mask"].bool()
    logits = model(input_ids=ids).logits[:, :-1].float()
    shifted = torch.log_softmax(logits, dim=-1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    logp = torch.cat([torch.zeros_like(shifted[:, :1]), shifted], dim=1)
    logp.retain_grad()
    loss, _ = aipo_loss(logp=logp, behav_logp=batch["behav_logp"], advantages=torch.ones_like(logp), mask=mask)
    loss.backward()
    observation = torch.zeros_like(mask)
    observation[0, p + len(call_ids): p + len(call_ids) + len(obs)] = True
    assert (logp.grad[observation] == 0).all() and (logp.grad[mask] != 0).any()


def test_a_call_the_model_gets_wrong_or_a_tool_that_raises_is_a_counted_tool_error():
    environment = FunctionToolsEnvironment.from_reference(TOOLS)
    runner = ToolRunner("tools:" + TOOLS, timeout_s=5.0, num_workers=0)
    turns = runner.run([
        ({"calls": 0}, '<tool_call>\n{"name": "teleport", "arguments": {}}\n</tool_call>'),
        ({"calls": 0}, "<tool_call>\n{not json\n</tool_call>"),
        ({"calls": 0}, CALL.replace('"cm"', '"mile"')),  # KeyError inside the tool
        ({"calls": 2}, '<tool_call>\n{"name": "shout", "arguments": {"text": "hi"}}\n</tool_call>'),
    ])
    assert turns[0].observation == "[tool error: ValueError: unknown tool 'teleport'; the tools are ['convert', 'shout']]"
    assert turns[1].observation.startswith("[tool error: ValueError: the tool call is not JSON")
    assert turns[2].observation == "[tool error: KeyError: 'mile']" and turns[2].state == {"calls": 0}
    assert turns[3] == Turn(observation="HI", state={"calls": 3})
    assert runner.counts() == {"calls": 4, "errors": 3, "timeouts": 0}
    assert environment.step({"calls": 0}, CALL).observation == "200.0"


@pytest.mark.parametrize("num_workers", [0, 1])
@pytest.mark.parametrize(("name", "match"), [
    ("tools_for_tests:WrongStepType",
     r"^environment 'tools_for_tests:WrongStepType': step returned a dict, expected a Turn"),
    ("tools_for_tests:NonJsonStepState",
     r"^environment 'tools_for_tests:NonJsonStepState': step returned a state that is not JSON"),
])
def test_a_step_breaking_the_contract_stops_the_run_with_one_line(name, match, num_workers):
    runner = ToolRunner(name, timeout_s=5.0, num_workers=num_workers)
    try:
        with pytest.raises(EnvironmentContractError, match=match) as info:
            runner.run([({"n": 0}, "1+1=")])
    finally:
        runner.close()
    assert "\n" not in str(info.value) and runner.num_errors == 0


def test_a_reset_with_a_state_that_is_not_json_stops_the_run_with_one_line():
    tokenizer = qwen_tokenizer()
    name = "tools_for_tests:NonJsonState"
    runner = EpisodeRunner(_NeverCalled(), environment=build_environment(name),
                           tools=ToolRunner(name, timeout_s=5.0, num_workers=0), tokenizer=tokenizer, max_turns=2,
                           problem_of=lambda sample_id: Problem(question="q", answer="a"))
    with pytest.raises(EnvironmentContractError,
                       match=r"^environment 'tools_for_tests:NonJsonState': reset returned a state that is not JSON"):
        runner.generate([Request(sample_id=0, prompt_ids=[1])], sampling=SamplingParams(max_new_tokens=4), version=0)


class _NeverCalled:
    pad_token_id = 0

    def generate(self, *args, **kwargs):
        raise AssertionError("the engine must not run: reset already failed")


def test_a_schema_naming_an_unknown_tool_is_a_programming_error():
    with pytest.raises(EnvironmentContractError, match=r"environment 'mine': chat_tools names the tool 'teleport', "
                                                       r"which is not one of its functions \['convert'\]"):
        FunctionToolsEnvironment([convert], schemas=[{"type": "function", "function": {"name": "teleport"}}], name="mine")

    class NoName:
        def chat_tools(self):
            return [{"type": "function", "function": {"description": "x"}}]

    with pytest.raises(EnvironmentContractError, match=r"environment 'no_name': chat_tools has a schema without"):
        check_tool_schemas("no_name", NoName())
