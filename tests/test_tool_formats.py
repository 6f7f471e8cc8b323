"""Tool-call formats (llamarl/environments/tool_formats.py): each registered parser reads several
calls of one turn, refuses a malformed one in one line (answered as a counted tool error), is
chosen from the chat template (or named); the tools environment runs every call of a turn and
its answers are that many tool messages, rendered by the template after the call message's EOS.

The Llama-3.1 and Mistral templates here are stand-ins with their formats' markers and message
layout (the real ones are long); Qwen2.5's is the real one (tools_for_tests.py)."""

from __future__ import annotations

import copy
import json
from types import SimpleNamespace

import pytest
from tools_for_tests import plain_chat_tokenizer, qwen_tokenizer

from llamarl.environments.base import Turn
from llamarl.environments.building import build_environment
from llamarl.environments.config import EnvConfig
from llamarl.environments.function_tools import tool_observation, tool_observation_segments, tools_reference
from llamarl.environments.tool_formats import (
    TOOL_FORMATS,
    ToolCall,
    ToolFormat,
    choose_tool_format,
    register_tool_format,
)
from llamarl.environments.tool_workers import ToolRunner
from llamarl.rl.config_checks import check_environment

TOOLS = "tools_for_tests:convert,tools_for_tests:shout"
CONVERT = ToolCall("convert", {"value": 2, "from_unit": "m", "to_unit": "cm"})
SHOUT = ToolCall("shout", {"text": "hi"})

LLAMA31_STAND_IN = (
    "{{- bos_token }}{%- for message in messages %}"
    "{%- if message.role == 'assistant' and message.tool_calls %}"
    "{%- if message.tool_calls | length != 1 %}{{- raise_exception('This model only supports single tool-calls at once!') }}{%- endif %}"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
    "{{- '{\"name\": \"' + message.tool_calls[0].function.name + '\", \"parameters\": ' }}"
    "{{- message.tool_calls[0].function.arguments | tojson }}{{- '}<|eot_id|>' }}"
    "{%- elif message.role == 'tool' or message.role == 'ipython' %}"
    "{{- '<|start_header_id|>ipython<|end_header_id|>\\n\\n' + message.content + '<|eot_id|>' }}"
    "{%- else %}{{- '<|start_header_id|>' + message.role + '<|end_header_id|>\\n\\n' + message.content + '<|eot_id|>' }}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
    "{#- tools: the tools are listed in the first user message -#}")
MISTRAL_STAND_IN = (
    "{{- bos_token }}{%- for message in messages %}"
    "{%- if message.role == 'user' %}{{- '[INST] ' + message.content + '[/INST]' }}"
    "{%- elif message.role == 'assistant' and message.tool_calls %}{{- '[TOOL_CALLS][' }}"
    "{%- for call in message.tool_calls %}{{- '{\"name\": \"' + call.function.name + '\", \"arguments\": ' }}"
    "{{- call.function.arguments | tojson }}{{- ', \"id\": \"' + call.id + '\"}' }}{%- if not loop.last %}, {% endif %}"
    "{%- endfor %}{{- ']' + eos_token }}"
    "{%- elif message.role == 'tool' %}{{- '[TOOL_RESULTS]{\"content\": ' + message.content | string + ', \"call_id\": \"'"
    " + message.tool_call_id + '\"}[/TOOL_RESULTS]' }}"
    "{%- else %}{{- message.content + eos_token }}{%- endif %}{%- endfor %}"
    "{#- tools: [AVAILABLE_TOOLS] -#}")


def tokenizer_with(template: str, *, eos: str):
    tokenizer = copy.deepcopy(plain_chat_tokenizer())
    tokenizer.add_special_tokens({"eos_token": eos})
    tokenizer.chat_template = template
    return tokenizer


@pytest.mark.parametrize(("name", "turn"), [
    ("hermes", ('Let me.\n<tool_call>\n{"name": "convert", "arguments": {"value": 2, "from_unit": "m", "to_unit": "cm"}}\n'
               '</tool_call>\n<tool_call>\n{"name": "shout", "arguments": "{\\"text\\": \\"hi\\"}"}\n</tool_call><|im_end|>')),
    ("llama3", ('<|python_tag|>{"name": "convert", "parameters": {"value": 2, "from_unit": "m", "to_unit": "cm"}}; '
               '{"name": "shout", "parameters": {"text": "hi"}}<|eom_id|>')),
    ("llama3", ('[{"name": "convert", "parameters": {"value": 2, "from_unit": "m", "to_unit": "cm"}},\n'
               '{"name": "shout", "arguments": {"text": "hi"}}]<|eot_id|>')),
    ("mistral", ('[TOOL_CALLS][{"name": "convert", "arguments": {"value": 2, "from_unit": "m", "to_unit": "cm"}}, '
                '{"name": "shout", "arguments": {"text": "hi"}}]</s>')),
    ("mistral", ('[TOOL_CALLS]convert[ARGS]{"value": 2, "from_unit": "m", "to_unit": "cm"}'
                '[TOOL_CALLS]shout[ARGS]{"text": "hi"}</s>')),
])
def test_each_format_reads_several_calls_of_one_turn(name, turn):
    fmt = TOOL_FORMATS.get(name)
    assert fmt.is_call(turn) and fmt.parse(turn) == [CONVERT, SHOUT]
    assert fmt.parse(fmt.render([CONVERT, SHOUT])) == [CONVERT, SHOUT]  # what it writes, it reads
    assert not fmt.is_call("The answer is 200 cm.<|im_end|>")


@pytest.mark.parametrize(("name", "turn", "match"), [
    ("hermes", "<tool_call>\n{not json\n</tool_call>", r"^the tool call is not JSON"),
    ("hermes", '<tool_call>\n{"arguments": {}}\n</tool_call>', r'^a tool call needs \{"name"'),
    ("llama3", '{"name": "shout", "parameters": [1]}<|eot_id|>', r"^the arguments of 'shout' must be a JSON object"),
    ("mistral", "[TOOL_CALLS][{\"name\": \"shout\", ", r"^the tool call is not JSON"),
    ("mistral", "no marker", r"^no \[TOOL_CALLS\] in the turn"),
])
def test_a_malformed_call_is_one_line(name, turn, match):
    with pytest.raises(ValueError, match=match) as info:
        TOOL_FORMATS.get(name).parse(turn)
    assert "\n" not in str(info.value)


def test_the_format_is_chosen_from_the_chat_template_or_named():
    llama = SimpleNamespace(chat_template=LLAMA31_STAND_IN)
    mistral = SimpleNamespace(chat_template=MISTRAL_STAND_IN)
    assert choose_tool_format(qwen_tokenizer()).name == "hermes"
    assert choose_tool_format(plain_chat_tokenizer()).name == "hermes"  # no tool support: the default format
    assert choose_tool_format(llama).name == "llama3" and choose_tool_format(mistral).name == "mistral"
    assert choose_tool_format(qwen_tokenizer(), "mistral").name == "mistral"
    with pytest.raises(ValueError, match=r"unknown tool format 'xml'; registered: hermes, llama3, mistral"):
        choose_tool_format(qwen_tokenizer(), "xml")
    with pytest.raises(ValueError, match=r"^--env.tool-format: unknown tool format 'xml'"):
        check_environment(EnvConfig(tools=TOOLS, tool_format="xml"))
    with pytest.raises(ValueError, match=r"--env.tool-format mistral applies to --env.tools"):
        EnvConfig(tool_format="mistral")


def test_a_registered_format_is_used_by_the_tools_environment():
    class Bang(ToolFormat):
        name = "bang"

        def is_call(self, turn):
            return turn.startswith("!")

        def parse(self, turn):
            return [ToolCall(part.split()[0], {"text": part.split()[1]}) for part in turn[1:].split("!")]

    saved = dict(TOOL_FORMATS._items)
    try:
        register_tool_format("bang", Bang())
        env = build_environment(tools_reference(TOOLS, tool_format="bang"))
        assert env.is_call("!shout a!shout b")
        assert env.step({"calls": 0}, "!shout a!shout b") == Turn(observation="A\nB", tool_results=["A", "B"],
                                                                  state={"calls": 2})
    finally:
        TOOL_FORMATS._items = saved


@pytest.mark.parametrize("name", ["hermes", "llama3", "mistral"])
def test_every_call_of_a_turn_runs_and_a_malformed_one_is_a_counted_error(name):
    fmt = TOOL_FORMATS.get(name)
    reference = tools_reference(TOOLS, tool_format=name)
    runner = ToolRunner(reference, timeout_s=5.0, num_workers=0)
    turns = runner.run([({"calls": 1}, fmt.render([CONVERT, SHOUT])),
                        ({"calls": 1}, fmt.render([ToolCall("teleport", {})])),
                        ({"calls": 1}, fmt.render([CONVERT])[:-3])])
    assert turns[0] == Turn(observation="200.0\nHI", tool_results=["200.0", "HI"], state={"calls": 3})
    assert turns[1].observation.startswith("[tool error: ValueError: unknown tool 'teleport'")
    assert turns[2].error is not None and turns[2].state == {"calls": 1}
    assert runner.counts() == {"calls": 3, "errors": 2, "timeouts": 0}


def test_several_answers_are_that_many_tool_messages_after_the_call_messages_end():
    schemas = build_environment("tools:" + TOOLS).chat_tools()
    # Qwen2.5: consecutive tool messages in one user message, after the call message's <|im_end|>.
    segments = tool_observation_segments(qwen_tokenizer(), schemas, count=2)
    assert tool_observation(segments, ["200.0", "HI"]) == (
        "\n<|im_start|>user\n<tool_response>\n200.0\n</tool_response>\n<tool_response>\nHI\n</tool_response>"
        "<|im_end|>\n<|im_start|>assistant\n")
    # The default format (no tool support in the template): the same blocks in a user message.
    assert tool_observation(tool_observation_segments(plain_chat_tokenizer(), schemas, count=2), ["200.0", "HI"]) == (
        "\n<|im_start|>user\n<tool_response>\n200.0\n</tool_response>\n<tool_response>\nHI\n</tool_response>"
        "<|im_end|>\n<|im_start|>assistant\n")
    # Mistral: one [TOOL_RESULTS] per answer after the calls' </s>.
    mistral = tokenizer_with(MISTRAL_STAND_IN, eos="</s>")
    assert tool_observation(tool_observation_segments(mistral, schemas, count=2), ["200.0", "HI"]) == (
        '[TOOL_RESULTS]{"content": 200.0, "call_id": "c00000000"}[/TOOL_RESULTS]'
        '[TOOL_RESULTS]{"content": HI, "call_id": "c00000001"}[/TOOL_RESULTS]')
    # Llama-3.1 refuses two calls in one message: the answers share one ipython message.
    llama = tokenizer_with(LLAMA31_STAND_IN, eos="<|eot_id|>")
    assert tool_observation(tool_observation_segments(llama, schemas, count=2), ["200.0", "HI"]) == (
        "<|start_header_id|>ipython<|end_header_id|>\n\n200.0\nHI<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n")
    assert json.loads(json.dumps(schemas))  # untouched


def test_the_default_models_tokenizer_takes_tools_though_it_splits_the_tags():
    """SmolLM2's tokenizer splits ``</tool_call>`` into several tokens and its template has no tool
    support: the default format, whose call message ends at ``<|im_end|>`` (EOS), answers it."""
    from model_families import chat_tokenizer

    from llamarl.environments.base import observation_ids
    from llamarl.environments.episode_engine import EpisodeRunner

    tokenizer = chat_tokenizer()
    assert len(observation_ids(tokenizer, "</tool_call>")) > 1
    assert choose_tool_format(tokenizer).name == "hermes"
    runner = EpisodeRunner(SimpleNamespace(pad_token_id=0), environment=build_environment("tools:" + TOOLS),
                           tools=ToolRunner("tools:" + TOOLS, timeout_s=5.0, num_workers=0), tokenizer=tokenizer,
                           max_turns=2, problem_of=lambda sample_id: None)
    assert runner.turn_stop_ids == [] and runner.calls_at_end is not None
    assert runner._frame(1) == ["\n<|im_start|>user\n<tool_response>\n",
                                "\n</tool_response><|im_end|>\n<|im_start|>assistant\n"]
