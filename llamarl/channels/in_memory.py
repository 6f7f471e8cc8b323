"""Channels between co-resident executors: the batch or the weights handed over on each rank.

Two stages that share ranks (``Stage(colocate_with=...)``, and every stage of ``--run.schedule
colocated``) both live in each of those processes, so a channel between them needs no network:

- ``InMemoryChannel`` (a data channel of any kind): ``inbound.set_input(name,
  outbound.get_output(name))`` on every rank. Each rank keeps the rows it made, which is what a
  scatter between equal rank sets means; no rebalancing across ranks (``Pipeline.specs`` refuses a
  broadcast or gather between co-resident stages on more than one rank, whose meaning differs).
- ``InMemoryWeights`` (a ``weights`` channel): the outbound model's parameters are written into
  the inbound model's storage one parameter at a time (``copy_weights_in_place``: collective over
  the trainer's FSDP mesh, never a second full copy), then ``set_weights_version``. A sink with a
  ``weight_sink()`` (a vLLM generator: no HF copy of its own) is handed the parameters instead, each
  gathered, cast and streamed into the engine one at a time (``stream_full_weights``). Skipped, as
  the network channel is, when the outbound version is the one last copied.

When the controller runs them (``llamarl/run/controller.py``): a same-tick data channel right before
its inbound executor steps, a next-tick one at the start of the next tick (so a checkpoint in
between still holds the batch among the outbound executor's unsent outputs); a weights channel at
the end of the tick that trained, so an evaluation or checkpoint after the tick sees the new
policy (generation at the next tick uses the same weights either way).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from llamarl.channels.sinks import feed, weight_sink_of
from llamarl.models.weight_copy import check_same_parameters, copy_weights_in_place, stream_full_weights
from llamarl.runtime.batch import TensorBatch


@dataclass
class _InMemory:
    """What both in-memory channels share: endpoints, delivery, the last hand-over's seconds."""

    name: str
    outbound: str
    inbound: str
    same_tick: bool = False

    def __post_init__(self) -> None:
        if self.outbound == self.inbound:
            raise ValueError(f"channel {self.name!r} connects executor {self.outbound!r} to itself")
        self.last_seconds = 0.0


class InMemoryChannel(_InMemory):
    """A data channel between co-resident executors (module docstring)."""

    def hand_over(self, source, sink) -> None:
        """Move ``source``'s output ``name`` to ``sink``'s input ``name`` on this rank."""
        start = time.perf_counter()
        batch = source.get_output(self.name)
        if not isinstance(batch, TensorBatch):
            raise TypeError(f"{type(source).__name__}.get_output({self.name!r}) returned "
                            f"{type(batch).__name__}, expected a TensorBatch")
        sink.set_input(self.name, batch)
        self.last_seconds = time.perf_counter() - start


class InMemoryWeights(_InMemory):
    """A weights channel between co-resident executors (module docstring)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        self.last_skipped = False
        self.last_bytes_received = 0
        self._synced_version: int | None = None

    def hand_over(self, source, sink) -> None:
        """Write ``source.get_model()``'s weights into ``sink.get_model()`` in place and give ``sink``
        the source's version; nothing moves when that version was copied last time."""
        start = time.perf_counter()
        version = int(source.version)
        self.last_skipped = version == self._synced_version
        self.last_bytes_received = 0
        if not self.last_skipped:
            stream_into = weight_sink_of(sink)
            if stream_into is None:
                self.last_bytes_received = copy_weights_in_place(source.get_model(), sink.get_model())
            else:
                layout = sink.get_model()  # names, shapes and dtype only (may be on the meta device)
                check_same_parameters(source.get_model(), layout)
                dtype = next(layout.parameters()).dtype
                stream = stream_full_weights(source.get_model(), dtype=dtype, device=sink.ctx.device)
                self.last_bytes_received = feed(stream_into, stream, label=f"weight channel {self.name!r}")
            sink.set_weights_version(version)
            self._synced_version = version
        self.last_seconds = time.perf_counter() - start
