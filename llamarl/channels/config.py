"""The trainer -> generator weight channel's settings (``--weights.*``): the mode and the bucket
bound of ``weights.py``.

A dataclass parsed by tyro at a recipe's entry point (``llamarl/rl/config.py`` composes every
section): every field has a docstring (tyro shows it in ``--help``), and it checks itself in
``__post_init__``, raising ``ValueError`` with one line naming the flag.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from llamarl.runtime.errors import check_flag


@dataclass
class WeightsConfig:
    """The trainer -> generator weight channel."""

    mode: Literal["ddma", "gather_broadcast"] = "ddma"
    """How trainer weights reach the generator: ``ddma`` (each trainer shard goes straight to the
    generator ranks that hold its slice; no rank assembles the full model) or
    ``gather_broadcast`` (all-gather on the trainer, its first rank sends everything; the
    verl / OpenRLHF way, kept for comparison and as a fallback)."""
    bucket_mb: float = 512.0
    """The most MiB one weight bucket holds. ``ddma``: a sync runs in rounds of at most this much
    per (trainer rank, generator rank) pair, each pair's buffer reused from round to round, so a
    rank holds about this much per peer instead of everything it sends or receives.
    ``gather_broadcast``: the trainer gathers, sends and drops one bucket of whole parameters at a
    time instead of the whole model. A single piece larger than the bound travels alone. 0: no
    bound (one bucket for everything). slime's ``--update-weight-buffer-size``, verl's
    ``update_weights_bucket_megabytes``."""

    def __post_init__(self) -> None:
        check_flag(self.bucket_mb >= 0, f"--weights.bucket-mb must be >= 0 (0: one bucket per pair), got {self.bucket_mb}")
