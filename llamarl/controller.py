"""ExecutorController: the SPMD event loop of LlamaRL Algorithm 1, run identically on every rank.

Schedules:

- ``async`` (default): each tick, every channel is communicated in the given order, then every
  executor steps concurrently on what arrived. A channel therefore carries what its outbound
  executor produced at the previous tick: with generator -> reward -> trainer -> generator,
  rollouts generated at tick t are scored at t+1 and trained on at t+2, while the generator
  already runs with the weights the trainer sent.
- ``sync``: within a tick, executors run one after another in data order (the order of the
  ``executors`` list): before executor E steps, the channels whose inbound is E are
  communicated (in channel order). Generation at tick t uses the weights from training at
  t-1 on data generated at t-1, so training is strictly on-policy.

A rank whose executor raises prints one line naming the executor, global / local rank, step and
the exception, then exits the process with code 1 at once; torchrun (or the test harness) then
tears the other ranks down, and every group's collective timeout bounds any wait on a dead peer.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from llamarl.channels.base import CommunicationChannel
from llamarl.executors.base import Executor
from llamarl.world import ExecutorContext

SCHEDULES = ("async", "sync")


@dataclass
class TickRecord:
    """Per-tick timing of this rank: seconds in channels and in its executor's step."""

    step: int
    channel_seconds: float
    step_seconds: float
    start: float = 0.0
    step_spans: list[tuple[float, float]] = field(default_factory=list)


class ExecutorController:
    """Runs ``executor`` (this rank's) under ``channels`` for ``max_steps`` ticks.

    ``executor_order`` is the data order of executor names (used by the sync schedule).
    ``init_channels`` run once after ``init`` (e.g. initial weights). ``on_tick`` is called on
    every rank after each tick with (step, executor, TickRecord) for metrics / progress.
    Checkpoints are saved to ``checkpoint_dir/step_{step}/{executor name}`` every
    ``checkpoint_every`` ticks (0 disables); ``step_{n}`` holds the state after ``n`` ticks, so a
    run resumes from it with ``resume_dir=.../step_{n}`` and ``start_step=n``.
    """

    def __init__(
        self,
        ctx: ExecutorContext,
        executor: Executor,
        channels: list[CommunicationChannel],
        *,
        max_steps: int,
        executor_order: list[str],
        init_channels: list[CommunicationChannel] | None = None,
        schedule: str = "async",
        start_step: int = 0,
        checkpoint_every: int = 0,
        checkpoint_dir: Path | None = None,
        on_tick: Callable[[int, Executor, TickRecord], None] | None = None,
        resume_dir: Path | None = None,
        device_guard: bool = False,
    ) -> None:
        if schedule not in SCHEDULES:
            raise ValueError(f"schedule must be one of {SCHEDULES}, got {schedule!r}")
        if max_steps < 0:
            raise ValueError(f"max_steps must be >= 0, got {max_steps}")
        unknown = [c.name for c in channels + (init_channels or [])
                   if c.outbound not in ctx.ranks or c.inbound not in ctx.ranks]
        if unknown or set(executor_order) != set(ctx.ranks):
            raise ValueError(f"channels {unknown} or executor order {executor_order} do not match "
                             f"the world's executors {list(ctx.ranks)}")
        if checkpoint_every and checkpoint_dir is None:
            raise ValueError("checkpoint_every > 0 needs a checkpoint_dir")
        self.ctx, self.executor, self.channels = ctx, executor, channels
        self.init_channels = init_channels or []
        self.max_steps, self.schedule, self.start_step = max_steps, schedule, start_step
        self.executor_order = executor_order
        self.checkpoint_every, self.checkpoint_dir = checkpoint_every, checkpoint_dir
        self.on_tick = on_tick
        self.resume_dir = resume_dir
        self.device_guard = device_guard
        self.records: list[TickRecord] = []
        self.phase, self.step_index = "init", start_step
        # Optional hook run on this rank after init and the init channels (e.g. a base evaluation).
        self.before_loop: Callable[[], None] | None = None

    # ----- the loop -----
    def run(self) -> None:
        """Run init, init channels and every tick; on any exception report and exit(1)."""
        try:
            self.phase = "init"
            self.executor.init()
            if self.resume_dir is not None:
                self.phase = "load_checkpoint"
                self.executor.load_checkpoint(Path(self.resume_dir) / self.ctx.executor)
            with self.guard():
                for channel in self.init_channels:
                    channel.communicate(self.ctx, self.executor)
                if self.before_loop is not None:
                    self.phase = "before_loop"
                    self.before_loop()
            for step in range(self.start_step, self.max_steps):
                self.step_index = step
                self._tick(step)
        except BaseException as exc:  # noqa: BLE001 - any failure must take the world down
            self._abort(exc)

    def guard(self):
        """The device guard (``device_guard=True``): torch's default device is ``meta`` inside it.

        A tensor created without an explicit device then lands on ``meta`` and fails at its first
        use with a real tensor, or when read, which is how a CPU run catches what would otherwise be
        a device-mismatch crash on a user's GPU. Model loading (``init``) is not guarded.
        """
        return torch.device("meta") if self.device_guard else contextlib.nullcontext()

    def _tick(self, step: int) -> None:
        record = TickRecord(step=step, channel_seconds=0.0, step_seconds=0.0, start=time.time())
        self.phase = "set_step"
        self.executor.set_step(step)
        if self.schedule == "async":
            self._communicate(self.channels, record)
            self._step(record)
        else:
            for name in self.executor_order:
                self._communicate([c for c in self.channels if c.inbound == name], record)
                if name == self.ctx.executor:
                    self._step(record)
        if self.checkpoint_every and (step + 1) % self.checkpoint_every == 0:
            self.phase = "checkpoint"
            directory = Path(self.checkpoint_dir) / f"step_{step + 1}" / self.ctx.executor
            directory.mkdir(parents=True, exist_ok=True)
            self.executor.save_checkpoint(directory)
        self.records.append(record)
        if self.on_tick is not None:
            self.on_tick(step, self.executor, record)

    def _communicate(self, channels: list[CommunicationChannel], record: TickRecord) -> None:
        for channel in channels:
            self.phase = f"channel {channel.name!r}"
            start = time.perf_counter()
            with self.guard():
                channel.communicate(self.ctx, self.executor)
            record.channel_seconds += time.perf_counter() - start

    def _step(self, record: TickRecord) -> None:
        self.phase = "step"
        start_wall, start = time.time(), time.perf_counter()
        with self.guard():
            self.executor.step()
        record.step_seconds += time.perf_counter() - start
        record.step_spans.append((start_wall, time.time()))

    def _abort(self, exc: BaseException) -> None:
        message = (f"llamarl: executor {self.ctx.executor!r} (rank {self.ctx.rank}, local rank "
                   f"{self.ctx.local_rank}) failed at step {self.step_index} during {self.phase}: "
                   f"{type(exc).__name__}: {exc}")
        traceback.print_exc(file=sys.stderr)
        print(message, file=sys.stderr, flush=True)
        sys.stdout.flush()
        # os._exit: never run atexit / destructors that may block on collectives with dead peers.
        os._exit(1)
