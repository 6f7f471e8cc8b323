"""Run environment steps (the tools) outside the generator process, each with a timeout.

``ToolRunner(name, timeout_s=..., num_workers=N)`` keeps N spawned worker processes that each build
the environment ``name`` once and answer ``step(state, turn)`` calls sent as JSON over a pipe (no
pickle, so state must be JSON: the same state a checkpoint keeps). A call that raises comes back as
an error observation; one that runs past ``timeout_s`` has its worker killed and replaced and comes
back as a timeout observation. Neither ends the run: both are counted (``num_errors``,
``num_timeouts``) and the episode goes on with the observation ``[tool error: ...]`` (the state is
left as it was). ``num_workers=0`` runs steps inline in the calling process (unit tests; the
timeout is then enforced with SIGALRM, main thread only).
"""

from __future__ import annotations

import json
import logging
import multiprocessing
import signal
import time
from dataclasses import asdict
from multiprocessing.connection import Connection, wait

from llamarl.environments.base import Turn, build_environment

logger = logging.getLogger(__name__)


class _Timeout(Exception):
    pass


def _alarm(signum, frame) -> None:
    raise _Timeout


def _step_json(environment, message: dict) -> dict:
    turn = environment.step(message["state"], message["turn"])
    if not isinstance(turn, Turn):
        raise TypeError(f"step returned {type(turn).__name__}, expected a Turn")
    return asdict(turn)


def _worker_main(conn: Connection, name: str) -> None:
    environment = build_environment(name)
    conn.send_bytes(b"ready")
    while True:
        try:
            message = json.loads(conn.recv_bytes())
        except EOFError:
            return
        try:
            reply = {"ok": _step_json(environment, message)}
        except Exception as exc:  # noqa: BLE001 - any failure of a tool is an observation, not a crash
            reply = {"error": f"{type(exc).__name__}: {exc}"}
        conn.send_bytes(json.dumps(reply).encode())


class ToolRunner:
    """See the module docstring."""

    def __init__(self, name: str, *, timeout_s: float, num_workers: int = 1) -> None:
        if timeout_s <= 0:
            raise ValueError(f"tool timeout must be > 0, got {timeout_s}")
        if num_workers < 0:
            raise ValueError(f"num_workers must be >= 0, got {num_workers}")
        self.name, self.timeout_s = name, timeout_s
        self.num_errors = self.num_timeouts = self.num_calls = 0
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
        logger.warning("environment %r: %s", self.name, message)
        return Turn(observation=f"[tool error: {message}]", state=state, error=message)

    def run(self, calls: list[tuple[dict, str]]) -> list[Turn]:
        """``step(state, turn)`` for each call, in order (spread over the workers)."""
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
                results[call] = Turn(**reply["ok"]) if "ok" in reply else \
                    self._failed(calls[call][0], reply["error"], timeout=False)
                idle.append(worker)
        return results

    def _run_inline(self, state: dict, turn: str) -> Turn:
        previous = signal.signal(signal.SIGALRM, _alarm)
        signal.setitimer(signal.ITIMER_REAL, self.timeout_s)
        try:
            return Turn(**_step_json(self._inline, {"state": state, "turn": turn}))
        except _Timeout:
            return self._failed(state, f"step timed out after {self.timeout_s} s", timeout=True)
        except Exception as exc:  # noqa: BLE001
            return self._failed(state, f"{type(exc).__name__}: {exc}", timeout=False)
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous)

    def close(self) -> None:
        """Stop the workers (idempotent)."""
        for process, conn in self._workers:
            conn.close()
            process.kill()
            process.join(timeout=5)
        self._workers = []
