"""Run environment steps (the tools) outside the generator process, each with a timeout.

``ToolRunner(name, timeout_s=..., num_workers=N)`` keeps N spawned worker processes that each build
the environment ``name`` once and answer ``step(state, turn)`` calls sent as JSON over a pipe (no
pickle, so state must be JSON: the same state a checkpoint keeps). A call that raises comes back as
an error observation; one that runs past ``timeout_s`` has its worker killed and replaced and comes
back as a timeout observation. Neither ends the run: both are counted (``num_errors``,
``num_timeouts``) and the episode goes on with the observation ``[tool error: ...]`` (the state is
left as it was). A programming error does end it: ``step`` returning anything but a ``Turn`` of the
documented types with a JSON state raises ``EnvironmentContractError`` here, one line naming the
environment and ``step`` (llamarl/environments/base.py), at the first such call.
``num_workers=0`` runs steps inline in the calling process (unit tests; the
timeout is then enforced with SIGALRM, main thread only).

Tensor parallelism: the ranks of a TP group run the same episodes and must append the same
observation ids, or their next forwards diverge (and their collectives hang). A step is a pure
function of its state and turn, but a timeout, a crashed worker or a tool that reads the world
(time, a file, a service) can still answer two peers differently. So with ``share=TurnShare(...)``
only the TP group's first rank runs the tools; it broadcasts the answers as JSON bytes over the TP
group and its peers use those (they start no workers and count nothing: the first rank reports).
"""

from __future__ import annotations

import json
import logging
import multiprocessing
import signal
import time
from dataclasses import asdict, dataclass, fields
from multiprocessing.connection import Connection, wait

import torch
import torch.distributed as dist

from llamarl.environments.base import EnvironmentContractError, Turn, check_turn
from llamarl.environments.building import build_environment

logger = logging.getLogger(__name__)


class _Timeout(Exception):
    pass


def _alarm(signum, frame) -> None:
    raise _Timeout


def _worker_main(conn: Connection, name: str) -> None:
    environment = build_environment(name)
    try:
        conn.send_bytes(b"ready")
    except OSError:  # the parent ended (failed) while this worker started: its own line says why
        return
    while True:
        try:
            message = json.loads(conn.recv_bytes())
        except (EOFError, OSError):  # the parent went away (ended, or failed): end quietly
            return
        try:
            turn = environment.step(message["state"], message["turn"])
        except Exception as exc:  # noqa: BLE001 - any failure of a tool is an observation, not a crash
            reply = {"error": f"{type(exc).__name__}: {exc}"}
        else:
            try:
                reply = {"ok": check_turn(name, turn)}
            except EnvironmentContractError as exc:  # a programming error: the runner stops the run
                reply = {"fatal": str(exc)}
        try:
            conn.send_bytes(json.dumps(reply).encode())
        except OSError:  # the parent went away mid-turn: its own failure line says why
            return


@dataclass
class TurnShare:
    """One TP group's agreement on tool answers (module docstring): ``src`` (global rank, the TP
    group's first) runs the tools and broadcasts over ``group``; tensors on ``device`` (the
    group's backend's: CUDA under NCCL)."""

    group: dist.ProcessGroup
    src: int
    device: torch.device

    def is_source(self) -> bool:
        return dist.get_rank() == self.src

    def broadcast(self, turns: list[Turn] | None, *, num_calls: int) -> list[Turn]:
        """The source's ``turns``, on every rank of the group (the source passes them, peers None)."""
        if self.is_source():
            payload = json.dumps([asdict(t) for t in turns]).encode()
            size = torch.tensor([len(payload)], dtype=torch.int64, device=self.device)
        else:
            size = torch.zeros(1, dtype=torch.int64, device=self.device)
        dist.broadcast(size, src=self.src, group=self.group)
        if self.is_source():
            data = torch.frombuffer(bytearray(payload), dtype=torch.uint8).to(self.device)
        else:
            data = torch.empty(int(size.item()), dtype=torch.uint8, device=self.device)
        dist.broadcast(data, src=self.src, group=self.group)
        if self.is_source():
            return turns
        received = json.loads(bytes(data.cpu().tolist()))
        names = {f.name for f in fields(Turn)}
        if not isinstance(received, list) or len(received) != num_calls or \
                any(not isinstance(t, dict) or not set(t) <= names for t in received):
            raise RuntimeError(f"TP rank {dist.get_rank()}: the tool answers from rank {self.src} do not match "
                               f"this rank's {num_calls} calls (the TP peers' episodes diverged)")
        return [Turn(**t) for t in received]


class ToolRunner:
    """See the module docstring."""

    def __init__(self, name: str, *, timeout_s: float, num_workers: int = 1, share: TurnShare | None = None) -> None:
        if timeout_s <= 0:
            raise ValueError(f"tool timeout must be > 0, got {timeout_s}")
        if num_workers < 0:
            raise ValueError(f"num_workers must be >= 0, got {num_workers}")
        self.name, self.timeout_s, self.share = name, timeout_s, share
        self.num_errors = self.num_timeouts = self.num_calls = 0
        self._warned: set[str] = set()  # the kinds of tool failure already printed (_failed)
        if share is not None and not share.is_source():
            num_workers = 0  # a TP peer receives its answers: no processes of its own
        self._inline = build_environment(name) if num_workers == 0 else None
        self._context = multiprocessing.get_context("spawn")
        self._workers = [self._start() for _ in range(num_workers)]

    def _start(self):
        parent, child = self._context.Pipe()
        process = self._context.Process(target=_worker_main, args=(child, self.name), daemon=True)
        process.start()
        child.close()
        if not parent.poll(120) or parent.recv_bytes() != b"ready":
            process.kill()
            raise RuntimeError(f"a tool worker for environment {self.name!r} did not start")
        return process, parent

    def _failed(self, state: dict, message: str, *, timeout: bool) -> Turn:
        if timeout:
            self.num_timeouts += 1
        else:
            self.num_errors += 1
        # A policy that keeps making the same mistake would print a line per call (tens a tick):
        # each kind of failure (a timeout, or an exception's type) is printed once, the rest counted
        # (env_tool_errors / env_tool_timeouts, tool_err= on the progress line).
        kind = "timeout" if timeout else message.split(":", 1)[0]
        if kind not in self._warned:
            self._warned.add(kind)
            logger.warning("environment %r: %s (further %s failures are counted, not printed)", self.name, message,
                           "timeout" if timeout else kind)
        else:
            logger.debug("environment %r: %s", self.name, message)
        return Turn(observation=f"[tool error: {message}]", state=state, error=message)

    def run(self, calls: list[tuple[dict, str]]) -> list[Turn]:
        """``step(state, turn)`` for each call, in order (spread over the workers); with ``share``,
        collective over the TP group (every peer calls it with the same calls)."""
        if self.share is None:
            return self._run(calls)
        if not self.share.is_source():
            return self.share.broadcast(None, num_calls=len(calls))
        return self.share.broadcast(self._run(calls), num_calls=len(calls))

    def _run(self, calls: list[tuple[dict, str]]) -> list[Turn]:
        self.num_calls += len(calls)
        if self._inline is not None:
            return [self._run_inline(state, turn) for state, turn in calls]
        results: list[Turn | None] = [None] * len(calls)
        pending = list(range(len(calls)))
        idle = list(range(len(self._workers)))
        busy: dict[int, tuple[int, float]] = {}  # worker -> (call, deadline)
        while pending or busy:
            while pending and idle:
                worker, call = idle.pop(), pending.pop(0)
                state, turn = calls[call]
                self._workers[worker][1].send_bytes(json.dumps({"state": state, "turn": turn}).encode())
                busy[worker] = (call, time.monotonic() + self.timeout_s)  # the clock starts at hand-over
            conns = {self._workers[w][1]: w for w in busy}
            ready = wait(list(conns), timeout=max(0.0, min(d for _, d in busy.values()) - time.monotonic()))
            now = time.monotonic()
            for worker, (call, deadline) in list(busy.items()):
                if deadline <= now and self._workers[worker][1] not in ready:  # hung: replace its worker
                    del busy[worker]
                    self._workers[worker][0].kill()
                    self._workers[worker] = self._start()
                    results[call] = self._failed(calls[call][0], f"step timed out after {self.timeout_s} s",
                                                 timeout=True)
                    idle.append(worker)
            for conn in ready:
                worker = conns[conn]
                call, _ = busy.pop(worker)
                try:
                    reply = json.loads(conn.recv_bytes())
                except (EOFError, OSError):
                    self._workers[worker] = self._start()
                    reply = {"error": "the tool worker died"}
                if "fatal" in reply:
                    raise EnvironmentContractError(reply["fatal"])
                results[call] = Turn(**reply["ok"]) if "ok" in reply else \
                    self._failed(calls[call][0], reply["error"], timeout=False)
                idle.append(worker)
        return results

    def _run_inline(self, state: dict, turn: str) -> Turn:
        previous = signal.signal(signal.SIGALRM, _alarm)
        signal.setitimer(signal.ITIMER_REAL, self.timeout_s)
        try:
            answer = self._inline.step(state, turn)
        except _Timeout:
            return self._failed(state, f"step timed out after {self.timeout_s} s", timeout=True)
        except Exception as exc:  # noqa: BLE001
            return self._failed(state, f"{type(exc).__name__}: {exc}", timeout=False)
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous)
        return Turn(**check_turn(self.name, answer))

    def counts(self) -> dict[str, int]:
        """The cumulative counters, as the generator logs (``env_tool_<key>``) and checkpoints them."""
        return {"calls": self.num_calls, "errors": self.num_errors, "timeouts": self.num_timeouts}

    def restore_counts(self, counts: dict) -> None:
        """Continue the counters of a checkpointed run (``counts()``'s keys; missing ones are 0)."""
        self.num_calls, self.num_errors, self.num_timeouts = (
            int(counts.get(key, 0)) for key in ("calls", "errors", "timeouts"))

    def close(self) -> None:
        """Stop the workers (idempotent)."""
        for process, conn in self._workers:
            conn.close()
            process.kill()
            process.join(timeout=5)
        self._workers = []
