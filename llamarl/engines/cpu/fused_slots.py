"""The fused CPU step (``FusedDecoder``, llamarl/engines/cpu/fused_decode.py) as a decoder of the
slot protocol (llamarl/engines/decoder.py), so the one decode loop drives it.

Its ``DecodeState`` keeps the live rows in its first slots, each row's cached length on the host
(the C step sizes each row's attention by it), and appends rows after the live ones. The loop meets
that: the decoder is not bucketed (a step runs exactly the live rows, the loop compacts them to the
front after every step, where a host read costs nothing), so free slots are always those after the
live rows, and a load appends there. It admits rows mid-decode (continuous batching) and keeps
carried caches. A state lives for one call, its width reserved for the call's longest row
(``FusedDecoder.new_state``).
"""

from __future__ import annotations

import torch

from llamarl.engines.cpu.fused_decode import DecodeState, FusedDecoder
from llamarl.engines.decoder import compact_to_front


class FusedSlotState:
    """A ``DecodeState`` (``inner``) with the slot protocol's ``tokens`` / ``positions``."""

    def __init__(self, inner: DecodeState, *, device: torch.device) -> None:
        self.inner = inner
        self.tokens = torch.zeros(inner.capacity, dtype=torch.long, device=device)
        self.positions = torch.zeros(inner.capacity, dtype=torch.long, device=device)

    @property
    def capacity(self) -> int:
        return self.inner.capacity

    @property
    def width(self) -> int:
        return self.inner.width

    def _check_appended(self, slots: list[int]) -> None:
        first = self.inner.num_rows
        if slots != list(range(first, first + len(slots))):
            raise ValueError(f"the fused step appends rows after its {first} live ones, got slots {slots}")

    def load_prefill(self, slots: list[int], *, cache, mask: torch.Tensor, lengths: list[int]) -> None:
        self._check_appended(slots)
        self.inner.append(keys=[layer.keys for layer in cache.layers], values=[layer.values for layer in cache.layers],
                          lengths=lengths, left_padded=True)

    def load(self, slots: list[int], *, keys: list[torch.Tensor], values: list[torch.Tensor], lengths: list[int],
             left_padded: bool) -> None:
        self._check_appended(slots)
        self.inner.append(keys=keys, values=values, lengths=lengths, left_padded=left_padded)

    def move(self, sources: list[int], targets: list[int], *, num_columns: int) -> None:
        """Keep the rows ``sources`` as slots ``0 .. len(sources) - 1`` (the others leave)."""
        self.inner.keep(compact_to_front(self, sources, targets, name="the fused step"))

    def row_cache(self, slot: int, length: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        if length != self.inner.lengths[slot]:
            raise ValueError(f"slot {slot} has {self.inner.lengths[slot]} cached positions, asked for {length}")
        return self.inner.row_cache(slot)


class FusedSlotDecoder:
    """``FusedDecoder``'s steps over ``FusedSlotState`` (module docstring)."""

    bucketed = False
    admits_mid_decode = True
    keeps_caches = True

    def __init__(self, fused: FusedDecoder, *, like: torch.Tensor) -> None:
        self.fused, self.like = fused, like
        self.num_calls = 0

    def reserve(self, *, capacity: int, positions: int) -> FusedSlotState:
        self.fused.refresh()  # weights changed in place since the last call: repacked
        return FusedSlotState(self.fused.new_state(capacity=capacity, like=self.like, positions=positions),
                              device=self.like.device)

    def step(self, state: FusedSlotState, rows: int) -> torch.Tensor:
        if rows != state.inner.num_rows:
            raise ValueError(f"the fused step runs every live row, got {rows} of {state.inner.num_rows}")
        return self.fused.step(state.inner, state.tokens[:rows])
