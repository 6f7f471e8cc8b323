"""Rank 0's progress bar: ticks, ETA and every executor's headline numbers, once per tick.

Each executor's metrics live on its own ranks, so the headline numbers are brought to rank 0 by
one small all-reduce over WORLD per tick (a float64 vector with a slot per ``(stage, metric)``
pair the pipeline declares, plus a "reported" flag per slot: each stage's first rank fills its
own slots, every other rank contributes zeros). Every rank runs it at the end of every tick,
after its executor's step. It adds no wait that the channels do not already impose: the next
tick's channels pair every executor with its producer and consumer anyway.

On a terminal, rank 0 draws a tqdm bar (seconds a tick, time left) with the tick and the headline
numbers as its postfix; elsewhere (a log file, CI) it logs one line per tick instead,
``tick <t> (<done>/<max> done, <s> s/tick, ~<left> left) <numbers>``, where a tick's seconds are
the mean of the ticks after the first (which also pays for start-up) once there are any. Ticks are
counted as the files count them: tick ``t`` is the record ``"step": t`` of ``metrics/*.jsonl``
(from 0), after which ``t + 1`` ticks are done. Other ranks print nothing per tick: their full
metrics are in ``<run>/metrics/<executor>.jsonl`` and TensorBoard.

``eval_bar`` is the tqdm bar of an evaluation (``llamarl/executors/evaluation_loop.py``), drawn by the rank that
reports it, on a terminal or not (in a log file it redraws at most every ``LOG_BAR_SECONDS``).

Every number shown is the tick's own. Some have a short name (``SHORT_NAMES``); a stage reporting
``env_tool_errors`` and ``env_tool_calls`` shows them together as ``tool_err=<failed>/<calls>``
(this tick's tool calls that raised or timed out, ``env_tool_errors + env_tool_timeouts``, of all
of them), so that a run whose tools all fail cannot look healthy; the first tick where every call
failed also logs a warning.
"""

from __future__ import annotations

import logging
import sys
import time

import torch
import torch.distributed as dist

logger = logging.getLogger("llamarl.progress")

SHORT_NAMES = {"env_tool_errors": "tool_err", "env_tool_calls": "tool_calls", "env_turns_mean": "turns"}
"""Metric -> the name the progress line shows it under."""

LOG_BAR_SECONDS = 10.0
"""Outside a terminal, an evaluation's bar redraws at most this often (each redraw lands in the log)."""


def eval_bar(total: int, *, desc: str, unit: str = "sample"):
    """A tqdm bar of ``total`` ``unit`` on stderr for an evaluation (module docstring); the caller
    updates and closes it (it is a context manager)."""
    from tqdm import tqdm

    tty = sys.stderr.isatty()
    return tqdm(total=total, desc=desc, unit=unit, file=sys.stderr, disable=False, dynamic_ncols=tty,
                mininterval=0.1 if tty else LOG_BAR_SECONDS, leave=True)


def duration_text(seconds: float) -> str:
    """``seconds`` as the line shows time left: ``42 s``, ``3 min 5 s``, ``2 h 07 min``."""
    seconds = max(0, round(seconds))
    if seconds < 60:
        return f"{seconds} s"
    if seconds < 3600:
        return f"{seconds // 60} min {seconds % 60} s"
    return f"{seconds // 3600} h {seconds % 3600 // 60:02d} min"


def progress_text(shown: dict[str, float]) -> str:
    """The progress line's ``name=value`` pairs of the gathered ``stage/metric`` values (module docstring)."""
    parts = []
    for name, value in shown.items():
        stage, _, key = name.rpartition("/")
        prefix = f"{stage}/" if stage else ""
        calls = shown.get(f"{prefix}env_tool_calls")
        if key in ("env_tool_calls", "env_tool_timeouts") and f"{prefix}env_tool_errors" in shown:
            continue  # shown with the errors
        if key == "env_tool_errors" and calls is not None:
            failed = value + shown.get(f"{prefix}env_tool_timeouts", 0.0)
            parts.append(f"{prefix}tool_err={failed:.4g}/{calls:.4g}")
        else:
            parts.append(f"{prefix}{SHORT_NAMES.get(key, key)}={value:.4g}")
    return " ".join(parts)


class Progress:
    """Collects the headline numbers of every stage on global rank 0 and shows them."""

    def __init__(self, *, keys: list[tuple[str, str]], max_steps: int, start_step: int, rank: int,
                 device: torch.device, use_bar: bool | None = None) -> None:
        """``keys``: ``(stage, metric)`` pairs in display order (the same list on every rank)."""
        self.keys, self.max_steps, self.rank, self.device = keys, max_steps, rank, device
        self.latest: dict[str, float] = {}
        self.warned_tools = False
        self.bar = None
        self.last_time = time.monotonic()
        self.tick_seconds: list[float] = []  # each tick's wall time on this rank, the first included
        if rank == 0 and (sys.stderr.isatty() if use_bar is None else use_bar):
            from tqdm import tqdm

            self.bar = tqdm(total=max_steps, initial=start_step, desc="llamarl", unit="tick", dynamic_ncols=True)

    def update(self, step: int, *, reported: dict[str, dict[str, float]]) -> dict[str, float]:
        """Collective over WORLD: every rank calls it once per tick. ``reported``: executor name ->
        its metrics, for each executor this rank reports for (their first rank; several when
        executors are co-resident, none elsewhere). Returns the gathered ``stage/metric`` values on
        rank 0 (only those reported this tick), an empty dict elsewhere."""
        values = torch.zeros(2 * len(self.keys), dtype=torch.float64, device=self.device)
        for index, (stage, key) in enumerate(self.keys):
            if key in reported.get(stage, {}):
                values[index] = float(reported[stage][key])
                values[len(self.keys) + index] = 1.0
        if self.keys:
            dist.all_reduce(values)
        if self.rank != 0:
            return {}
        gathered = values.tolist()
        shown = {f"{stage}/{key}": gathered[i] for i, (stage, key) in enumerate(self.keys)
                 if gathered[len(self.keys) + i] > 0}
        self.latest.update(shown)
        text = progress_text(shown)
        self._warn_tools(step, shown)
        now = time.monotonic()
        self.tick_seconds.append(now - self.last_time)
        self.last_time = now
        if self.bar is not None:
            self.bar.set_postfix_str(f"tick={step} {text}", refresh=False)
            self.bar.update(1)
        else:
            logger.info("%s", self.tick_line(step, text))
        return shown

    def seconds_per_tick(self) -> float:
        """The mean wall time of this segment's ticks after the first, or the first's while alone."""
        later = self.tick_seconds[1:] or self.tick_seconds
        return sum(later) / len(later) if later else 0.0

    def tick_line(self, step: int, text: str) -> str:
        """The line logged for tick ``step`` outside a terminal (module docstring)."""
        per_tick = self.seconds_per_tick()
        left = duration_text(per_tick * (self.max_steps - step - 1))
        return f"tick {step} ({step + 1}/{self.max_steps} done, {per_tick:.2f} s/tick, ~{left} left) {text}".rstrip()

    def _warn_tools(self, step: int, shown: dict[str, float]) -> None:
        """Once per run: a warning the first tick where every tool call of a stage failed."""
        if self.warned_tools:
            return
        for name, errors in shown.items():
            if name.endswith("env_tool_errors"):
                calls = shown.get(name.removesuffix("errors") + "calls", 0.0)
                errors += shown.get(name.removesuffix("errors") + "timeouts", 0.0)
                if calls > 0 and errors >= calls:
                    self.warned_tools = True
                    logger.warning("tick %d: every tool call failed (%d of %d; env_tool_errors and "
                                   "env_tool_timeouts in metrics/%s.jsonl, the lines above say why)",
                                   step, errors, calls, name.split("/")[0])
                    return

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
