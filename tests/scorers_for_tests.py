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


def contains_seven(completion: str, reference: str) -> float:
    """1.0 when the completion contains a '7': a reward a tiny random model hits often, so its
    policy gradient is non-zero (end-to-end tests need real updates)."""
    return 1.0 if "7" in completion else 0.0
