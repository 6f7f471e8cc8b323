"""A run that learns nothing says so: the trainer's watch over ticks without a learning signal.

A tick has no signal when every prompt group the trainer received scored alike (every advantage
0): no optimizer step runs (``skipped_no_signal``). A scorer that never matches, a tool call the
environment never parses, a prompt the model cannot answer: the run goes on, silent, while nothing
is trained. ``SignalWatch`` counts such ticks in a row on the trainer (every trainer rank sees the
same global counts, so all agree):

- after ``warn_after`` of them (default 3), its first rank logs one warning with what the batch
  looked like (reward mean, the fraction of samples that ended with an end-of-sequence rather than
  the token limit) and where to look;
- with ``--run.stop-on-no-signal K``, the K-th raises ``NoSignal``, which ends the run with its
  one line and exit code 3 (``NoSignal.exit_code``; the controller exits with it).

A tick whose batch was empty (nothing reached the trainer yet: async lag) is not counted.
"""

from __future__ import annotations

import logging

logger = logging.getLogger("llamarl.trainer")

WARN_AFTER = 3


class NoSignal(RuntimeError):
    """``--run.stop-on-no-signal`` ticks in a row without a learning signal (module docstring)."""

    exit_code = 3


class SignalWatch:
    """Counts ticks without signal in a row (module docstring)."""

    def __init__(self, *, stop_after: int | None, warn_after: int = WARN_AFTER, reports: bool = True) -> None:
        """``stop_after``: ``--run.stop-on-no-signal`` (None: never stop); ``reports``: this rank logs."""
        if stop_after is not None and stop_after < 1:
            raise ValueError(f"--run.stop-on-no-signal must be >= 1, got {stop_after}")
        self.stop_after, self.warn_after, self.reports = stop_after, warn_after, reports
        self.streak = 0

    def observe(self, *, had_batch: bool, signal: bool, reward_mean: float, ended_fraction: float,
                version: int) -> None:
        """One tick's outcome: ``had_batch`` (the trainer got samples), ``signal`` (some group had a
        reward spread, so an update ran or could), the batch's reward mean and the fraction of its
        samples that ended on an end-of-sequence token. Raises ``NoSignal`` at the stop threshold."""
        if not had_batch:
            return
        if signal:
            self.streak = 0
            return
        self.streak += 1
        if self.stop_after is not None and self.streak >= self.stop_after:
            raise NoSignal(f"no learning signal for {self.streak} ticks in a row (--run.stop-on-no-signal "
                           f"{self.stop_after}): every group's samples scored alike (reward mean {reward_mean:.3f}, "
                           f"{ended_fraction:.0%} ended before the token limit) at trainer version {version}; "
                           "check the scorer / parser on the samples (--run.log-samples) and the prompt")
        if self.reports and self.streak == self.warn_after:
            logger.warning("no learning signal for %d ticks in a row: every group's samples scored alike (reward mean "
                           "%.3f, %.0f%% ended before the token limit), so nothing was trained; look at the samples "
                           "(--run.log-samples N writes them to the run's samples.jsonl), the prompt and the scorer's "
                           "parser; --run.stop-on-no-signal K ends such a run", self.streak, reward_mean,
                           100 * ended_fraction)

    def state(self) -> dict:
        """For the trainer's checkpoint: the streak (a resumed run counts on)."""
        return {"no_signal_streak": self.streak}

    def load(self, state: dict) -> None:
        self.streak = int(state.get("no_signal_streak", 0))
