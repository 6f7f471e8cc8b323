"""Trajectory scorers: rewards that see the whole episode and the problem, ``(trajectory, problem) -> float``.

A text scorer (``llamarl.rewards.SCORERS``) reads ``(completion text, reference)``; that is enough
for a single answer, not for an agent: it cannot tell the policy's turns from the tool's answers,
count the turns, read the environment's reward or the question. A trajectory scorer gets:

* ``Trajectory``: the completion as ``segments`` (text runs, each ``trained`` = sampled by the
  policy, or not = an environment's observation), ``finish_reason``, ``num_turns`` (the
  environment's ``step`` calls, answered or not), ``env_reward`` (the last reward the environment's ``step`` gave, None if none) and
  ``env_state`` (its final JSON state);
* ``Problem``: the question and the reference answer.

Register one with ``@register_trajectory_scorer("name")`` and select it with
``--reward.trajectory-scorer name`` (or ``module:function``); it then replaces the recipe's text
scorer for training and for the run's greedy evaluations alike. Built in: ``env``, the
environment's reward (0.0 when it gave none). Like text scorers they run in the reward pool's
worker processes with a timeout (llamarl/rewards/pool.py), so they must be importable module-level
functions; the trajectory crosses the pipe (and every channel, as the batch's ``trajectory``
string) as JSON, checked by ``Trajectory.from_json``.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

from llamarl.data.prompts import Problem
from llamarl.runtime.registry import Registry, import_path


@dataclass(frozen=True)
class Segment:
    """A run of completion tokens from one source, decoded."""

    text: str
    """The run's text (special tokens skipped)."""
    trained: bool
    """True: sampled by the policy (trained); False: an environment's observation (context only)."""


@dataclass(frozen=True)
class Trajectory:
    """One sample's completion as a scorer sees it (see the module docstring)."""

    segments: list[Segment]
    """The completion's runs in order; a single-turn completion is one trained segment."""
    finish_reason: str = "stop"
    """``stop`` (EOS, an end id or the environment's ``done``) or ``length`` (a budget ran out)."""
    num_turns: int = 0
    """Times the environment's ``step`` ran: the policy's turns that ended on a stop text, one whose
    ``step`` found no call or failed included (what ``env_tool_calls`` counts). Whether a tool
    answered is in ``observations`` (an error's is ``[tool error: ...]``)."""
    env_reward: float | None = None
    """The environment's last reward (``Turn.reward``), None when it gave none."""
    env_state: dict = field(default_factory=dict)
    """The environment's final state (JSON)."""

    @property
    def text(self) -> str:
        """The whole completion text: what a text scorer reads."""
        return "".join(s.text for s in self.segments)

    @property
    def policy_text(self) -> str:
        """The trained segments only, joined."""
        return "".join(s.text for s in self.segments if s.trained)

    @property
    def observations(self) -> list[str]:
        """The environment's observations, in order."""
        return [s.text for s in self.segments if not s.trained]

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> Trajectory:
        """Parse ``to_json``'s output; ValueError naming the field that is missing or of the wrong type."""
        data = json.loads(text)
        if not isinstance(data, dict) or not isinstance(data.get("segments"), list):
            raise ValueError("trajectory JSON needs a 'segments' list")  # noqa: TRY004 - bad input on the wire
        segments = []
        for i, seg in enumerate(data["segments"]):
            if not (isinstance(seg, dict) and isinstance(seg.get("text"), str) and isinstance(seg.get("trained"), bool)):
                raise ValueError(f"trajectory segment {i} must be {{'text': str, 'trained': bool}}, got {seg!r}")  # noqa: TRY004 - bad input on the wire
            segments.append(Segment(seg["text"], seg["trained"]))
        reward = data.get("env_reward")
        if reward is not None and not (isinstance(reward, (int, float)) and math.isfinite(reward)):
            raise ValueError(f"trajectory env_reward must be a finite number or null, got {reward!r}")
        if not isinstance(data.get("env_state", {}), dict) or not isinstance(data.get("num_turns", 0), int):
            raise ValueError("trajectory env_state must be an object and num_turns an integer")  # noqa: TRY004 - bad input on the wire
        return cls(segments=segments, finish_reason=str(data.get("finish_reason", "stop")),
                   num_turns=data.get("num_turns", 0), env_reward=None if reward is None else float(reward),
                   env_state=data.get("env_state", {}))


def trajectory_of(completion, tokenizer) -> Trajectory:
    """The ``Trajectory`` of an engine ``Completion``: its tokens split into runs of equal loss mask,
    each decoded on its own (so no text is attributed to the wrong source), and its episode."""
    from llamarl.engines.base import sampled_mask

    mask, ids = sampled_mask(completion), completion.completion_ids
    segments, start = [], 0
    for end in range(1, len(ids) + 1):
        if end == len(ids) or mask[end] != mask[start]:
            segments.append(Segment(tokenizer.decode(ids[start:end], skip_special_tokens=True), bool(mask[start])))
            start = end
    episode = completion.episode or {}
    return Trajectory(segments=segments, finish_reason=completion.finish_reason, num_turns=int(episode.get("turns", 0)),
                      env_reward=episode.get("reward"), env_state=episode.get("state", {}))


TrajectoryScorer = Callable[[Trajectory, Problem], float]

TRAJECTORY_SCORERS: Registry[TrajectoryScorer] = Registry("trajectory scorer")


def register_trajectory_scorer(name: str):
    """Decorator: the function ``(trajectory, problem) -> float`` called ``name``
    (``--reward.trajectory-scorer name``)."""
    return TRAJECTORY_SCORERS.register(name)


@register_trajectory_scorer("env")
def env_reward(trajectory: Trajectory, problem: Problem) -> float:
    """The environment's reward (``Turn.reward``), 0.0 when the episode got none (the policy never
    called the environment, or it gave no reward)."""
    return 0.0 if trajectory.env_reward is None else trajectory.env_reward


def resolve_trajectory_scorer(name: str) -> TrajectoryScorer:
    """The trajectory scorer registered as ``name``, or ``module:function`` imported; ValueError for
    an unknown name (listing the registered ones) or a path that does not import to a callable."""
    if ":" not in name:
        return TRAJECTORY_SCORERS.get(name)
    return import_path(name, kind="trajectory scorer")


@dataclass(frozen=True)
class TrajectoryScore:
    """A trajectory scorer where an evaluation takes a score (``llamarl.executors.evaluation_loop.score_samples``):
    the wrapper says which of the two signatures to call, explicitly."""

    scorer: TrajectoryScorer

    def __call__(self, trajectory: Trajectory, problem: Problem) -> float:
        return self.scorer(trajectory, problem)
