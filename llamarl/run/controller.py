"""ExecutorController: the SPMD event loop of LlamaRL Algorithm 1, run identically on every rank.

One tick, on every rank (each rank takes part only in what involves its executor):

1. every **next-tick** channel (``same_tick=False``) is communicated, in channel order: it carries
   what its outbound executor produced at the previous tick;
2. then, for each executor E in data order (``executor_order``): E's inbound **same-tick**
   channels (``same_tick=True``) are communicated, so E receives what its producer made earlier
   in this tick, and E steps.

A same-tick channel must go forward in ``executor_order`` (its outbound steps first). Every rank
walks the same sequence, so each point-to-point exchange is posted by both ends in the same order.
The schedules of the generator -> reward -> trainer -> generator pipeline are cases of this rule:

- ``async``, LlamaRL Algorithm 1 as written (every channel next-tick): all executors step
  concurrently; rollouts of tick t are scored at t+1 and trained on at t+2 (lag 2; the trainer
  idles for ticks 0-1). Timeline of a tick: [channels] [gen | rew | train, concurrently].
- ``async`` with lag 1 (rollouts same-tick; scored and weights next-tick): the reward scores right
  after generation, so the trainer trains at t+1 on data one version old and starts at tick 1.
  Timeline: [scored, weights] [gen, then rew | train concurrently with both].
- ``sync`` (rollouts and scored same-tick, weights next-tick): gen, then rew, then train, one after
  another; generation at tick t uses the weights of training at t-1: strictly on-policy.
  Timeline: [weights] [gen] [rollouts] [rew] [scored] [train].

Co-resident executors (stages sharing ranks, ``llamarl/run/stages.py``): a rank hosting several
executors steps each of them at its place in the data order, with its own context and tick record;
a channel between two of them is handed over in memory on the rank (``llamarl/channels/in_memory.py``:
data channels where the network channel would run, weights at the end of the tick).

A rank whose executor raises prints one line naming the executor, global / local rank, step and
the exception, then exits the process with code 1 at once; torchrun (or the test harness) then
tears the other ranks down, and every group's collective timeout bounds any wait on a dead peer.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import torch

from llamarl.channels.base import check_delivery_order, check_endpoints
from llamarl.channels.in_memory import InMemoryChannel, InMemoryWeights
from llamarl.runtime.errors import exception_text
from llamarl.runtime.executor import Executor
from llamarl.runtime.liveness import Heartbeat
from llamarl.runtime.world import ExecutorContext


@dataclass
class TickRecord:
    """Per-tick timing of this rank: seconds in channels and in its executor's step."""

    step: int
    channel_seconds: float
    step_seconds: float
    start: float = 0.0
    step_spans: list[tuple[float, float]] = field(default_factory=list)
    channel_spans: list[tuple[str, float, float]] = field(default_factory=list)  # (channel, start, end), wall


@dataclass
class Upkeep:
    """What the controller itself does around the ticks besides stepping: exports, the device guard,
    the liveness watch and failing ranks' tracebacks (each off by default). Checkpoints are the
    ``RunHooks``' (``llamarl/run/checkpoints.py``)."""

    export_every: int = 0
    """Export after every this many ticks (0: none but the final export)."""
    export_dir: Path | None = None
    """Where ``step_<n>`` / ``final`` exports go (None: no export)."""
    export_final: bool = True
    """Export once more after the last tick, to ``export_dir/final`` (``--export.final``)."""
    device_guard: bool = False
    """torch's default device is ``meta`` inside steps, channels and evaluations (see ``guard``)."""
    liveness_timeout_s: float | None = None
    """A rank silent this long ends the job (llamarl/runtime/liveness.py); None: no watch."""
    traceback_dir: Path | None = None
    """Where a failing rank writes its full traceback (``rank<r>.traceback.txt``, named in its
    one-line report); None: the traceback goes to stderr above the line."""


At = Callable[..., None]
"""``at(phase, executor=None)``: names what this rank does now, for its failure line and its
heartbeat (``ExecutorController.at``)."""


class RunHooks(Protocol):
    """Everything the controller calls for the run besides executors and channels, as ONE object.

    Implemented by ``RunCheckpoints`` (``llamarl/run/checkpoints.py``) for ``run_pipeline``, and by
    ``Hooks`` (no checkpoints, no evaluations) for a controller run on its own. Called on every rank,
    in this order:

    1. after every executor's ``init``: ``restore(executors, at)``, a resumed run's
       ``load_checkpoint`` of each executor (nothing for a fresh run);
    2. under the device guard, after the init channels: ``before_loop()`` (the base evaluation);
    3. for each tick ``step`` from ``start_step`` to ``max_steps - 1``, after its channels and steps:
       ``on_tick(step, {executor name: (executor, TickRecord)})`` (metrics and progress, reduced over
       WORLD), then ``save(step + 1, executors, at)`` (the checkpoint of the state after ``step + 1``
       ticks, when one is due), then the controller's export (``upkeep.export_every``), then
       ``after_tick(step)`` (the evaluation due then, whose record goes into that checkpoint's
       runner state). A tick's metrics are on disk before a checkpoint that covers it is
       committed, so a run killed right after the commit and resumed from it logs every tick;
    4. after the last tick, the controller's final export (``upkeep.export_final``).

    ``upkeep``: what the controller does itself (exports, device guard, liveness, tracebacks).
    ``at(phase, executor=None)``: the hook names what it is doing (failure lines, heartbeats).

    Design: logging (``on_tick``) and the base evaluation (``before_loop``) are not checkpointing,
    but they are composed into this one object rather than kept as hooks of their own: the
    controller's order between them and the checkpoint (metrics before the commit, the evaluation's
    record after it) is one contract, stated once here, and the controller takes one argument.
    The controller names the phase of ``before_loop``, ``on_tick`` and ``after_tick`` itself (also
    when a hook does nothing there); ``restore`` and ``save`` name theirs with ``at``.
    """

    upkeep: Upkeep
    start_step: int
    """The ticks already run (a resumed run's checkpoint step; 0 for a fresh run)."""

    def restore(self, executors: Mapping[str, Executor], at: At) -> None: ...

    def before_loop(self) -> None: ...

    def on_tick(self, step: int, ticked: dict[str, tuple[Executor, TickRecord]]) -> None: ...

    def save(self, step: int, executors: Mapping[str, Executor], at: At) -> None: ...

    def after_tick(self, step: int) -> None: ...


@dataclass
class Hooks:
    """The ``RunHooks`` of a controller run without checkpoints or evaluations (tests, benchmarks):
    its ``upkeep`` and, as ``on_tick``, ``tick`` (None: nothing); a fresh start at step 0."""

    upkeep: Upkeep = field(default_factory=Upkeep)
    tick: Callable[[int, dict[str, tuple[Executor, TickRecord]]], None] | None = None
    start_step = 0  # not a field: nothing to resume

    def restore(self, executors: Mapping[str, Executor], at: At) -> None:
        pass

    def before_loop(self) -> None:
        pass

    def on_tick(self, step: int, ticked: dict[str, tuple[Executor, TickRecord]]) -> None:
        if self.tick is not None:
            self.tick(step, ticked)

    def save(self, step: int, executors: Mapping[str, Executor], at: At) -> None:
        pass

    def after_tick(self, step: int) -> None:
        pass


class ExecutorController:
    """Runs this rank's executor(s) under ``channels`` for ``max_steps`` ticks.

    ``ctx`` / ``executor`` are this rank's context and executor, or, on a rank hosting co-resident
    executors, mappings from executor name to each (same keys; every context of the same rank).
    ``executor_order`` is the data order of executor names (same-tick channels follow it).
    ``init_channels`` run once after ``init`` (e.g. initial weights). ``hooks`` (``RunHooks``;
    None: ``Hooks()``, nothing but the loop) is everything else the run does, and when: resuming
    (``hooks.start_step``, ``restore``), the base evaluation, each tick's metrics, checkpoints and
    evaluations (``RunHooks`` says in which order), and the controller's own ``hooks.upkeep``.
    Exports (``upkeep.export_every`` ticks, and once after the last tick when
    ``upkeep.export_final``; none without ``upkeep.export_dir``): ``executor.export(export_dir/step_{n})``
    / ``export_dir/final`` on every rank.
    ``upkeep.liveness_timeout_s`` (None: off) starts a ``Heartbeat`` (llamarl/runtime/liveness.py): a rank
    silent that long ends the job with a line naming it, independently of the collective timeout.

    ``max_steps`` >= 0 is checked here although ``--run.max-steps`` is checked at flag parsing: this
    constructor is public (tests and benchmarks build a controller without a config).
    """

    _active: str | None = None  # the executor this rank is working for now (failure lines)
    _aborting = False  # abort is reporting this rank's failure: torchrun's SIGTERM waits for it (_on_sigterm)

    def __init__(
        self,
        ctx: ExecutorContext | Mapping[str, ExecutorContext],
        executor: Executor | Mapping[str, Executor],
        channels: list,
        *,
        max_steps: int,
        executor_order: list[str],
        init_channels: list | None = None,
        hooks: RunHooks | None = None,
    ) -> None:
        if max_steps < 0:
            raise ValueError(f"max_steps must be >= 0, got {max_steps}")
        contexts = dict(ctx) if isinstance(ctx, Mapping) else {getattr(ctx, "executor", None): ctx}
        executors = dict(executor) if isinstance(executor, Mapping) else {getattr(ctx, "executor", None): executor}
        ranks = next(iter(contexts.values())).ranks
        check_endpoints(channels + (init_channels or []), list(ranks))
        if set(executor_order) != set(ranks):
            raise ValueError(f"executor order {executor_order} does not match the world's executors {list(ranks)}")
        check_delivery_order(channels, executor_order)
        if set(contexts) != set(executors):
            raise ValueError(f"contexts for {sorted(contexts)} but executors for {sorted(executors)}")
        self.contexts, self.executors = contexts, executors
        self.ctx, self.executor = next(iter(contexts.values())), next(iter(executors.values()))
        self.channels = channels
        self.init_channels = init_channels or []
        self.hooks = hooks if hooks is not None else Hooks()
        self.max_steps, self.start_step = max_steps, self.hooks.start_step
        self.executor_order = executor_order
        upkeep = self.upkeep = self.hooks.upkeep
        self.device_guard = upkeep.device_guard
        self.export_every, self.export_dir = upkeep.export_every, upkeep.export_dir
        if upkeep.liveness_timeout_s is not None:
            executor_of: dict[int, str] = {}
            for name, rs in ranks.items():  # co-resident executors share a rank: name them all
                for r in rs:
                    executor_of[r] = f"{executor_of[r]}+{name}" if r in executor_of else name
            self.heartbeat = Heartbeat(rank=self.ctx.rank, world_size=self.ctx.world_size,
                                       timeout_s=upkeep.liveness_timeout_s, executor_of=executor_of)
        else:
            self.heartbeat = None
        self._phase, self.step_index = "init", self.start_step

    @property
    def phase(self) -> str:
        """What this rank is doing now (in failure messages and heartbeats)."""
        return self._phase

    @phase.setter
    def phase(self, value: str) -> None:
        self._phase = value
        if self.heartbeat is not None:
            self.heartbeat.update(step=self.step_index, phase=value)

    def at(self, phase: str, executor: str | None = None) -> None:
        """Name what this rank is doing now (``phase``; for ``executor`` when given, else for the
        executor named last): the hooks' way to say it (``RunHooks``)."""
        if executor is not None:
            self._active = executor
        self.phase = phase

    # ----- the loop -----
    def run(self) -> None:
        """Run init, init channels and every tick; on any exception report and exit(1)."""
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, self._on_sigterm)
        try:
            if self.heartbeat is not None:
                self.heartbeat.start()
            for name, executor in self.executors.items():
                self._active, self.phase = name, "init"
                executor.init()
            self.hooks.restore(self.executors, self.at)
            with self.guard():
                for channel in self.init_channels:
                    self._communicate(channel, None, label="init channel")
                self.phase = "before_loop"
                self.hooks.before_loop()
            for step in range(self.start_step, self.max_steps):
                self.step_index = step
                self._tick(step)
            if self.export_dir is not None and self.upkeep.export_final:
                for name, executor in self.executors.items():
                    self._active, self.phase = name, "export"
                    executor.export(Path(self.export_dir) / "final")
        except BaseException as exc:  # noqa: BLE001 - any failure must take the world down
            self.abort(exc)

    def _on_sigterm(self, signum, frame) -> None:
        """torchrun stops the other ranks as soon as one ends, often before they notice the dead peer
        themselves: say where this rank was and which executor owns which ranks, so torchrun's
        "root cause: rank r" line can be read as an executor.

        A rank already in ``abort`` ignores it: it has printed its own failure line and exits by
        itself once it has named the silent peers (a bounded wait, well inside torchrun's 30 s
        before SIGKILL). torchrun notices the dead peer on its own schedule (``--monitor-interval``),
        often while this rank waits on the heartbeats, and stopping it there lost the one line
        that names the dead rank."""
        if self._aborting:
            return
        if self.heartbeat is not None and self.heartbeat.failure_reporter() not in (None, self.ctx.rank):
            os._exit(128 + signum)  # a peer failed and reported it: one line for the job (liveness.py)
        owners = ", ".join(f"{name} {ranks}" for name, ranks in self.ctx.ranks.items())
        print(f"llamarl: executor {self._active or self.ctx.executor!r} (rank {self.ctx.rank}, local rank {self.ctx.local_rank}) "
              f"stopped at step {self.step_index} during {self.phase}: terminated by torchrun after another rank "
              f"ended; executors by rank: {owners}", file=sys.stderr, flush=True)
        os._exit(128 + signum)

    def finish(self) -> None:
        """Mark this rank's clean end for the liveness watch (call last, after any collective)."""
        if self.heartbeat is not None:
            self.heartbeat.finish()

    def guard(self):
        """The device guard (``device_guard=True``): torch's default device is ``meta`` inside it.

        A tensor created without an explicit device then lands on ``meta`` and fails at its first
        use with a real tensor, or when read, which is how a CPU run catches what would otherwise be
        a device-mismatch crash on a user's GPU. Model loading (``init``) is not guarded.
        """
        return torch.device("meta") if self.device_guard else contextlib.nullcontext()

    def _tick(self, step: int) -> None:
        records = {name: TickRecord(step=step, channel_seconds=0.0, step_seconds=0.0, start=time.time())
                   for name in self.executors}
        for name, executor in self.executors.items():
            self._active, self.phase = name, "set_step"
            executor.set_step(step)
        for channel in self.channels:
            if not getattr(channel, "same_tick", False) and not isinstance(channel, InMemoryWeights):
                self._communicate(channel, records)
        for name in self.executor_order:
            for channel in self.channels:
                if getattr(channel, "same_tick", False) and channel.inbound == name:
                    self._communicate(channel, records)
            if name in self.executors:
                self._step(name, records[name])
        for channel in self.channels:  # co-resident weights: the new policy before checkpoint / eval
            if isinstance(channel, InMemoryWeights):
                self._communicate(channel, records)
        # on_tick reduces metrics over WORLD: a dead peer surfaces here, name the phase.
        self._active, self.phase = None, "metrics all-reduce (on_tick)"
        self.hooks.on_tick(step, {name: (self.executors[name], records[name]) for name in self.executors})
        self.hooks.save(step + 1, self.executors, self.at)
        if self.export_every and (step + 1) % self.export_every == 0 and self.export_dir is not None:
            for name, executor in self.executors.items():
                self._active, self.phase = name, "export"
                executor.export(Path(self.export_dir) / f"step_{step + 1}")
        self._active, self.phase = None, "after_tick"
        self.hooks.after_tick(step)

    def _communicate(self, channel, records: dict[str, TickRecord] | None, *, label: str = "channel") -> None:
        """Run ``channel`` for whichever of this rank's executors it involves: in memory when it joins
        two of them, else over the network for its end here; a no-op when it involves none. The
        time goes to the inbound executor's record when it is here, else to the outbound's."""
        # The endpoints name the executor at fault when a peer died mid-exchange.
        self.phase = f"{label} {channel.name!r} ({channel.outbound} -> {channel.inbound})"
        ends = [name for name in (channel.inbound, channel.outbound) if name in self.executors]
        if not ends:
            return
        self._active = ends[0]
        start, start_wall = time.perf_counter(), time.time()
        with self.guard():
            if isinstance(channel, (InMemoryChannel, InMemoryWeights)):
                channel.hand_over(self.executors[channel.outbound], self.executors[channel.inbound])
            else:
                channel.communicate(self.contexts[ends[0]], self.executors[ends[0]])
        if records is not None:
            records[ends[0]].channel_seconds += time.perf_counter() - start
            records[ends[0]].channel_spans.append((channel.name, start_wall, time.time()))

    def communicate_now(self, channel) -> None:
        """Run ``channel`` once outside the tick loop (the final weights before the last evaluation)."""
        self._communicate(channel, None, label="final channel")

    def _step(self, name: str, record: TickRecord) -> None:
        self._active, self.phase = name, "step"
        executor = self.executors[name]
        if getattr(executor, "num_threads", None):  # co-resident executors each run with their own
            torch.set_num_threads(executor.num_threads)
        start_wall, start = time.time(), time.perf_counter()
        with self.guard():
            executor.step()
        record.step_seconds += time.perf_counter() - start
        record.step_spans.append((start_wall, time.time()))

    def failure_line(self, exc: BaseException) -> str:
        """The one-line failure report of ``exc`` here: executor, global / local rank, step, phase, then
        the exception's type and its whole message on one line (``errors.exception_text``), so that a
        message whose first line is empty still says what happened."""
        text = exception_text(exc)
        name = self._active or self.ctx.executor
        ctx = getattr(self, "contexts", {}).get(name, self.ctx)
        return (f"llamarl: executor {name!r} (rank {ctx.rank}, local rank "
                f"{ctx.local_rank}) failed at step {self.step_index} during {self.phase}: "
                f"{type(exc).__name__}{': ' + text if text else ''}")

    def _save_traceback(self, exc: BaseException) -> Path | None:
        """Write ``exc``'s traceback to ``upkeep.traceback_dir/rank<r>.traceback.txt``; its path, or
        None when there is no such directory or it cannot be written (then stderr has it)."""
        if self.upkeep.traceback_dir is None:
            return None
        try:
            path = Path(self.upkeep.traceback_dir) / f"rank{self.ctx.rank}.traceback.txt"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(f"{self.failure_line(exc)}\n\n" + "".join(traceback.format_exception(exc)))
            return path
        except OSError:  # a full disk, most likely: the traceback goes to stderr instead
            return None

    def abort(self, exc: BaseException) -> None:
        """Report ``exc`` (its traceback, then ``failure_line``) and end this process (exit code 1).

        When the heartbeat runs, also name each peer whose heartbeat went silent
        (``Heartbeat.silent_peers``): a collective that lost a rank says only "Connection closed by
        peer", and it can fail in any phase (a channel, a barrier, the metrics all-reduce, a
        trainer's FSDP collective inside ``step``), so every failure asks; this costs a failing
        rank 2.5 heartbeat intervals (at most 5 s) before it exits, and a rank that failed on its
        own (a user error) finds no silent peer and prints nothing more. torchrun's SIGTERM does
        not cut this report short (``_on_sigterm``). Only the job's first failing rank reports
        (``Heartbeat.claim_failure``): a rank failing after a peer reported exits quietly, its
        traceback in its file."""
        self._aborting = True
        message = self.failure_line(exc)
        code = getattr(exc, "exit_code", 1)
        code = code if isinstance(code, int) and 0 < code < 128 else 1
        first = self.heartbeat is None or self.heartbeat.claim_failure()
        saved = self._save_traceback(exc)
        if not first:  # a peer failed first and reported it; this failure follows from it (liveness.py)
            sys.stdout.flush()
            os._exit(code)
        if saved is None:
            traceback.print_exc(file=sys.stderr)
        else:
            message += f" (traceback: {saved})"
        print(message, file=sys.stderr, flush=True)
        sys.stdout.flush()
        if self.heartbeat is not None:
            for rank, last in self.heartbeat.silent_peers():
                print(f"llamarl: rank {rank} (executor {self.heartbeat.executor_of.get(rank, '?')!r}) stopped "
                      f"responding at step {last.get('step', '?')} during {last.get('phase', 'start-up')}; "
                      f"noticed by rank {self.ctx.rank} when its {self.phase} failed", file=sys.stderr, flush=True)
        # os._exit: never run atexit / destructors that may block on collectives with dead peers. An
        # exception may name its own code (``exit_code``: e.g. 3, a run without learning signal).
        os._exit(code)
