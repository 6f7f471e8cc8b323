"""The environment contract: multi-turn episodes whose observations the policy reads but never trains on.

An episode starts from a problem (``reset``) and alternates a policy turn and an observation. A
policy turn ends when the policy samples one of the environment's stop texts (a tool call is
complete: a text of one token is a stop id, a longer one a stop string, ``SamplingParams.stop``)
or EOS (its final answer, unless the environment says the turn holds a call: ``CallsAtEnd``);
after a stop the environment's ``step(state, turn)``
answers with a ``Turn``: the observation text to append, an optional reward and whether the episode
ended. EOS, ``--env.max-turns`` or the sequence budget (``--generator.max-new-tokens`` for the
whole transcript) also end it.

Token in, token out: the policy's tokens are kept as sampled (the trainer trains exactly those ids,
never a re-tokenisation of the text); ``step`` gets the turn as text only to read it. Observation
text is tokenised once by ``observation_ids`` and appended with loss mask 0, no behaviour log-prob
and version -1, so it is context for every later token and contributes no gradient.

``step`` is a pure function of JSON-serialisable ``state`` and the turn's text, returning the next
state in its ``Turn``: it runs in worker processes with a timeout (llamarl/environments/tool_workers.py),
an episode in progress is checkpointed as that state, and a resumed run continues it exactly.
Register an environment with ``@register_environment("name")`` on a class with a no-argument
constructor; select it with ``--env.name name`` (or ``--env.name module:Class``). Plain Python
functions as tools, presented and called through the chat template: ``--env.tools module:fn``
(llamarl/environments/function_tools.py).

Optional capabilities, declared here and looked up once when the generator starts: ``CallsAtEnd``
(``is_call(turn)``: a turn that ended at EOS holds tool calls, so ``step`` runs instead of the
episode ending: chat formats whose call message ends as any message does), and ``PresentsTools``:
``chat_tools()``, the JSON schemas of the environment's tools. The generator then builds prompts
with ``apply_chat_template(..., tools=schemas)`` and renders each ``step``'s observation as the
content of a ``role: "tool"`` message through the same template.

Programming errors stop the run (``EnvironmentContractError``, one line naming the environment,
the method and what was wrong): ``step`` returning anything but a ``Turn`` (or a ``Turn`` whose
fields have the wrong types or whose state is not JSON), ``reset`` returning a state that is not a
JSON object, a ``chat_tools`` schema without a name. An exception raised inside ``step`` (a tool
that failed, a call the model got wrong) is not one: it is counted and answered (tool_workers.py).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Protocol, runtime_checkable

from llamarl.data.prompts import Problem
from llamarl.runtime.registry import Registry, import_path


@dataclass
class Turn:
    """What ``Environment.step`` returns."""

    observation: str = ""
    """Text appended after the policy's turn (tokenised once; never trained)."""
    done: bool = False
    """True: the episode ends here (nothing is appended after the observation)."""
    state: dict = field(default_factory=dict)
    """The episode's next state (JSON-serialisable)."""
    reward: float | None = None
    """An optional reward the environment assigns (reported as ``env_reward`` on the sample)."""
    error: str | None = None
    """Set by the tool runner when ``step`` raised or timed out (the observation then says so)."""
    tool_results: list[str] | None = None
    """Several tool answers, one per call of the turn, in order (an environment that presents
    tools): rendered as that many tool messages; None, ``observation`` is the one answer."""


@runtime_checkable
class Environment(Protocol):
    """See the module docstring."""

    def stop_texts(self) -> list[str]:
        """Strings whose sampling ends a policy turn and calls ``step``: one token of the policy's
        tokenizer each is a stop id; a longer one is matched in the turn's text (a stop string,
        llamarl/engines/stop_text.py: the turn ends with the token that completes it)."""
        ...

    def end_texts(self) -> list[str]:
        """Strings that end the episode as EOS does, without a ``step`` (the answer is complete: the
        calculator's newline), one token or a stop string as ``stop_texts``. May be empty."""
        ...

    def reset(self, problem: Problem) -> dict:
        """The state of a new episode for ``problem`` (JSON-serialisable)."""
        ...

    def step(self, state: dict, turn: str) -> Turn:
        """The answer to the policy's ``turn`` (its text, ending with a stop text) in ``state``."""
        ...


@runtime_checkable
class CallsAtEnd(Protocol):
    """Optional capability (module docstring): ``is_call(turn)``, whether the text of a turn that
    ended at EOS holds tool calls; True, ``step`` answers it and the episode goes on."""

    def is_call(self, turn: str) -> bool: ...


@runtime_checkable
class PresentsTools(Protocol):
    """Optional capability (module docstring): the tools' JSON schemas, as
    ``apply_chat_template(tools=...)`` takes them (``transformers.utils.get_json_schema``'s form:
    ``{"type": "function", "function": {"name": ..., "description": ..., "parameters": {...}}}``).
    ``step``'s observations are then tool message contents, rendered by the chat template."""

    def chat_tools(self) -> list[dict]: ...


class EnvironmentContractError(RuntimeError):
    """An environment broke its contract (a programming error, module docstring): the run stops."""


def _json_error(value) -> str | None:
    try:
        json.dumps(value, allow_nan=False)
    except (TypeError, ValueError) as exc:
        return str(exc)
    return None


def check_state(name: str, method: str, state) -> dict:
    """``state`` if it is a JSON object; EnvironmentContractError naming ``name`` and ``method`` otherwise."""
    if not isinstance(state, dict):
        raise EnvironmentContractError(f"environment {name!r}: {method} returned a {type(state).__name__} as the "
                                       "state, expected a dict of JSON values")
    error = _json_error(state)
    if error is not None:
        raise EnvironmentContractError(f"environment {name!r}: {method} returned a state that is not JSON ({error}): "
                                       "the state crosses processes and checkpoints as JSON")
    return state


def check_turn(name: str, turn) -> dict:
    """``turn`` (what ``step`` returned) as a JSON-ready dict; EnvironmentContractError naming ``name``
    and ``step`` when it is not a ``Turn`` of the documented types."""
    if not isinstance(turn, Turn):
        raise EnvironmentContractError(f"environment {name!r}: step returned a {type(turn).__name__}, expected a Turn "
                                       "(llamarl.environments.base.Turn)")
    for field_name, expected in (("observation", str), ("done", bool), ("state", dict)):
        value = getattr(turn, field_name)
        if not isinstance(value, expected):
            raise EnvironmentContractError(f"environment {name!r}: step returned a Turn whose {field_name} is a "
                                           f"{type(value).__name__}, expected a {expected.__name__}")
    if turn.tool_results is not None and (not isinstance(turn.tool_results, list)
                                          or not all(isinstance(r, str) for r in turn.tool_results)):
        raise EnvironmentContractError(f"environment {name!r}: step returned a Turn whose tool_results is not a list "
                                       "of strings")
    if turn.reward is not None and (isinstance(turn.reward, bool) or not isinstance(turn.reward, (int, float))):
        raise EnvironmentContractError(f"environment {name!r}: step returned a Turn whose reward is a "
                                       f"{type(turn.reward).__name__}, expected a float or None")
    check_state(name, "step", turn.state)
    return asdict(turn)


def check_tool_schemas(name: str, environment: Environment) -> list[dict] | None:
    """The schemas of an environment that presents tools (``PresentsTools``), checked; None otherwise."""
    if not isinstance(environment, PresentsTools):
        return None
    schemas = environment.chat_tools()
    if not isinstance(schemas, list) or not schemas:
        raise EnvironmentContractError(f"environment {name!r}: chat_tools returned {schemas!r}, expected a non-empty "
                                       "list of JSON schemas")
    names = []
    for schema in schemas:
        function = schema.get("function") if isinstance(schema, dict) else None
        tool = function.get("name") if isinstance(function, dict) else None
        if not isinstance(tool, str) or not tool:
            raise EnvironmentContractError(f"environment {name!r}: chat_tools has a schema without function.name: "
                                           f"{schema!r}")
        error = _json_error(schema)
        if error is not None:
            raise EnvironmentContractError(f"environment {name!r}: chat_tools' schema of {tool!r} is not JSON ({error})")
        names.append(tool)
    if len(set(names)) != len(names):
        raise EnvironmentContractError(f"environment {name!r}: chat_tools names a tool twice: {names}")
    return schemas


def observation_ids(tokenizer, text: str) -> list[int]:
    """``text``'s token ids as appended after a policy turn (no special tokens added)."""
    return list(tokenizer(text, add_special_tokens=False)["input_ids"]) if text else []


def stop_token_ids(environment: Environment, tokenizer, *, ending: bool = False) -> list[int]:
    """The ids of ``environment.stop_texts()`` (``ending``: of ``end_texts()``) that are one token
    (``stop_tokens``)."""
    return stop_tokens(environment, tokenizer, ending=ending)[0]


def stop_tokens(environment: Environment, tokenizer, *, ending: bool = False) -> tuple[list[int], list[str]]:
    """``(ids, strings)``: ``environment.stop_texts()`` (``ending``: ``end_texts()``) split into the
    ids of those that are one token of ``tokenizer`` and the others, matched as stop strings
    (``SamplingParams.stop``); ValueError naming an empty text."""
    ids, strings = [], []
    for text in environment.end_texts() if ending else environment.stop_texts():
        if not isinstance(text, str) or not text:
            raise ValueError(f"environment stop text {text!r} must be a non-empty string")
        tokens = observation_ids(tokenizer, text)
        if len(tokens) == 1:
            ids.append(tokens[0])
        else:
            strings.append(text)
    return ids, strings


def _load_builtin_environments() -> None:
    import llamarl.environments  # noqa: F401 - its modules register the built-in environments


ENVIRONMENTS: Registry[Callable[[], Environment]] = Registry("environment", load_builtins=_load_builtin_environments)


def register_environment(name: str):
    """Decorator: the environment class (no-argument constructor) called ``name`` (``--env.name``)."""
    return ENVIRONMENTS.register(name)


def environment_names() -> list[str]:
    """The registered environments, sorted."""
    return ENVIRONMENTS.names()


_CONTRACT = ("stop_texts", "end_texts", "reset", "step")


def resolve_environment_class(name: str) -> Callable[[], Environment]:
    """What builds the environment ``name`` (registered, or ``module:Class``); ValueError, one line,
    for an unknown name, a module or class that does not import, or a class without the contract's
    methods (checked at flag parsing)."""
    if ":" not in name:
        return ENVIRONMENTS.get(name)
    factory = import_path(name, kind="environment")
    missing = [method for method in _CONTRACT if not callable(getattr(factory, method, None))]
    if isinstance(factory, type) and missing:
        raise ValueError(f"environment {name!r} is not an environment: it has no {', '.join(missing)} "
                         "(llamarl/environments/base.py)")
    return factory
