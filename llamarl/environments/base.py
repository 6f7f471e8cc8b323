"""The environment contract: multi-turn episodes whose observations the policy reads but never trains on.

An episode starts from a problem (``reset``) and alternates a policy turn and an observation. A
policy turn ends when the policy samples one of the environment's ``stop_token_ids`` (a tool call
is complete) or EOS (its final answer); after a stop id the environment's ``step(state, turn)``
answers with a ``Turn``: the observation text to append, an optional reward and whether the episode
ended. EOS, ``--env.max-turns`` or the sequence budget (``--generator.max-new-tokens`` for the
whole transcript) also end it.

Token in, token out: the policy's tokens are kept as sampled (the trainer trains exactly those ids,
never a re-tokenisation of the text); ``step`` gets the turn as text only to read it. Observation
text is tokenised once by ``observation_ids`` and appended with loss mask 0, no behaviour log-prob
and version -1, so it is context for every later token and contributes no gradient.

``step`` is a pure function of JSON-serialisable ``state`` and the turn's text, returning the next
state in its ``Turn``: it runs in worker processes with a timeout (llamarl/environments/tools.py),
an episode in progress is checkpointed as that state, and a resumed run continues it exactly.
Register an environment with ``@register_environment("name")`` on a class with a no-argument
constructor; select it with ``--env.name name``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from llamarl.data.prompts import Problem
from llamarl.registry import Registry, import_path


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


@runtime_checkable
class Environment(Protocol):
    """See the module docstring."""

    def stop_texts(self) -> list[str]:
        """Strings each of which must be one token of the policy's tokenizer: sampling one ends a
        policy turn and calls ``step``."""
        ...

    def end_texts(self) -> list[str]:
        """Strings (one token each) that end the episode as EOS does, without a ``step`` (the answer
        is complete: the calculator's newline). May be empty."""
        ...

    def reset(self, problem: Problem) -> dict:
        """The state of a new episode for ``problem`` (JSON-serialisable)."""
        ...

    def step(self, state: dict, turn: str) -> Turn:
        """The answer to the policy's ``turn`` (its text, ending with a stop text) in ``state``."""
        ...


def observation_ids(tokenizer, text: str) -> list[int]:
    """``text``'s token ids as appended after a policy turn (no special tokens added)."""
    return list(tokenizer(text, add_special_tokens=False)["input_ids"]) if text else []


def stop_token_ids(environment: Environment, tokenizer, *, ending: bool = False) -> list[int]:
    """The ids of ``environment.stop_texts()`` (``ending``: of ``end_texts()``); ValueError naming a
    text that is not one token."""
    ids = []
    for text in environment.end_texts() if ending else environment.stop_texts():
        tokens = observation_ids(tokenizer, text)
        if len(tokens) != 1:
            raise ValueError(f"environment stop text {text!r} is {len(tokens)} tokens of this tokenizer {tokens}; "
                             "a turn can end only on a single token")
        ids.append(tokens[0])
    return ids


def _load_builtin_environments() -> None:
    import llamarl.environments  # noqa: F401 - its modules register the built-in environments


ENVIRONMENTS: Registry[Callable[[], Environment]] = Registry("environment", load_builtins=_load_builtin_environments)


def register_environment(name: str):
    """Decorator: the environment class (no-argument constructor) called ``name`` (``--env.name``)."""
    return ENVIRONMENTS.register(name)


def environment_names() -> list[str]:
    """The registered environments, sorted."""
    return ENVIRONMENTS.names()


def build_environment(name: str) -> Environment:
    """A new instance of the environment registered as ``name``; ValueError listing the known ones.
    ``module:Class`` also works (imported, for a user's environment outside a registry import)."""
    if ":" in name:
        return import_path(name, kind="environment")()
    return ENVIRONMENTS.get(name)()
