"""The trainer's learning-rate schedule: a pure function of the optimizer step.

``lr_at(step, ...)`` is the learning rate of the optimizer step that follows ``step`` steps already
taken (the trainer's ``version``), so a resumed run, whose checkpoint holds the version, continues
the schedule exactly: there is no scheduler state to save. With base rate ``lr``, ``W`` warm-up
steps and decay horizon ``D`` (both counted in optimizer steps)::

    step < W:        lr * (step + 1) / W                        (linear warm-up, first step lr / W)
    step >= W:       p = min(1, (step - W) / max(1, D - W))
        constant     lr
        linear       lr * (1 - p)                                (HF get_linear_schedule_with_warmup)
        cosine       lr * 0.5 * (1 + cos(pi * p))                (HF get_cosine_schedule_with_warmup)

so the first step after the warm-up runs at ``lr`` and the rate reaches 0 at step ``D`` (linear and
cosine; steps past ``D`` stay at 0). TRL / transformers count the same way except that their
warm-up starts at 0 (a first step that does not move the weights); here it starts at ``lr / W``.
"""

from __future__ import annotations

import math

SCHEDULES = ("constant", "linear", "cosine")


def lr_at(step: int, *, lr: float, schedule: str, warmup_steps: int = 0, decay_steps: int | None = None) -> float:
    """The learning rate of the optimizer step after ``step`` (>= 0) steps taken (module docstring).
    ``decay_steps`` (D) is needed by ``linear`` and ``cosine``; ValueError for an unknown schedule, a
    negative step, or a decaying schedule without a horizon."""
    if schedule not in SCHEDULES:
        raise ValueError(f"lr schedule must be one of {SCHEDULES}, got {schedule!r}")
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    if step < warmup_steps:
        return lr * (step + 1) / warmup_steps
    if schedule == "constant":
        return lr
    if decay_steps is None:
        raise ValueError(f"the {schedule} lr schedule needs its decay horizon (decay_steps)")
    progress = min(1.0, (step - warmup_steps) / max(1, decay_steps - warmup_steps))
    if schedule == "linear":
        return lr * (1.0 - progress)
    return lr * 0.5 * (1.0 + math.cos(math.pi * progress))
