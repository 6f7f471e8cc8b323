"""Tool-call formats: how a model writes its tool calls, registered by name and chosen from the
chat template (or ``--env.tool-format``), for ``--env.tools`` (llamarl/environments/function_tools.py).

A format (``ToolFormat``) says whether a chat template speaks it (``detects``, on the template's
text), whether a policy turn holds calls (``is_call``) and what they are (``parse``: every call of
the turn, in order, each ``ToolCall(name, arguments)``; ValueError, one line saying what is wrong,
for a malformed one: the tool runner answers it as a tool error and counts it, as for a tool that
raised). ``render`` writes calls as the model would (the default format's example; tests).

A turn holding calls ends as the template ends an assistant message: at EOS (``<|im_end|>``,
``<|eot_id|>``, ``</s>``), so a turn may hold several calls; the episode runner then calls ``step``
instead of ending the episode (``CallsAtEnd``, llamarl/environments/base.py), every call runs, and
their answers are that many ``tool`` messages rendered by the template.

Built in (``choose_tool_format`` tries them in ``DETECTION_ORDER``):

* ``mistral``: ``[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`` (Mistral v3 templates), or
  ``[TOOL_CALLS]name[ARGS]{...}`` per call (v11 and later). Detected by ``[TOOL_CALLS]``.
* ``llama3``: Llama-3.1 / 3.2 JSON tool calls, the message a JSON object
  ``{"name": ..., "parameters": {...}}`` (or ``"arguments"``), optionally after
  ``<|python_tag|>``; several calls as a JSON list or objects separated by ``;`` or new lines.
  Detected by an ``ipython`` role with Llama's header tokens.
* ``hermes``: Qwen2 / 2.5 / 3 and Hermes-2/3: ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``
  per call. Detected by ``<tool_call>``. **The default format**: a template with no tool support,
  or one whose format none of the others detects, gets it, the tools listed in a system message
  (``function_tools.DEFAULT_TOOLS_SYSTEM``, Qwen2.5's wording).

Add a format: subclass ``ToolFormat`` (``detects``, ``is_call``, ``parse``, ``render``), register
an instance with ``register_tool_format("name", fmt)`` in a module imported before the generator
starts (a recipe, or the module of the tool functions), and select it with ``--env.tool-format
name``; to have it chosen from templates, add its name to ``DETECTION_ORDER``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from llamarl.runtime.registry import Registry

# Special texts a turn decoded with its special tokens may end with (removed before parsing).
_END_TEXTS = ("<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end_of_text|>", "</s>", "<|endoftext|>", "<end_of_turn>")


@dataclass(frozen=True)
class ToolCall:
    """One call a turn holds."""

    name: str
    """The tool's name."""
    arguments: dict = field(default_factory=dict)
    """Its keyword arguments (a JSON object)."""


def _strip_ends(text: str) -> str:
    text = text.strip()
    changed = True
    while changed:
        changed = False
        for end in _END_TEXTS:
            if text.endswith(end):
                text, changed = text[: -len(end)].rstrip(), True
    return text


def _call(value, *, arguments_key: str = "arguments") -> ToolCall:
    """A ``ToolCall`` of a decoded JSON value; ValueError when it is not ``{"name": str, <args>: {...}}``."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        raise ValueError(f'a tool call needs {{"name": ..., "{arguments_key}": {{...}}}}, got {json.dumps(value)[:80]}')  # noqa: TRY004
    arguments = value.get(arguments_key, value.get("arguments", value.get("parameters", {})))
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError as exc:
            raise ValueError(f"the arguments of {value['name']!r} are not JSON ({exc.msg})") from None
    if not isinstance(arguments, dict):
        raise ValueError(f"the arguments of {value['name']!r} must be a JSON object")  # noqa: TRY004 - the model's error
    return ToolCall(value["name"], arguments)


def _json_values(text: str, *, separators: str = " \t\r\n;,") -> list:
    """The JSON values written one after another in ``text`` (between ``separators``); ValueError
    naming the first place that is not JSON."""
    decoder, values, at = json.JSONDecoder(), [], 0
    while True:
        while at < len(text) and text[at] in separators:
            at += 1
        if at == len(text):
            return values
        try:
            value, at = decoder.raw_decode(text, at)
        except json.JSONDecodeError as exc:
            raise ValueError(f"the tool call is not JSON ({exc.msg} at {text[at:at + 20]!r})") from None
        values.extend(value if isinstance(value, list) else [value])


class ToolFormat:
    """A tool-call format (module docstring). Subclass it and register an instance."""

    name = "?"

    def detects(self, template: str) -> bool:
        """Whether a chat template (its text) speaks this format."""
        raise NotImplementedError

    def is_call(self, turn: str) -> bool:
        """Whether a policy turn's text holds tool calls (then ``step`` runs them)."""
        raise NotImplementedError

    def parse(self, turn: str) -> list[ToolCall]:
        """Every call of ``turn``, in order; ValueError, one line, for a malformed one (or none)."""
        raise NotImplementedError

    def render(self, calls: list[ToolCall]) -> str:
        """``calls`` as the model writes them (no end token)."""
        raise NotImplementedError


class HermesFormat(ToolFormat):
    name = "hermes"
    start, end = "<tool_call>", "</tool_call>"

    def detects(self, template: str) -> bool:
        return self.start in template

    def is_call(self, turn: str) -> bool:
        return self.start in turn

    def parse(self, turn: str) -> list[ToolCall]:
        blocks = turn.split(self.start)[1:]
        if not blocks:
            raise ValueError(f"no {self.start} in the turn")
        calls = []
        for block in blocks:  # the last one may lack its closing tag (cut at EOS)
            body = _strip_ends(block.split(self.end, 1)[0])
            values = _json_values(body)
            if len(values) != 1:
                raise ValueError(f"a {self.start} block holds {len(values)} JSON values, expected one call")
            calls.append(_call(values[0]))
        return calls

    def render(self, calls: list[ToolCall]) -> str:
        return "\n".join(f'{self.start}\n{json.dumps({"name": c.name, "arguments": c.arguments})}\n{self.end}'
                         for c in calls)


class Llama3Format(ToolFormat):
    name = "llama3"
    python_tag = "<|python_tag|>"

    def detects(self, template: str) -> bool:
        return "<|start_header_id|>" in template and "ipython" in template

    def _body(self, turn: str) -> str:
        return _strip_ends(turn).removeprefix(self.python_tag).strip()

    def is_call(self, turn: str) -> bool:
        body = self._body(turn)
        return body.startswith(("{", "[")) or turn.lstrip().startswith(self.python_tag)

    def parse(self, turn: str) -> list[ToolCall]:
        values = _json_values(self._body(turn))
        if not values:
            raise ValueError("no tool call in the turn")
        return [_call(v, arguments_key="parameters") for v in values]

    def render(self, calls: list[ToolCall]) -> str:
        return "; ".join(json.dumps({"name": c.name, "parameters": c.arguments}) for c in calls)


class MistralFormat(ToolFormat):
    name = "mistral"
    marker, args = "[TOOL_CALLS]", "[ARGS]"

    def detects(self, template: str) -> bool:
        return self.marker in template

    def is_call(self, turn: str) -> bool:
        return self.marker in turn

    def parse(self, turn: str) -> list[ToolCall]:
        parts = [_strip_ends(p) for p in turn.split(self.marker)[1:]]
        if not parts:
            raise ValueError(f"no {self.marker} in the turn")
        calls = []
        for part in parts:
            if self.args in part:  # v11+: name[ARGS]{...}
                name, _, arguments = part.partition(self.args)
                values = _json_values(arguments)
                if len(values) != 1:
                    raise ValueError(f"{name.strip()!r}[ARGS] holds {len(values)} JSON values, expected one object")
                calls.append(_call({"name": name.strip(), "arguments": values[0]}))
            else:
                calls += [_call(v) for v in _json_values(part)]
        if not calls:
            raise ValueError(f"no tool call after {self.marker}")
        return calls

    def render(self, calls: list[ToolCall]) -> str:
        return self.marker + json.dumps([{"name": c.name, "arguments": c.arguments} for c in calls])


TOOL_FORMATS: Registry[ToolFormat] = Registry("tool format")
DEFAULT_FORMAT = "hermes"
"""The format of a template with none of its own (module docstring)."""
DETECTION_ORDER = ["mistral", "llama3", "hermes"]
"""The built-in formats in the order ``choose_tool_format`` tries them."""


def register_tool_format(name: str, fmt: ToolFormat) -> ToolFormat:
    """Register ``fmt`` as ``name`` (``--env.tool-format name``); ValueError when the name is taken."""
    if not isinstance(fmt, ToolFormat):
        raise TypeError(f"register_tool_format({name!r}) takes a ToolFormat instance, got {fmt!r}")
    return TOOL_FORMATS.add(name, fmt)


for _fmt in (HermesFormat(), Llama3Format(), MistralFormat()):
    register_tool_format(_fmt.name, _fmt)


def template_text(tokenizer) -> str:
    """The tokenizer's chat template as one text ("" without one)."""
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):
        template = " ".join(str(t) for t in template.values())
    return template if isinstance(template, str) else ""


def choose_tool_format(tokenizer, name: str | None = None) -> ToolFormat:
    """The format ``name`` (``--env.tool-format``; ValueError listing the registered ones), else the
    first of ``DETECTION_ORDER`` the tokenizer's chat template speaks, else the default format."""
    if name is not None:
        return TOOL_FORMATS.get(name)
    template = template_text(tokenizer)
    for candidate in DETECTION_ORDER:
        if candidate in TOOL_FORMATS and TOOL_FORMATS.get(candidate).detects(template):
            return TOOL_FORMATS.get(candidate)
    return TOOL_FORMATS.get(DEFAULT_FORMAT)

