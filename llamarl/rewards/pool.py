"""Score (completion, reference) pairs, or (trajectory, problem) pairs, in worker processes with a
per-sample timeout.

Why not ``concurrent.futures.ProcessPoolExecutor``: it cannot tell when a queued task actually
starts (so a per-sample timeout would also charge time spent waiting behind a slow sample) and it
cannot kill one hung worker, only abandon the whole pool. Instead each worker here is a process with
its own pipe and holds at most one sample, so:

* a sample's timeout clock starts when it is handed to an idle worker;
* a sample that times out gets reward 0.0, and only its worker is killed and replaced, so a scorer
  that hangs forever never blocks the rest of the batch or later batches;
* a scorer that raises (or returns a non-finite value, or crashes its process) gives 0.0 too.
  Neither ever stops the run; both are counted in ``stats()``.

Workers use the ``spawn`` start method by default (``forkserver`` is allowed): ``fork`` is unsafe once
torch has started its threads in the parent. Worker start-up (importing the scorer) is not charged
to any sample's timeout. Messages are JSON over pipes, so completions must be plain strings; a
trajectory travels as its JSON (``Trajectory.to_json``) and is parsed, checked, in the worker.

``num_workers=0`` scores inline in the calling process: no process overhead (what unit tests of other
modules use), errors still give 0.0, and a per-call timeout is enforced with SIGALRM (main thread).

A replacement worker that fails to start (it exits, cannot load the scorer, or does not answer in
``startup_timeout_s``) is retried ``MAX_START_RETRIES`` times with a short backoff and counted in
``num_worker_start_failures``; only a pool whose very first workers cannot start raises at once.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import multiprocessing
import signal
import threading
import time
from collections import deque
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from types import TracebackType
from typing import Self

from llamarl.data.prompts import Problem
from llamarl.rewards import resolve_scorer
from llamarl.rewards.funcs import RewardFuncs
from llamarl.rewards.trajectory import Trajectory, resolve_trajectory_scorer

logger = logging.getLogger(__name__)

_START_METHODS = ("spawn", "forkserver")
KINDS = ("text", "trajectory", "funcs")


MAX_START_RETRIES = 3


class _InlineTimeout(Exception):
    """Raised by SIGALRM inside an inline scorer call that ran past its timeout."""


def _raise_timeout(signum, frame) -> None:
    raise _InlineTimeout


def _resolve(kind: str, name: str):
    if kind == "funcs":
        return RewardFuncs(name)
    return resolve_trajectory_scorer(name) if kind == "trajectory" else resolve_scorer(name)


def _call_scorer(scorer, kind: str, task: dict) -> float | dict:
    """Run one scorer call on a task (``completion`` / ``reference``, or ``trajectory`` JSON /
    ``problem``) and check that it gave a finite number (NaN would poison the loss)."""
    if kind == "funcs":
        return scorer(task["samples"])  # every function's values and failures (llamarl/rewards/funcs.py)
    if kind == "trajectory":
        value = float(scorer(Trajectory.from_json(task["trajectory"]), Problem(**task["problem"])))
    else:
        value = float(scorer(task["completion"], task["reference"]))
    if not math.isfinite(value):
        raise ValueError(f"scorer returned a non-finite reward {value}")
    return value


def _worker_main(conn: Connection, scorer_name: str, kind: str = "text") -> None:
    """Worker process loop: resolve the scorer, say ready, then answer one JSON task at a time."""
    # Ctrl-C reaches the whole process group; only the parent should react to it.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        try:
            scorer = _resolve(kind, scorer_name)
        except Exception as exc:  # noqa: BLE001 - reported to the parent, which raises it
            conn.send_bytes(json.dumps({"init_error": f"{type(exc).__name__}: {exc}"}).encode())
            return
        conn.send_bytes(b'{"ready": true}')
    except OSError:  # the parent ended (failed) while this worker started: its own line says why
        return
    while True:
        try:
            task = json.loads(conn.recv_bytes())
        except (EOFError, OSError):  # the parent went away (ended, or failed): end quietly
            return
        if task is None:
            return
        reply: dict[str, object] = {"index": task["index"]}
        try:
            reply["reward"] = _call_scorer(scorer, kind, task)
        except Exception as exc:  # noqa: BLE001 - any scorer failure is a 0.0 reward, counted by the parent
            reply["error"] = f"{type(exc).__name__}: {exc}"
        try:
            conn.send_bytes(json.dumps(reply).encode())
        except OSError:  # the parent went away mid-sample: its own failure line says why
            return


@dataclasses.dataclass
class _Worker:
    """Parent-side handle of one worker process and the sample it is working on."""

    process: BaseProcess
    conn: Connection
    state: str = "starting"  # "starting" -> "idle" <-> "busy"
    started_at: float = dataclasses.field(default_factory=time.monotonic)
    task: int = -1
    deadline: float = math.inf
    failed_starts: int = 0  # consecutive failed starts of this slot (reset once a worker is ready)


class RewardPool:
    """Scores completions against references with a named scorer; see the module docstring."""

    def __init__(
        self,
        scorer: str,
        *,
        num_workers: int = 1,
        timeout_s: float = 5.0,
        start_method: str = "spawn",
        startup_timeout_s: float = 120.0,
        kind: str = "text",
    ) -> None:
        """Create the pool and start its workers (asynchronously; the first batch waits for them).

        ``scorer`` is a key of ``llamarl.rewards.SCORERS`` (``kind="text"``: ``score_batch``) or of
        ``TRAJECTORY_SCORERS`` (``kind="trajectory"``: ``score_trajectories``), or a
        ``"module:function"`` path; unknown names, ``num_workers < 0``, ``timeout_s <= 0`` or a start
        method other than spawn/forkserver raise ValueError.
        """
        if kind not in KINDS:
            raise ValueError(f"scorer kind must be one of {KINDS}, got {kind!r}")
        if num_workers < 0:
            raise ValueError(f"num_workers must be >= 0, got {num_workers}")
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        if start_method not in _START_METHODS:
            raise ValueError(f"start_method must be one of {_START_METHODS}, got {start_method!r}")
        # Resolve in the parent too, so a bad name fails here rather than inside every worker.
        self._scorer = _resolve(kind, scorer)
        self._scorer_name, self.kind = scorer, kind
        self._timeout_s = timeout_s
        self._startup_timeout_s = startup_timeout_s
        self._ctx = multiprocessing.get_context(start_method)
        self._counts = {"num_scored": 0, "num_errors": 0, "num_timeouts": 0, "num_worker_restarts": 0,
                        "num_worker_start_failures": 0}
        self._ever_ready = False
        self._closed = False
        self._workers = [self._start_worker() for _ in range(num_workers)]

    @property
    def scorer(self):
        """The scorer, resolved in this process (for ``funcs``: the ``RewardFuncs``, its names)."""
        return self._scorer

    @property
    def num_workers(self) -> int:
        """Worker processes (0: scoring inline)."""
        return len(self._workers)

    def _start_worker(self) -> _Worker:
        """Spawn one worker process connected by a duplex pipe."""
        parent_conn, child_conn = self._ctx.Pipe(duplex=True)
        process = self._ctx.Process(
            target=_worker_main, args=(child_conn, self._scorer_name, self.kind), daemon=True, name="reward-worker"
        )
        process.start()
        # Drop our copy of the child's end so that the child's death shows up as EOF on ours.
        child_conn.close()
        return _Worker(process=process, conn=parent_conn)

    def _replace_worker(self, position: int, *, failed_starts: int = 0) -> None:
        """Kill the worker at ``position`` (it may be hung) and start a fresh one in its place."""
        worker = self._workers[position]
        worker.process.kill()
        worker.process.join(timeout=5.0)
        worker.conn.close()
        self._workers[position] = self._start_worker()
        self._workers[position].failed_starts = failed_starts
        self._counts["num_worker_restarts"] += 1

    def _start_failed(self, position: int, reason: str) -> None:
        """A worker died or failed during start-up. At pool creation that is a configuration error
        (raise at once); for a replacement of a worker that once ran, retry with a short backoff,
        ``MAX_START_RETRIES`` times in a row, before giving up (a transient failure, e.g. memory
        pressure, must not end a multi-hour run)."""
        worker = self._workers[position]
        if not self._ever_ready or worker.failed_starts >= MAX_START_RETRIES:
            attempts = f" after {worker.failed_starts + 1} attempts" if self._ever_ready else ""
            raise RuntimeError(f"reward worker {reason}{attempts}")
        self._counts["num_worker_start_failures"] += 1
        logger.warning("reward worker %s; retrying (%d/%d)", reason, worker.failed_starts + 1, MAX_START_RETRIES)
        time.sleep(min(0.5 * 2**worker.failed_starts, 4.0))
        self._replace_worker(position, failed_starts=worker.failed_starts + 1)

    def _record_error(self, message: str) -> None:
        """Count a scorer failure; log the first one loudly and the rest quietly."""
        self._counts["num_errors"] += 1
        log = logger.warning if self._counts["num_errors"] == 1 else logger.debug
        log("reward scorer %s failed (reward 0.0): %s", self._scorer_name, message)

    def score_batch(self, completions: list[str], references: list[str]) -> list[float]:
        """Return one reward per (completion, reference) pair, in order.

        A sample whose scorer raises or runs longer than ``timeout_s`` gets 0.0 and is counted in
        ``stats()``. Raises ValueError for mismatched lengths or a closed pool, RuntimeError when a
        worker cannot start at all.
        """
        if len(completions) != len(references):
            raise ValueError(f"got {len(completions)} completions but {len(references)} references")
        if self.kind != "text":
            raise ValueError(f"score_batch needs a text scorer; {self._scorer_name!r} is a {self.kind} scorer")
        return self._score([{"completion": c, "reference": r} for c, r in zip(completions, references)])

    def score_trajectories(self, trajectories: list[str], problems: list[Problem]) -> list[float]:
        """``score_batch`` for a trajectory scorer: one reward per (``Trajectory.to_json`` text,
        problem) pair, in order; a trajectory that does not parse scores 0.0 as a scorer error."""
        if len(trajectories) != len(problems):
            raise ValueError(f"got {len(trajectories)} trajectories but {len(problems)} problems")
        if self.kind != "trajectory":
            raise ValueError(f"score_trajectories needs a trajectory scorer; {self._scorer_name!r} is a text scorer")
        return self._score([{"trajectory": t, "problem": {"question": p.question, "answer": p.answer,
                                                           "columns": p.columns}}
                            for t, p in zip(trajectories, problems)])

    def score_funcs(self, samples: list[dict], *, chunks: list[slice]) -> list[dict | float]:
        """``--reward.funcs`` on ``samples`` (llamarl/rewards/funcs.py), each of ``chunks`` one task
        (one worker, a timeout of ``timeout_s`` per sample in it): per chunk, the functions' values
        and failures (each failure counted as an error), or 0.0 when the chunk failed as a whole
        (timed out, crashed its worker)."""
        if self.kind != "funcs":
            raise ValueError(f"score_funcs needs --reward.funcs; {self._scorer_name!r} is a {self.kind} scorer")
        results = self._score([{"samples": samples[chunk]} for chunk in chunks])
        for result in results:
            for error in result["errors"] if isinstance(result, dict) else []:
                self._record_error(error)
        return results

    def _score(self, tasks: list[dict]) -> list[float]:
        if self._closed:
            raise ValueError("RewardPool is closed")
        rewards = self._score_in_workers(tasks) if self._workers else [self._score_inline(t) for t in tasks]
        self._counts["num_scored"] += len(rewards)
        return rewards

    def _score_inline(self, task: dict) -> float:
        """Score one pair in this process (num_workers=0): errors give 0.0; a call longer than
        ``timeout_s`` is interrupted by SIGALRM (main thread only; elsewhere it is not timed) and
        gives 0.0, counted as a timeout. Pure-Python scorers are interruptible; a C call that never
        returns to the interpreter is not (use workers for such scorers)."""
        timed = threading.current_thread() is threading.main_thread() and hasattr(signal, "setitimer")
        previous = signal.signal(signal.SIGALRM, _raise_timeout) if timed else None
        try:
            if timed:
                signal.setitimer(signal.ITIMER_REAL, self._timeout_s * len(task.get("samples", [None])))
            return _call_scorer(self._scorer, self.kind, task)
        except _InlineTimeout:
            self._counts["num_timeouts"] += 1
            logger.debug("inline reward timed out after %.1fs", self._timeout_s)
            return 0.0
        except Exception as exc:  # noqa: BLE001 - a scorer failure must never stop the run
            self._record_error(f"{type(exc).__name__}: {exc}")
            return 0.0
        finally:
            if timed:
                signal.setitimer(signal.ITIMER_REAL, 0)
                signal.signal(signal.SIGALRM, previous)

    def _score_in_workers(self, tasks: list[dict]) -> list[float]:
        """Dispatch samples to idle workers one at a time and collect replies until all are done."""
        rewards = [0.0] * len(tasks)
        pending = deque(range(len(tasks)))
        remaining = len(tasks)
        while remaining:
            for position, worker in enumerate(self._workers):
                if worker.state == "idle" and pending:
                    self._dispatch(position, pending, tasks)
            waiting = [w for w in self._workers if w.state != "idle"]
            deadlines = [w.deadline for w in waiting if w.state == "busy"]
            deadlines += [w.started_at + self._startup_timeout_s for w in waiting if w.state == "starting"]
            timeout = max(0.0, min(deadlines) - time.monotonic()) if deadlines else None
            ready = set(wait([w.conn for w in waiting], timeout=timeout))
            for position, worker in enumerate(self._workers):
                if worker.conn in ready:
                    remaining -= self._receive(position, rewards, pending)
            now = time.monotonic()
            for position, worker in enumerate(self._workers):
                if worker.state == "busy" and now >= worker.deadline:
                    self._counts["num_timeouts"] += 1
                    logger.debug("reward sample %d timed out after %.1fs", worker.task, self._timeout_s)
                    rewards[worker.task] = 0.0
                    remaining -= 1
                    self._replace_worker(position)
                elif worker.state == "starting" and now >= worker.started_at + self._startup_timeout_s:
                    self._start_failed(position, f"did not start within {self._startup_timeout_s}s")
        return rewards

    def _dispatch(self, position: int, pending: deque[int], tasks: list[dict]) -> None:
        """Send the next pending sample to the idle worker at ``position``."""
        worker, index = self._workers[position], pending.popleft()
        task = {"index": index, **tasks[index]}
        try:
            worker.conn.send_bytes(json.dumps(task).encode())
        except OSError:  # the worker died while idle: not this sample's fault, so retry it elsewhere
            pending.appendleft(index)
            self._replace_worker(position)
            return
        worker.state, worker.task = "busy", index
        # A chunk of samples (``score_funcs``) has the timeout of each of them.
        worker.deadline = time.monotonic() + self._timeout_s * len(tasks[index].get("samples", [None]))

    def _receive(self, position: int, rewards: list[float], pending: deque[int]) -> int:
        """Handle one message from the worker at ``position``; return how many samples it finished."""
        worker = self._workers[position]
        try:
            message = json.loads(worker.conn.recv_bytes())
        except (EOFError, OSError):
            if worker.state == "starting":
                worker.process.join(timeout=5.0)
                self._start_failed(position, f"exited during start-up (exit code {worker.process.exitcode})")
                return 0
            # The scorer crashed its whole process (e.g. a segfault or os._exit): a scorer error.
            self._record_error(f"worker process died while scoring sample {worker.task}")
            rewards[worker.task] = 0.0
            self._replace_worker(position)
            return 1
        if "init_error" in message:
            self._start_failed(position, f"failed to load scorer {self._scorer_name!r}: {message['init_error']}")
            return 0
        if message.get("ready"):
            worker.state, worker.failed_starts = "idle", 0
            self._ever_ready = True
            return 0
        if message["index"] != worker.task:
            raise RuntimeError(f"reward worker answered sample {message['index']}, expected {worker.task}")
        if "error" in message:
            self._record_error(message["error"])
            rewards[worker.task] = 0.0
        else:
            reward = message["reward"]
            rewards[worker.task] = reward if isinstance(reward, dict) else float(reward)
        worker.state, worker.task, worker.deadline = "idle", -1, math.inf
        return 1

    def stats(self) -> dict[str, int]:
        """Cumulative counters: num_scored, num_errors, num_timeouts, num_worker_restarts,
        num_worker_start_failures."""
        return dict(self._counts)

    def restore_stats(self, counts: dict[str, int]) -> None:
        """Continue the cumulative counters of a checkpointed pool (unknown keys are ignored)."""
        self._counts.update({k: int(v) for k, v in counts.items() if k in self._counts})

    def close(self) -> None:
        """Stop all workers (politely, then by force); idempotent."""
        if self._closed:
            return
        self._closed = True
        for worker in self._workers:
            try:
                worker.conn.send_bytes(b"null")
            except OSError:  # already dead
                pass
        for worker in self._workers:
            worker.process.join(timeout=1.0)
            if worker.process.is_alive():  # busy or hung: no reason to wait for it
                worker.process.kill()
                worker.process.join(timeout=5.0)
            worker.conn.close()
        self._workers = []

    def __enter__(self) -> Self:
        """Return the pool itself."""
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        """Close the pool."""
        self.close()
