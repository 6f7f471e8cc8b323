"""Liveness: every rank heartbeats through torchrun's store; a silent rank ends the job quickly.

Why separate from the collective timeout: a collective timeout has to be longer than the longest
legitimate wait (a slow trainer step, the final evaluation, a checkpoint of a large model), so it
cannot also be how fast a dead rank is noticed. Here a daemon thread on every rank writes
``(time, step, phase)`` to the torchrun rendezvous store (``MASTER_ADDR:MASTER_PORT``; a client of its
own) every ``interval_s``, and watches one peer, its successor in a ring (``(rank + 1) % world``), so
the store sees O(world) reads per interval in total, not O(world^2). A peer whose heartbeat has not
changed for ``timeout_s`` (killed, out of memory, stuck holding the GIL) is reported in one line
naming its rank, executor, last step and phase, and this process exits with code 1; torchrun then
tears the job down. gloo already turns a dead peer of a pending exchange into an error at once;
the heartbeat also covers ranks that were not talking to it (a trainer in a long step).

A rank whose exchange with a peer failed (gloo's "Connection closed by peer", a barrier that lost a
rank) asks ``silent_peers``, before it exits, which ranks stopped publishing: its failure line then
names the dead rank and its executor, not only the exchange it was in.

One line for one failure: a rank that fails claims the job's failure in the store
(``claim_failure``, first come first served) before it reports. A rank whose exchange failed
because a peer had already failed and reported (claimed) stays quiet: its own line would only say
"Connection closed by peer" after the real one. So does a rank torchrun stops (SIGTERM) or a
watcher that finds the failed peer silent. A peer killed without a word claims nothing, and the
rank that notices it reports as before.

A peer last seen loading, checkpointing or exporting gets ten times the timeout (those phases can
hold the GIL for long stretches on a healthy rank). A rank that finishes normally marks itself finished (``finish``), so its watcher does not mistake
its exit for a death.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import threading
import time
from datetime import timedelta

import torch.distributed as dist

logger = logging.getLogger(__name__)
_PREFIX = "llamarl/heartbeat/"
_FAILURE_KEY = "llamarl/failure"
_SLOW_PHASES = ("init", "load_checkpoint", "checkpoint", "export")
_SLOW_PHASE_FACTOR = 10


class Heartbeat:
    """Publishes this rank's heartbeat and watches the next rank's (see the module docstring)."""

    def __init__(self, *, rank: int, world_size: int, executor_of: dict[int, str], timeout_s: float,
                 interval_s: float | None = None) -> None:
        if timeout_s <= 0:
            raise ValueError(f"liveness timeout must be > 0, got {timeout_s}")
        self.rank, self.world_size, self.executor_of = rank, world_size, executor_of
        self.timeout_s = timeout_s
        self.interval_s = interval_s or max(0.2, min(2.0, timeout_s / 10))
        self.step, self.phase = 0, "init"
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._store = None

    def start(self) -> bool:
        """Connect to the store and start the thread; False (and no watching) outside torchrun."""
        addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
        if not addr or not port or self.world_size < 2:
            return False
        self._store = dist.TCPStore(addr, int(port), is_master=False, timeout=timedelta(seconds=60))
        self._publish()
        self._thread = threading.Thread(target=self._run, name="llamarl-heartbeat", daemon=True)
        self._thread.start()
        return True

    def update(self, *, step: int, phase: str) -> None:
        """What this rank is doing (read by its watcher's message if it dies)."""
        self.step, self.phase = step, phase

    def finish(self) -> None:
        """Mark this rank finished (its exit is not a failure) and stop the thread."""
        self._stop.set()
        if self._store is not None:
            self._store.set(f"{_PREFIX}{self.rank}", json.dumps({"finished": True}))

    def _client(self, timeout_s: float = 5.0):
        """A store client of its own (the heartbeat thread keeps using ``_store`` meanwhile)."""
        return dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                             timeout=timedelta(seconds=timeout_s))

    def claim_failure(self) -> bool:
        """Whether this rank is the job's first to report a failure (module docstring); True also
        when the heartbeat is not running or the store cannot be reached (then every rank reports)."""
        if self._store is None:
            return True
        try:
            return self._client().compare_set(_FAILURE_KEY, "", str(self.rank)) == str(self.rank).encode()
        except Exception as exc:  # noqa: BLE001 - the agent is tearing the job down
            logger.debug("heartbeat store unreachable: %s", exc)
            return True

    def failure_reporter(self) -> int | None:
        """The rank that claimed the job's failure, if one did (None also when the store cannot be read)."""
        if self._store is None:
            return None
        try:
            store = self._client()
            return int(store.get(_FAILURE_KEY)) if store.check([_FAILURE_KEY]) else None
        except Exception as exc:  # noqa: BLE001
            logger.debug("heartbeat store unreachable: %s", exc)
            return None

    def silent_peers(self, *, wait_s: float | None = None) -> list[tuple[int, dict]]:
        """The other ranks whose heartbeat did not change over ``wait_s`` (default: two and a half
        publishing intervals) and that did not finish, with their last ``(step, phase)`` record;
        [] when the heartbeat is not running or the store cannot be read (the job is ending)."""
        if self._store is None:
            return []
        wait_s = 2.5 * self.interval_s if wait_s is None else wait_s
        peers = [rank for rank in range(self.world_size) if rank != self.rank]
        keys = [f"{_PREFIX}{rank}" for rank in peers]
        try:  # a client of its own: the heartbeat thread keeps using its client meanwhile
            store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                                  timeout=timedelta(seconds=max(5.0, wait_s)))
            before = [store.get(key) if store.check([key]) else None for key in keys]
            time.sleep(wait_s)
            after = [store.get(key) if store.check([key]) else None for key in keys]
        except Exception as exc:  # noqa: BLE001 - the agent is tearing the job down
            logger.debug("heartbeat store unreachable: %s", exc)
            return []
        silent = []
        for rank, old, new in zip(peers, before, after):
            last = json.loads(new) if new is not None else {}
            if new is not None and old == new and not last.get("finished"):
                silent.append((rank, last))
        return silent

    def _publish(self) -> None:
        self._store.set(f"{_PREFIX}{self.rank}", json.dumps(
            {"time": time.time(), "step": self.step, "phase": self.phase}))

    def _run(self) -> None:
        peer = (self.rank + 1) % self.world_size
        key = f"{_PREFIX}{peer}"
        last_value, last_change = None, time.monotonic()
        while not self._stop.wait(self.interval_s):
            try:
                self._publish()
                value = self._store.get(key) if self._store.check([key]) else None
            except Exception as exc:  # noqa: BLE001 - the store went away: the agent is ending the job
                logger.debug("heartbeat store unreachable: %s", exc)
                return
            now = time.monotonic()
            if value != last_value:
                last_value, last_change = value, now
                continue
            if value is not None and json.loads(value).get("finished"):
                continue
            last = json.loads(value) if value is not None else {}
            # Loading or saving a large model can hold the GIL for long stretches (file reads and
            # copies in native code), starving the heartbeat thread of a healthy rank: more grace.
            slow = str(last.get("phase", "init")).startswith(_SLOW_PHASES)
            if now - last_change > self.timeout_s * (_SLOW_PHASE_FACTOR if slow else 1):
                if self.failure_reporter() is not None:  # it failed and said so: torchrun ends the job
                    os._exit(1)
                print(f"llamarl: rank {peer} (executor {self.executor_of.get(peer, '?')!r}) stopped responding "
                      f"at step {last.get('step', '?')} during {last.get('phase', 'start-up')} (no heartbeat for "
                      f"{now - last_change:.0f} s); ending the job (noticed by rank {self.rank})",
                      file=sys.stderr, flush=True)
                os._exit(1)
