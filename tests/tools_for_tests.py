"""Tool functions, broken environments and a Qwen2-family chat tokenizer for tests/test_function_tools.py
(importable by "tools_for_tests:NAME" in tool workers and flags)."""

from __future__ import annotations

import functools

from llamarl.environments.base import Turn

# Qwen2.5-Instruct's chat template (tokenizer_config.json of Qwen/Qwen2.5-*-Instruct), tools included.
QWEN25_CHAT_TEMPLATE = (
    "{%- if tools %}\n"
    "    {{- '<|im_start|>system\\n' }}\n"
    "    {%- if messages[0]['role'] == 'system' %}\n"
    "        {{- messages[0]['content'] }}\n"
    "    {%- else %}\n"
    "        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}\n"
    "    {%- endif %}\n"
    "    {{- \"\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are "
    "provided with function signatures within <tools></tools> XML tags:\\n<tools>\" }}\n"
    "    {%- for tool in tools %}\n"
    "        {{- \"\\n\" }}\n"
    "        {{- tool | tojson }}\n"
    "    {%- endfor %}\n"
    "    {{- \"\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments "
    "within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\\"name\\\": <function-name>, \\\"arguments\\\": "
    "<args-json-object>}\\n</tool_call><|im_end|>\\n\" }}\n"
    "{%- else %}\n"
    "    {%- if messages[0]['role'] == 'system' %}\n"
    "        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}\n"
    "    {%- else %}\n"
    "        {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful "
    "assistant.<|im_end|>\\n' }}\n"
    "    {%- endif %}\n"
    "{%- endif %}\n"
    "{%- for message in messages %}\n"
    "    {%- if (message.role == \"user\") or (message.role == \"system\" and not loop.first) or "
    "(message.role == \"assistant\" and not message.tool_calls) %}\n"
    "        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}\n"
    "    {%- elif message.role == \"assistant\" %}\n"
    "        {{- '<|im_start|>' + message.role }}\n"
    "        {%- if message.content %}\n"
    "            {{- '\\n' + message.content }}\n"
    "        {%- endif %}\n"
    "        {%- for tool_call in message.tool_calls %}\n"
    "            {%- if tool_call.function is defined %}\n"
    "                {%- set tool_call = tool_call.function %}\n"
    "            {%- endif %}\n"
    "            {{- '\\n<tool_call>\\n{\"name\": \"' }}\n"
    "            {{- tool_call.name }}\n"
    "            {{- '\", \"arguments\": ' }}\n"
    "            {{- tool_call.arguments | tojson }}\n"
    "            {{- '}\\n</tool_call>' }}\n"
    "        {%- endfor %}\n"
    "        {{- '<|im_end|>\\n' }}\n"
    "    {%- elif message.role == \"tool\" %}\n"
    "        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != \"tool\") %}\n"
    "            {{- '<|im_start|>user' }}\n"
    "        {%- endif %}\n"
    "        {{- '\\n<tool_response>\\n' }}\n"
    "        {{- message.content }}\n"
    "        {{- '\\n</tool_response>' }}\n"
    "        {%- if loop.last or (messages[loop.index0 + 1].role != \"tool\") %}\n"
    "            {{- '<|im_end|>\\n' }}\n"
    "        {%- endif %}\n"
    "    {%- endif %}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n"
    "    {{- '<|im_start|>assistant\\n' }}\n"
    "{%- endif %}\n"
)


@functools.cache
def _tokenizer(template: str | None):
    import copy

    from model_families import chat_tokenizer

    tokenizer = copy.deepcopy(chat_tokenizer())  # SmolLM2's BPE, with <|im_start|> and <|im_end|> (EOS)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<tool_call>", "</tool_call>"]})
    if template is not None:
        tokenizer.chat_template = template
    return tokenizer


def qwen_tokenizer():
    """A tokenizer with Qwen2.5's chat template and its special tokens ``<|im_start|>``, ``<|im_end|>``
    (EOS), ``<tool_call>``, ``</tool_call>`` (each one token)."""
    return _tokenizer(QWEN25_CHAT_TEMPLATE)


def plain_chat_tokenizer():
    """The same tokens with SmolLM2's ChatML template, which has no tool support (the default format)."""
    return _tokenizer(None)


def tiny_qwen2(tokenizer, *, seed: int = 0):
    """A random fp32 Qwen2 (hidden 32, 2 layers) sized for ``tokenizer``, eval mode."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, intermediate_size=64, max_position_embeddings=512,
                         tie_word_embeddings=True, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(config)
    return model.to(torch.float32).eval()


def convert(value: float, from_unit: str, to_unit: str) -> float:
    """Convert a length between units.

    Args:
        value: The length to convert.
        from_unit: The unit of ``value`` (m, cm or km).
        to_unit: The unit to convert to (m, cm or km).
    """
    scale = {"m": 1.0, "cm": 0.01, "km": 1000.0}
    return value * scale[from_unit] / scale[to_unit]


def shout(text: str) -> str:
    """Upper-case a text.

    Args:
        text: The text.
    """
    return text.upper()


def no_docstring(x: int) -> int:
    return x


def no_type_hints(x):
    """Echo.

    Args:
        x: anything.
    """
    return x


class WrongStepType:
    """``step`` returns a dict, not a Turn: a programming error."""

    def stop_texts(self) -> list[str]:
        return ["="]

    def end_texts(self) -> list[str]:
        return []

    def reset(self, problem) -> dict:
        return {"n": 0}

    def step(self, state: dict, turn: str):
        return {"observation": " 1", "state": state}


class NonJsonState(WrongStepType):
    """``reset`` returns a state holding a set: not JSON."""

    def reset(self, problem) -> dict:
        return {"seen": {1, 2}}

    def step(self, state: dict, turn: str) -> Turn:
        return Turn(observation=" 1", state=state)


class NonJsonStepState(WrongStepType):
    """``step`` returns a Turn whose state holds an object: not JSON."""

    def step(self, state: dict, turn: str) -> Turn:
        return Turn(observation=" 1", state={"when": object()})


class NotAnEnvironment:
    """No contract methods."""
