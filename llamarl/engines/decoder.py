"""The slot protocol every decoder of the native engine implements, so that one decode loop
(llamarl/engines/decode_loop.py) drives them all: the static CUDA-graph step
(llamarl/engines/static_decode.py), the fused CPU step (llamarl/engines/cpu/fused_decode.py) and
HF's modules (llamarl/engines/hf_decoder.py).

A decoder's state is a fixed number of **slots**. Slot s feeds ``tokens[s]`` at position
``positions[s]`` at the next step, which writes that token's keys and values there and returns the
logits of what follows; ``positions[s]`` is also how many positions the slot has cached. A step runs
the first ``rows`` slots. The loop loads prefilled or kept rows into free slots, moves slots to
compact them, and copies a finished row's cache out when its sample is carried.

Capabilities are declared, not inferred:

* ``bucketed``: steps run buckets of slots (a ladder of row counts), which may hold finished or empty slots
  (a captured graph per bucket); otherwise a step runs exactly the live rows, which the loop keeps
  at the front and looks at after every step.
* ``admits_mid_decode``: rows may be loaded while others decode (continuous batching); otherwise
  only into an empty state (consecutive batches).
* ``keeps_caches``: ``row_cache`` and ``load`` of a kept carried cache are supported
  (``carried_cache="keep"``); otherwise carried samples are prefilled again.

How each decoder is chosen (``supports``) is the engine's business (llamarl/engines/torch_engine.py).
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import torch


@runtime_checkable
class SlotState(Protocol):
    """A decoder's state (module docstring)."""

    tokens: torch.Tensor
    """``[capacity]`` int64: what each slot feeds at the next step."""
    positions: torch.Tensor
    """``[capacity]`` int64: where (= how many positions the slot has cached)."""

    @property
    def capacity(self) -> int: ...

    @property
    def width(self) -> int: ...

    def load_prefill(self, slots: list[int], *, cache: Any, mask: torch.Tensor, lengths: list[int]) -> None:
        """Load a left-padded prefill (an HF cache of ``len(slots)`` rows and its mask) into ``slots``;
        row j has ``lengths[j]`` cached positions."""

    def load(self, slots: list[int], *, keys: list[torch.Tensor], values: list[torch.Tensor], lengths: list[int],
             left_padded: bool) -> None:
        """Load per-layer ``keys`` / ``values`` ``[n, kv, T, d]`` into ``slots`` (kept caches)."""

    def move(self, sources: list[int], targets: list[int], *, num_columns: int) -> None:
        """Copy slots ``sources`` to ``targets`` (compaction; ``targets`` ascending from 0)."""

    def row_cache(self, slot: int, length: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Copies of slot ``slot``'s first ``length`` cached positions per layer, ``[kv, length, d]``."""


@runtime_checkable
class Decoder(Protocol):
    """A decode step over a ``SlotState`` (module docstring)."""

    bucketed: bool
    admits_mid_decode: bool
    keeps_caches: bool
    num_calls: int
    """Decode loops completed with this decoder (cumulative)."""

    def reserve(self, *, capacity: int, positions: int) -> SlotState:
        """A state with at least ``capacity`` slots and room for ``positions`` positions per row."""

    def step(self, state: SlotState, rows: int) -> torch.Tensor:
        """Run the first ``rows`` slots one step; their next-token logits ``[rows, vocab]``, valid
        until the next step."""


def compact_to_front(state: SlotState, sources: list[int], targets: list[int], *, name: str) -> torch.Tensor:
    """The ``move`` of a state whose rows are exactly the live ones (not bucketed): ``targets`` must
    be ``0 .. len(sources) - 1``; the fed tokens and positions of ``sources`` move there. Returns
    ``sources`` as an int64 tensor on the state's device, for the state to keep its cache rows."""
    if targets != list(range(len(sources))):
        raise ValueError(f"{name} compacts rows to the front, got targets {targets}")
    rows = torch.tensor(sources, dtype=torch.long, device=state.tokens.device)
    dst = rows.new_tensor(targets)
    state.tokens[dst], state.positions[dst] = state.tokens[rows].clone(), state.positions[rows].clone()
    return rows
