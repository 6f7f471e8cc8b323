"""Tools as plain Python functions, presented and called through the model's chat template.

``--env.tools module:fn[,module:fn2...]`` makes the environment ``FunctionToolsEnvironment`` of
those functions, as TRL's ``GRPOTrainer(tools=[fn])`` takes them (the same function works in both):

- **Schema**: each function's JSON schema comes from its signature and docstring
  (``transformers.utils.get_json_schema``: type hints on every argument, a docstring with an
  ``Args:`` entry for each). A function it refuses is a one-line error at flag parsing.
- **Prompt**: the generator builds every prompt through the recipe's prompt function with the
  tools added to the chat template call (``apply_chat_template(messages, tools=schemas, ...)``,
  ``presenting_tools``). A template without tool support (no ``tools`` in its text) gets the
  default format instead: a system message (``DEFAULT_TOOLS_SYSTEM``) listing the schemas and
  asking for ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``, Qwen's format.
- **Calls**: a policy turn ends at ``</tool_call>`` (``stop_texts``: one special token in the
  tokenizers of Qwen2, Qwen2.5 and Qwen3; a tokenizer that splits it into several tokens is a
  one-line error when the generator starts). ``step`` parses the last ``<tool_call>`` JSON of the
  turn and calls the function with its arguments, in the tool workers (timeouts, JSON over pipes).
  A call the model got wrong (no JSON, an unknown function, bad arguments) and an exception
  inside the function are tool errors: counted (``env_tool_errors``) and answered
  ``[tool error: ...]``, the episode goes on.
- **Answers**: the function's return value (a string as is, anything else as JSON) is the content
  of a ``role: "tool"`` message; the observation appended after the policy's sampled tokens is
  what the template renders from the end of the tool call to the next assistant header
  (``tool_observation_format``), e.g. for Qwen2.5
  ``<|im_end|>\\n<|im_start|>user\\n<tool_response>\\n42\\n</tool_response><|im_end|>\\n<|im_start|>assistant\\n``.
  Default format: a ``user`` message with the content inside ``<tool_response>`` tags.
  Token in, token out: the trained ids are the sampled ids; the observation ids (loss mask 0) follow.

The episode ends when the policy ends its message (EOS: ``<|im_end|>``), at ``--env.max-turns``
or at the token budget. Its state counts the calls (``{"calls": n}``). Reward the final answer
with a scorer of the transcript or a trajectory scorer (``--reward.trajectory-scorer``): no
``step`` sees it.
"""

from __future__ import annotations

import json
from collections.abc import Callable

from llamarl.data.prompts import Problem
from llamarl.environments.base import EnvironmentContractError, Turn
from llamarl.registry import import_path

TOOL_CALL_START = "<tool_call>"
TOOL_CALL_END = "</tool_call>"
REFERENCE_PREFIX = "tools:"
"""``build_environment("tools:module:fn,module:fn2")`` builds ``FunctionToolsEnvironment`` of those
functions (what ``--env.tools`` selects)."""

DEFAULT_TOOLS_SYSTEM = (
    "You may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{tools}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{{"name": <function-name>, "arguments": <args-json-object>}}\n</tool_call>')
"""The system message of the default format (a chat template without tool support), ``{tools}``
the schemas one JSON per line: Qwen2.5's own wording."""

_PLACEHOLDER = "\x00llamarl-tool-result\x00"


def tool_schema(function: Callable, *, reference: str | None = None) -> dict:
    """``function``'s JSON schema as the chat template takes it (``get_json_schema``); ValueError, one
    line naming ``reference`` (the flag's ``module:fn``), when it has no type hints or docstring."""
    from transformers.utils import get_json_schema

    try:
        return get_json_schema(function)
    except Exception as exc:  # noqa: BLE001 - DocstringParsingException, TypeHintParsingException, ...
        name = reference or getattr(function, "__name__", repr(function))
        raise ValueError(f"--env.tools {name}: {exc} (a tool needs type hints on every argument and a "
                         "docstring with an Args: line for each, as for TRL's tools=)") from None


def resolve_tools(spec: str) -> list[Callable]:
    """The functions ``--env.tools`` names (``module:fn[,module:fn2...]``), each checked for a schema;
    ValueError, one line, for an unknown module or function, a duplicate name or a function
    ``get_json_schema`` refuses."""
    references = [part.strip() for part in spec.split(",")]
    if not spec.strip() or any(":" not in ref or not all(ref.partition(":")[::2]) for ref in references):
        raise ValueError(f"--env.tools takes module:function[,module:function...], got {spec!r}")
    functions, names = [], set()
    for ref in references:
        try:
            function = import_path(ref, kind="tool function")
        except ValueError as exc:
            raise ValueError(f"--env.tools: {exc}") from None
        name = tool_schema(function, reference=ref)["function"]["name"]
        if name in names:
            raise ValueError(f"--env.tools: two tools are called {name!r}")
        names.add(name)
        functions.append(function)
    return functions


def _schema_name(schema) -> str | None:
    function = schema.get("function") if isinstance(schema, dict) else None
    name = function.get("name") if isinstance(function, dict) else None
    return name if isinstance(name, str) and name else None


class FunctionToolsEnvironment:
    """See the module docstring. ``schemas``: one per function, to replace the generated ones (each
    must name one of ``functions``)."""

    def __init__(self, functions: list[Callable], *, schemas: list[dict] | None = None,
                 name: str = "function tools") -> None:
        if not functions:
            raise ValueError("a tool environment needs at least one function")
        self.name = name
        self.functions = {tool_schema(f)["function"]["name"] if schemas is None else f.__name__: f
                          for f in functions}
        self.schemas = [tool_schema(f) for f in functions] if schemas is None else list(schemas)
        for schema in self.schemas:
            schema_name = _schema_name(schema)
            if schema_name is None:
                raise EnvironmentContractError(
                    f"environment {self.name!r}: chat_tools has a schema without function.name: {schema!r}")
            if schema_name not in self.functions:
                raise EnvironmentContractError(
                    f"environment {self.name!r}: chat_tools names the tool {schema_name!r}, which is not one of "
                    f"its functions {sorted(self.functions)}")

    @classmethod
    def from_reference(cls, reference: str) -> FunctionToolsEnvironment:
        """The environment of ``tools:module:fn,...`` (``REFERENCE_PREFIX`` optional)."""
        spec = reference.removeprefix(REFERENCE_PREFIX)
        return cls(resolve_tools(spec), name=REFERENCE_PREFIX + spec)

    def chat_tools(self) -> list[dict]:
        return self.schemas

    def stop_texts(self) -> list[str]:
        return [TOOL_CALL_END]

    def end_texts(self) -> list[str]:
        return []

    def reset(self, problem: Problem) -> dict:
        return {"calls": 0}

    def step(self, state: dict, turn: str) -> Turn:
        """Run the last tool call of ``turn``; a malformed call or an unknown tool raises (a tool
        error, counted and answered by the tool runner)."""
        start = turn.rfind(TOOL_CALL_START)
        if start < 0:
            raise ValueError(f"no {TOOL_CALL_START} in the turn")
        body = turn[start + len(TOOL_CALL_START):]
        body = body[: body.rfind(TOOL_CALL_END)] if TOOL_CALL_END in body else body
        try:
            call = json.loads(body.strip())
        except json.JSONDecodeError as exc:
            raise ValueError(f"the tool call is not JSON ({exc.msg})") from None
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            raise ValueError('the tool call needs {"name": ..., "arguments": {...}}')  # noqa: TRY004 - the model's error
        arguments = call.get("arguments", {})
        if isinstance(arguments, str):  # some models write the arguments as a JSON string
            arguments = json.loads(arguments)
        if not isinstance(arguments, dict):
            raise ValueError("the tool call's arguments must be a JSON object")  # noqa: TRY004 - the model's error
        function = self.functions.get(call["name"])
        if function is None:
            raise ValueError(f"unknown tool {call['name']!r}; the tools are {sorted(self.functions)}")
        result = function(**arguments)
        text = result if isinstance(result, str) else json.dumps(result)
        return Turn(observation=text, state={"calls": int(state.get("calls", 0)) + 1})


def template_supports_tools(tokenizer) -> bool:
    """Whether the tokenizer's chat template reads ``tools`` (else the default format is used)."""
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):
        template = " ".join(str(t) for t in template.values())
    return isinstance(template, str) and "tools" in template


def default_tools_system(schemas: list[dict]) -> str:
    return DEFAULT_TOOLS_SYSTEM.format(tools="\n".join(json.dumps(s) for s in schemas))


def _with_default_system(messages: list[dict], schemas: list[dict]) -> list[dict]:
    system = default_tools_system(schemas)
    messages = [dict(m) for m in messages]
    if messages and messages[0].get("role") == "system":
        messages[0]["content"] = f"{messages[0]['content']}\n\n{system}"
        return messages
    return [{"role": "system", "content": system}, *messages]


class _ToolsTokenizer:
    """The tokenizer as a recipe's prompt function sees it under ``presenting_tools``: its
    ``apply_chat_template`` presents the tools; everything else is the tokenizer's."""

    def __init__(self, tokenizer, schemas: list[dict]) -> None:
        self._tokenizer, self._schemas, self.used_template = tokenizer, schemas, False

    def apply_chat_template(self, conversation, *args, **kwargs):
        self.used_template = True
        if template_supports_tools(self._tokenizer):
            kwargs.setdefault("tools", self._schemas)
        else:
            conversation = _with_default_system(conversation, self._schemas)
        return self._tokenizer.apply_chat_template(conversation, *args, **kwargs)

    def __call__(self, *args, **kwargs):
        return self._tokenizer(*args, **kwargs)

    def __getattr__(self, name: str):
        return getattr(self._tokenizer, name)


def presenting_tools(prompt_fn: Callable, schemas: list[dict]) -> Callable:
    """``prompt_fn`` (``(tokenizer, question) -> ids``) with the tools in its chat template call
    (module docstring); ValueError when it builds a prompt without the chat template (the tools
    would be shown nowhere)."""

    def prompt_with_tools(tokenizer, question: str) -> list[int]:
        view = _ToolsTokenizer(tokenizer, schemas)
        ids = prompt_fn(view, question)
        if not view.used_template:
            raise ValueError("--env.tools presents the tools through the chat template, but the recipe's prompt "
                             "function did not call apply_chat_template (no chat template, or a plain-text prompt): "
                             "use a model with a chat template, or describe the tools in the prompt and write an "
                             "environment class (docs/write_your_own_environment.md)")
        return ids

    return prompt_with_tools


def tool_observation_format(tokenizer, schemas: list[dict]) -> tuple[str, str]:
    """``(before, after)``: the observation of a tool answer ``content`` is ``before + content + after``,
    the text the chat template renders after a tool call (from its ``</tool_call>``) through the tool
    message to the next assistant header; the default format's (a ``user`` message with
    ``<tool_response>`` tags) for a template without tool support. EnvironmentContractError when the
    template renders no ``</tool_call>`` before the tool message."""
    name = _schema_name(schemas[0]) if schemas else "tool"
    user = {"role": "user", "content": "q"}
    if template_supports_tools(tokenizer):
        call = {"type": "function", "function": {"name": name, "arguments": {}}}
        messages = [user, {"role": "assistant", "content": "", "tool_calls": [call]},
                    {"role": "tool", "name": name, "content": _PLACEHOLDER}]
        text = tokenizer.apply_chat_template(messages, tools=schemas, tokenize=False, add_generation_prompt=True)
    else:
        call_text = f'{TOOL_CALL_START}\n{{"name": "{name}", "arguments": {{}}}}\n{TOOL_CALL_END}'
        messages = [user, {"role": "assistant", "content": call_text},
                    {"role": "user", "content": f"<tool_response>\n{_PLACEHOLDER}\n</tool_response>"}]
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    at = text.find(_PLACEHOLDER)
    end = text.rfind(TOOL_CALL_END, 0, max(at, 0))
    if at < 0 or end < 0:
        raise EnvironmentContractError(f"the chat template renders no {TOOL_CALL_END} before a tool message: it cannot "
                                       "answer tool calls (use a template with Qwen's tool format, or an environment "
                                       "class of your own)")
    return text[end + len(TOOL_CALL_END):at], text[at + len(_PLACEHOLDER):]
