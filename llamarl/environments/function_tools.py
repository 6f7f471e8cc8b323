"""Tools as plain Python functions, presented and called through the model's chat template.

``--env.tools module:fn[,module:fn2...]`` makes the environment ``FunctionToolsEnvironment`` of
those functions, as TRL's ``GRPOTrainer(tools=[fn])`` takes them (the same function works in both):

- **Schema**: each function's JSON schema comes from its signature and docstring
  (``transformers.utils.get_json_schema``: type hints on every argument, a docstring with an
  ``Args:`` entry for each). A function it refuses is a one-line error at flag parsing.
- **Prompt**: the generator builds every prompt through the recipe's prompt function with the
  tools added to the chat template call (``apply_chat_template(messages, tools=schemas, ...)``,
  ``presenting_tools``). A template without tool support (no ``tools`` in its text) gets the
  default format instead: a system message (``DEFAULT_TOOLS_SYSTEM``; the first user message's
  opening for a template without a system role, Gemma-2's) listing the schemas and asking for
  ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``, Qwen's format.
- **Calls**: in the format the chat template speaks (llamarl/environments/tool_formats.py: Qwen /
  Hermes ``<tool_call>`` JSON, Llama-3.1 / 3.2 JSON, Mistral ``[TOOL_CALLS]``; the default format,
  Hermes', for templates with none), or the one ``--env.tool-format`` names. A policy turn ends as
  the template ends an assistant message, at EOS; a turn that holds calls (``is_call``) is not the
  answer: ``step`` parses every call of it and calls each function with its arguments, in order,
  in the tool workers (timeouts, JSON over pipes). No token of a format has to be one token of the
  tokenizer (SmolLM2 splits ``</tool_call>`` into five). A call the model got wrong (no JSON, an
  unknown function, bad arguments) and an exception inside a function are tool errors: counted
  (``env_tool_errors``) and answered ``[tool error: ...]``, the episode goes on.
- **Answers**: each function's return value (a string as is, anything else as JSON) is the content
  of a ``role: "tool"`` message, one per call (``Turn.tool_results``); the observation appended
  after the policy's sampled tokens is what the template renders from the end of the call message
  (its EOS, or the template's end of turn: Gemma-2's ``<end_of_turn>``) to the next assistant
  header, rendered with the answers in it (``tool_observation_text``: Llama-3.1's template writes
  a tool message's content as a JSON string), e.g. for Qwen2.5
  ``\\n<|im_start|>user\\n<tool_response>\\n42\\n</tool_response><|im_end|>\\n<|im_start|>assistant\\n``.
  Default format: a ``user`` message with each content inside ``<tool_response>`` tags. A template
  that refuses several calls in one message (Llama-3.1's) gets their answers in one tool message.
  Token in, token out: the trained ids are the sampled ids; the observation ids (loss mask 0) follow.

The episode ends when the policy ends a message without a call (EOS), at ``--env.max-turns``
or at the token budget. Its state counts the calls (``{"calls": n}``). Reward the final answer
with a scorer of the transcript or a trajectory scorer (``--reward.trajectory-scorer``): no
``step`` sees it.
"""

from __future__ import annotations

import json
from collections.abc import Callable

from llamarl.data.prompts import Problem
from llamarl.environments.base import EnvironmentContractError, Turn
from llamarl.environments.tool_formats import (
    _END_TEXTS,
    DEFAULT_FORMAT,
    TOOL_FORMATS,
    HermesFormat,
    ToolCall,
    template_text,
)
from llamarl.runtime.registry import import_path

TOOL_CALL_START = HermesFormat.start
TOOL_CALL_END = HermesFormat.end
REFERENCE_PREFIX = "tools:"
"""``build_environment("tools:module:fn,module:fn2")`` builds ``FunctionToolsEnvironment`` of those
functions (what ``--env.tools`` selects); ``tools@<format>:module:fn,...`` with the tool format
``<format>`` (``tools_reference``)."""
FORMAT_PREFIX = "tools@"

DEFAULT_TOOLS_SYSTEM = (
    "You may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{tools}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{{"name": <function-name>, "arguments": <args-json-object>}}\n</tool_call>')
"""The system message of the default format (a chat template without tool support), ``{tools}``
the schemas one JSON per line: Qwen2.5's own wording."""



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


def tools_reference(spec: str, *, tool_format: str | None = None) -> str:
    """The environment reference of the tools ``spec`` (``--env.tools``) in ``tool_format`` (None:
    the default format)."""
    return f"{REFERENCE_PREFIX}{spec}" if tool_format is None else f"{FORMAT_PREFIX}{tool_format}:{spec}"


def _schema_name(schema) -> str | None:
    function = schema.get("function") if isinstance(schema, dict) else None
    name = function.get("name") if isinstance(function, dict) else None
    return name if isinstance(name, str) and name else None


class FunctionToolsEnvironment:
    """See the module docstring. ``schemas``: one per function, to replace the generated ones (each
    must name one of ``functions``). ``tool_format``: the registered tool-call format its turns are
    read in (tool_formats.py)."""

    def __init__(self, functions: list[Callable], *, schemas: list[dict] | None = None,
                 name: str = "function tools", tool_format: str = DEFAULT_FORMAT) -> None:
        if not functions:
            raise ValueError("a tool environment needs at least one function")
        self.name = name
        self.format = TOOL_FORMATS.get(tool_format)
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
        """The environment of ``tools:module:fn,...`` (``REFERENCE_PREFIX`` optional) or
        ``tools@<format>:module:fn,...`` (``tools_reference``)."""
        tool_format = DEFAULT_FORMAT
        if reference.startswith(FORMAT_PREFIX):
            tool_format, _, spec = reference.removeprefix(FORMAT_PREFIX).partition(":")
        else:
            spec = reference.removeprefix(REFERENCE_PREFIX)
        return cls(resolve_tools(spec), name=REFERENCE_PREFIX + spec, tool_format=tool_format)

    def chat_tools(self) -> list[dict]:
        return self.schemas

    def stop_texts(self) -> list[str]:
        return []  # a call turn ends at EOS, as the template ends the message (``is_call``)

    def end_texts(self) -> list[str]:
        return []

    def reset(self, problem: Problem) -> dict:
        return {"calls": 0}

    def is_call(self, turn: str) -> bool:
        """Whether a turn that ended at EOS holds calls (``CallsAtEnd``): then ``step`` runs them."""
        return self.format.is_call(turn)

    def step(self, state: dict, turn: str) -> Turn:
        """Run every tool call of ``turn``, in order; a malformed call or an unknown tool raises (a
        tool error, counted and answered by the tool runner). Several calls: their answers in
        ``tool_results``, one tool message each; ``observation`` joins them."""
        calls = self.format.parse(turn)
        unknown = [c.name for c in calls if c.name not in self.functions]
        if unknown:
            raise ValueError(f"unknown tool {unknown[0]!r}; the tools are {sorted(self.functions)}")
        results = [self._run(call) for call in calls]
        return Turn(observation="\n".join(results), tool_results=results if len(results) > 1 else None,
                    state={"calls": int(state.get("calls", 0)) + len(calls)})

    def _run(self, call: ToolCall) -> str:
        result = self.functions[call.name](**call.arguments)
        return result if isinstance(result, str) else json.dumps(result)


def template_supports_tools(tokenizer) -> bool:
    """Whether the tokenizer's chat template reads ``tools`` (else the default format is used)."""
    return "tools" in template_text(tokenizer)


def default_tools_system(schemas: list[dict]) -> str:
    return DEFAULT_TOOLS_SYSTEM.format(tools="\n".join(json.dumps(s) for s in schemas))


def _with_default_system(messages: list[dict], schemas: list[dict]) -> list[dict]:
    system = default_tools_system(schemas)
    messages = [dict(m) for m in messages]
    if messages and messages[0].get("role") == "system":
        messages[0]["content"] = f"{messages[0]['content']}\n\n{system}"
        return messages
    return [{"role": "system", "content": system}, *messages]


def _with_default_system_in_user(messages: list[dict], schemas: list[dict]) -> list[dict]:
    """``_with_default_system`` for a template without a system role: the text opens the first user message."""
    messages = [dict(m) for m in messages]
    first = next((i for i, m in enumerate(messages) if m.get("role") == "user"), None)
    if first is None:
        raise ValueError("--env.tools: the chat template has no system role and the prompt no user message to "
                         "present the tools in")
    messages[first]["content"] = f"{default_tools_system(schemas)}\n\n{messages[first]['content']}"
    return messages


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
            try:
                return self._tokenizer.apply_chat_template(_with_default_system(conversation, self._schemas),
                                                           *args, **kwargs)
            except Exception:  # noqa: BLE001 - a template without a system role (Gemma-2's raises)
                conversation = _with_default_system_in_user(conversation, self._schemas)
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
    """``(before, after)``: the observation of one tool answer ``content`` is ``before + content + after``
    (``tool_observation_segments`` for one answer)."""
    before, after = tool_observation_segments(tokenizer, schemas, count=1)
    return before, after


def _placeholder(k: int) -> str:
    return f"LLAMARLTOOLRESULT{k}END"  # letters only: no template escapes it


def _render_answers(tokenizer, schemas: list[dict], count: int, contents: list[str] | None = None) -> str:
    """The chat template's text of a user message, an assistant message with ``count`` calls and
    their ``count`` answers (``contents``; None: placeholders), with the next assistant header."""
    contents = [_placeholder(k) for k in range(count)] if contents is None else contents
    if not template_text(tokenizer):
        raise EnvironmentContractError("the tokenizer has no chat template, through which --env.tools presents the "
                                       "tools and answers them: use a model with a chat template, or an environment "
                                       "class of your own (docs/write_your_own_environment.md)")
    name = _schema_name(schemas[0]) if schemas else "tool"
    user = {"role": "user", "content": "q"}
    if template_supports_tools(tokenizer):
        # Ids of 9 alphanumerics: what Mistral's templates require; the others ignore them.
        calls = [{"id": f"c{k:08d}", "type": "function", "function": {"name": name, "arguments": {}}}
                 for k in range(count)]
        answers = [{"role": "tool", "name": name, "tool_call_id": f"c{k:08d}", "content": contents[k]}
                   for k in range(count)]
        messages = [user, {"role": "assistant", "content": "", "tool_calls": calls}, *answers]
        return tokenizer.apply_chat_template(messages, tools=schemas, tokenize=False, add_generation_prompt=True)
    call_text = TOOL_FORMATS.get(DEFAULT_FORMAT).render([ToolCall(name, {})] * count)
    responses = "\n".join(f"<tool_response>\n{contents[k]}\n</tool_response>" for k in range(count))
    messages = [user, {"role": "assistant", "content": call_text}, {"role": "user", "content": responses}]
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


# Texts that end a message in the templates tool_formats.py reads (Gemma-2's ``<end_of_turn>``,
# whose tokenizer's EOS ``<eos>`` no message ends with), besides the tokenizer's EOS.
_MESSAGE_ENDS = _END_TEXTS


def _call_message_end(tokenizer, text: str, before: int) -> int:
    """Where the call message ends in ``text`` (rendered by ``_render_answers``): after the last
    end-of-message text (the tokenizer's EOS, or one of ``_MESSAGE_ENDS``) before ``before``; -1 without one."""
    eos = getattr(tokenizer, "eos_token", None) or ""
    ends = [text.rfind(end, 0, before) + len(end) for end in {eos, *_MESSAGE_ENDS} - {""}
            if text.rfind(end, 0, before) >= 0]
    return max(ends, default=-1)


def _no_message_end(tokenizer) -> EnvironmentContractError:
    eos = getattr(tokenizer, "eos_token", None) or ""
    return EnvironmentContractError(f"the chat template renders no end of message ({eos!r}, the tokenizer's EOS, or "
                                    "an end of turn) before a tool message: it cannot answer tool calls (use "
                                    "--env.tool-format with a template that has tool messages, or an environment "
                                    "class of your own)")


def tool_observation_segments(tokenizer, schemas: list[dict], *, count: int) -> list[str]:
    """The ``count + 1`` texts around ``count`` tool answers in an observation: what the chat
    template renders after an assistant message of ``count`` calls (from its end, the tokenizer's
    EOS text or the template's end of turn, where the sampled turn ends) through the tool messages
    to the next assistant header; the default format's (a ``user`` message of ``<tool_response>``
    blocks) for a template without tool support. A template that refuses ``count`` calls in one
    message (Llama-3.1's) gets the answers in one tool message, one a line. EnvironmentContractError
    when the template renders no end of message before the tool message. A template may quote or
    escape a tool message's content (Llama-3.1's ``tojson``): the observation of actual answers is
    ``tool_observation_text``'s, rendered with them."""
    try:
        text = _render_answers(tokenizer, schemas, count)
    except EnvironmentContractError:
        raise
    except Exception:  # a template that raises for several calls (Llama-3.1's)
        if count == 1:
            raise
        before, after = tool_observation_segments(tokenizer, schemas, count=1)
        return [before] + ["\n"] * (count - 1) + [after]
    first = text.find(_placeholder(0))
    at = _call_message_end(tokenizer, text, max(first, 0))
    if first < 0 or at < 0:
        raise _no_message_end(tokenizer)
    segments = []
    for k in range(count):
        where = text.find(_placeholder(k), at)
        segments.append(text[at:where])
        at = where + len(_placeholder(k))
    return [*segments, text[at:]]


def tool_observation_text(tokenizer, schemas: list[dict], results: list[str]) -> str:
    """The observation of the tool answers ``results``: what the chat template renders from the end
    of the call message through their tool messages (contents as the template writes them: quoted
    and escaped by Llama-3.1's ``tojson``) to the next assistant header (``tool_observation_segments``);
    several answers that the template refuses as several tool messages (Llama-3.1's) are one, a line
    each."""
    count = len(results)
    try:
        placeholders = _render_answers(tokenizer, schemas, count)
        text = _render_answers(tokenizer, schemas, count, contents=list(results))
    except EnvironmentContractError:
        raise
    except Exception:  # a template that raises for several calls (Llama-3.1's)
        if count == 1:
            raise
        return tool_observation_text(tokenizer, schemas, ["\n".join(results)])
    end = _call_message_end(tokenizer, placeholders, max(placeholders.find(_placeholder(0)), 0))
    if end < 0 or _placeholder(0) not in placeholders:
        raise _no_message_end(tokenizer)
    if text[:end] != placeholders[:end]:  # the answers changed what comes before them
        raise EnvironmentContractError("the chat template renders the messages before a tool message differently "
                                       "with the tool's answer in it: the observation cannot be appended after the "
                                       "sampled call")
    return text[end:]


def tool_observation(segments: list[str], results: list[str]) -> str:
    """The observation text of ``results`` within ``tool_observation_segments(count=len(results))``."""
    return "".join(part for pair in zip(segments, [*results, ""]) for part in pair)
