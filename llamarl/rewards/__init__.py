"""Reward functions: a registry of built-in scorers plus ``"module:function"`` dotted-path lookup.

A scorer is any ``Callable[[str, str], float]`` taking ``(completion, reference)``. Scorers run in
spawned worker processes (see ``llamarl.rewards.pool``), so custom ones must be importable
module-level functions, referenced by name rather than passed as objects.
"""

from __future__ import annotations

from collections.abc import Callable

from llamarl.rewards import arithmetic, gsm8k
from llamarl.rewards import math as math_scorer
from llamarl.runtime.registry import import_path

Scorer = Callable[[str, str], float]

SCORERS: dict[str, Scorer] = {
    "arithmetic": arithmetic.score,
    "gsm8k": gsm8k.score,
    "math": math_scorer.score,
}


def resolve_scorer(name: str) -> Scorer:
    """Return the scorer registered as ``name`` in SCORERS, or import ``"package.module:function"``.

    Raises ValueError for an unknown name or a dotted path that does not import to a callable.
    """
    if name in SCORERS:
        return SCORERS[name]
    if ":" not in name:
        known = ", ".join(sorted(SCORERS))
        raise ValueError(f"unknown scorer {name!r}; known: {known}, or a 'module:function' path")
    return import_path(name, kind="scorer")
