"""Misbehaving scorers for RewardPool tests; spawned workers import them by "scorers_for_tests:NAME"."""

from __future__ import annotations

import os
import time


def flaky(completion: str, reference: str) -> float:
    """Exact match, except: "raise" raises, "sleep" hangs for an hour, "die" kills its process."""
    if completion == "raise":
        raise RuntimeError("scorer failure requested by the test")
    if completion == "sleep":
        time.sleep(3600)
    if completion == "die":
        os._exit(3)
    return 1.0 if completion == reference else 0.0


def not_finite(completion: str, reference: str) -> float:
    """Always NaN, which the pool must treat as a scorer error."""
    return float("nan")


NOT_CALLABLE = 42


def first_char_even(completion: str, reference: str) -> float:
    """1.0 when the completion's first character has an even code point: about half of a tiny
    random model's samples, so nearly every group has mixed rewards (a non-zero advantage)."""
    return 1.0 if completion and ord(completion[0]) % 2 == 0 else 0.0


def recording_first_char_even(completion: str, reference: str) -> float:
    """``first_char_even``, and appends (completion, reference) as a JSON line to the file named by
    ``LLAMARL_TEST_SAMPLES`` (``.<pid>`` added), so tests can compare the exact samples of two runs."""
    import json

    path = os.environ.get("LLAMARL_TEST_SAMPLES")
    if path:
        with open(f"{path}.{os.getpid()}", "a", encoding="utf-8") as f:
            f.write(json.dumps([completion, reference]) + "\n")
    return first_char_even(completion, reference)


def solved_in_few_turns(trajectory, problem) -> float:
    """A trajectory scorer that reads all it is given: 1 / turns when the last trained segment
    holds the problem's answer and the question mentions 'number', else 0."""
    if "number" not in problem.question or not trajectory.segments:
        return 0.0
    trained = [s.text for s in trajectory.segments if s.trained]
    return 1.0 / max(trajectory.num_turns, 1) if trained and problem.answer in trained[-1] else 0.0


def always_zero(completion: str, reference: str) -> float:
    """A scorer that never matches: every group ties, so a run has no learning signal."""
    return 0.0
