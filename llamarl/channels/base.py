"""CommunicationChannel: typed data movement between two executors (BROADCAST / SCATTER / GATHER).

A channel reads ``executor.get_output(name)`` on every outbound rank and calls
``executor.set_input(name, batch)`` on every inbound rank. Ranks of neither executor do nothing.

- BROADCAST: the outbound batches, concatenated in outbound rank order, reach every inbound
  rank whole.
- SCATTER: the outbound batches are concatenated on the outbound leader, split across the
  inbound ranks balanced by token count (``num_tokens`` field) without ever splitting a group
  of rows sharing a ``group_ids`` value (GRPO / RLOO need whole groups), and sent one part each.
- GATHER: every outbound rank's batch is concatenated, in rank order, on the inbound
  executor's first rank; the other inbound ranks receive an empty batch.

An executor with nothing to send returns an empty ``TensorBatch()``; empty batches travel like
any other, so every rank always posts the same operations and nothing waits forever.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from llamarl.channels.p2p import exchange
from llamarl.runtime.batch import MAX_DATA_BYTES, TensorBatch

if TYPE_CHECKING:
    from llamarl.runtime.executor import Executor
    from llamarl.runtime.world import ExecutorContext


def check_endpoints(channels, executors: list[str]) -> None:
    """ValueError unless every channel joins two different executors among ``executors``: the one
    check of channel endpoints, for a ``Pipeline`` (its stages, before any process group) and a
    hand-built controller (the world's executors) alike."""
    for channel in channels:
        for end in (channel.outbound, channel.inbound):
            if end not in executors:
                raise ValueError(f"channel {channel.name!r} names executor {end!r}, which is not one of {list(executors)}")
        if channel.outbound == channel.inbound:
            raise ValueError(f"channel {channel.name!r} goes from {channel.outbound!r} to itself")


def check_delivery_order(channels, order: list[str]) -> None:
    """ValueError unless every same-tick channel goes forward in ``order`` (its outbound executor
    steps before its inbound one within the tick, so the batch exists when it is delivered). The
    one check of it, for a ``Pipeline`` (stage order) and a hand-built controller alike."""
    backward = [c.name for c in channels if getattr(c, "same_tick", False)
                and order.index(c.outbound) >= order.index(c.inbound)]
    if backward:
        raise ValueError(f"same-tick channels {backward} must go forward in the executor order {order}")


class ChannelKind(enum.Enum):
    BROADCAST = "broadcast"
    SCATTER = "scatter"
    GATHER = "gather"


BROADCAST, SCATTER, GATHER = ChannelKind.BROADCAST, ChannelKind.SCATTER, ChannelKind.GATHER


def balanced_group_partition(batch: TensorBatch, num_parts: int) -> list[list[int]]:
    """Row indices for each of ``num_parts`` parts: whole groups, balanced by token count.

    Groups are taken in decreasing token count and each goes to the currently lightest part
    (LPT greedy; ties to the lower part index). Rows keep their original order inside a part.
    """
    if num_parts < 1:
        raise ValueError(f"cannot split a batch into {num_parts} parts")
    group_ids = batch.row_group_ids().tolist()
    tokens = batch.row_token_counts().tolist()
    groups: dict[int, list[int]] = {}
    for row, gid in enumerate(group_ids):
        groups.setdefault(gid, []).append(row)
    order = sorted(groups.values(), key=lambda rows: (-sum(tokens[r] for r in rows), rows[0]))
    loads = [0] * num_parts
    parts: list[list[int]] = [[] for _ in range(num_parts)]
    for rows in order:
        target = min(range(num_parts), key=lambda p: (loads[p], p))
        parts[target].extend(rows)
        loads[target] += sum(tokens[r] for r in rows)
    return [sorted(p) for p in parts]


@dataclass
class CommunicationChannel:
    """A data channel ``outbound -> inbound`` of ``kind``, named ``name``.

    ``name`` is what ``get_output`` / ``set_input`` receive. ``last_seconds`` holds the wall time
    of the last communicate on this rank (a metric).
    """

    name: str
    outbound: str
    inbound: str
    kind: ChannelKind = BROADCAST
    same_tick: bool = False
    """Delivery: False (next tick) carries what the outbound executor produced at the previous
    tick; True (same tick) delivers within the tick, the inbound executor stepping after the
    outbound one (see ``llamarl/run/controller.py``)."""
    max_data_bytes: int = MAX_DATA_BYTES
    """Largest data buffer (bytes) a receiving rank allocates for one batch from one peer. A peer
    announcing more, or a malformed batch, raises ``WireFormatError`` naming this channel and the
    peer's rank (``channel 'rollouts' from rank 3: ...``) before anything is allocated; a sender
    over the limit raises ``ValueError``. See ``llamarl.runtime.batch.MAX_DATA_BYTES`` for the default."""

    def __post_init__(self) -> None:
        if not isinstance(self.kind, ChannelKind):
            self.kind = ChannelKind(self.kind)
        if self.outbound == self.inbound:
            raise ValueError(f"channel {self.name!r} connects executor {self.outbound!r} to itself")
        if type(self.max_data_bytes) is not int or self.max_data_bytes < 0:
            raise ValueError(f"channel {self.name!r}: max_data_bytes must be a non-negative int, "
                             f"got {self.max_data_bytes!r}")
        self.last_seconds = 0.0

    def involves(self, ctx: ExecutorContext) -> bool:
        return ctx.executor in (self.outbound, self.inbound)

    def communicate(self, ctx: ExecutorContext, executor: Executor) -> None:
        """Move one batch along the channel; a no-op on ranks of neither endpoint."""
        if not self.involves(ctx):
            return
        start = time.perf_counter()
        out_ranks, in_ranks = ctx.ranks[self.outbound], ctx.ranks[self.inbound]
        label = f"channel {self.name!r}"

        # Staged on this executor's device, or on the host between a GPU and a CPU executor (both
        # ends agree: llamarl/runtime/placement.py); what arrives is then moved to this executor's device.
        # Sent through the group both ends agree on too: WORLD, or a mixed world's GPU-only group.
        peer = self.inbound if ctx.executor == self.outbound else self.outbound
        link, group = ctx.link_device(peer), ctx.link_group(peer)

        def send_recv(sends: dict[int, TensorBatch], recv_from: list[int]) -> dict[int, TensorBatch]:
            got = exchange(sends, recv_from, device=link, group=group, label=label,
                           max_data_bytes=self.max_data_bytes)
            return got if link == ctx.device else {src: batch.to(ctx.device) for src, batch in got.items()}

        received: TensorBatch | None = None
        if self.kind is BROADCAST:
            if ctx.executor == self.outbound:
                batch = self._output(executor)
                send_recv({dst: batch for dst in in_ranks}, [])
            else:
                got = send_recv({}, out_ranks)
                received = TensorBatch.concat([got[src] for src in out_ranks])
        elif self.kind is GATHER:
            leader = in_ranks[0]
            if ctx.executor == self.outbound:
                send_recv({leader: self._output(executor)}, [])
            elif ctx.rank == leader:
                got = send_recv({}, out_ranks)
                received = TensorBatch.concat([got[src] for src in out_ranks])
            else:
                received = TensorBatch()
        else:
            received = self._scatter(ctx, executor, out_ranks, in_ranks, send_recv)
        if received is not None:
            executor.set_input(self.name, received)
        self.last_seconds = time.perf_counter() - start

    def _output(self, executor: Executor) -> TensorBatch:
        batch = executor.get_output(self.name)
        if not isinstance(batch, TensorBatch):
            raise TypeError(f"{type(executor).__name__}.get_output({self.name!r}) returned "
                            f"{type(batch).__name__}, expected a TensorBatch")
        return batch

    def _scatter(self, ctx, executor, out_ranks, in_ranks, send_recv) -> TensorBatch | None:
        # Two hops (outbound ranks -> outbound leader -> inbound ranks) so that balancing sees
        # every group at once; the first hop is skipped when the outbound executor has one rank.
        leader = out_ranks[0]
        if ctx.executor == self.outbound:
            batch = self._output(executor)
            if ctx.rank != leader:
                send_recv({leader: batch}, [])
                return None
            others = send_recv({}, out_ranks[1:]) if len(out_ranks) > 1 else {}
            full = TensorBatch.concat([batch] + [others[r] for r in out_ranks[1:]])
            parts = balanced_group_partition(full, len(in_ranks)) if len(full) else [[] for _ in in_ranks]
            sends = {dst: (full.select(rows) if rows else TensorBatch({}, dict(full.metadata)))
                     for dst, rows in zip(in_ranks, parts)}
            send_recv(sends, [])
            return None
        return send_recv({}, [leader])[leader]

