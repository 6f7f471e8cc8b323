"""HF's modules as a decoder of the slot protocol (llamarl/engines/decoder.py): the path for the
architectures and layouts the static and fused steps do not cover (Gemma2, sliding windows shorter
than a sample, tensor-parallel shards), any model that takes ``past_key_values``.

The state is the prefill's transformers ``DynamicCache`` and its attention mask (rows left-padded,
every step appending one column to every row), so rows load only into an empty state
(``admits_mid_decode = False``: consecutive batches of ``max_num_seqs``) and a row's cache is not
kept across calls (``keeps_caches = False``: carried samples are prefilled again). Finished rows
leave the batch and the cache at every look, which is every step (``bucketed = False``): long
stragglers do not drag dead rows through every forward.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from llamarl.engines.decoder import compact_to_front


class HFSlotState:
    """The slots of one batch: ``cache`` (a ``DynamicCache`` of the live rows, in slot order) and
    ``mask`` ``[rows, columns]`` (which columns each row sees)."""

    def __init__(self, *, capacity: int, device: torch.device) -> None:
        self.tokens = torch.zeros(capacity, dtype=torch.long, device=device)
        self.positions = torch.zeros(capacity, dtype=torch.long, device=device)
        self.cache: Any = None
        self.mask: torch.Tensor | None = None

    @property
    def capacity(self) -> int:
        return self.tokens.shape[0]

    @property
    def width(self) -> int:
        return 0 if self.mask is None else self.mask.shape[1]

    def load_prefill(self, slots: list[int], *, cache: Any, mask: torch.Tensor, lengths: list[int]) -> None:
        if slots != list(range(len(slots))):
            raise ValueError(f"HF's modules load a batch into an empty state's first slots, got slots {slots}")
        self.cache, self.mask = cache, mask

    def load(self, slots, *, keys, values, lengths, left_padded) -> None:
        raise NotImplementedError("HF's modules keep no carried cache (keeps_caches is False)")

    def row_cache(self, slot: int, length: int):
        raise NotImplementedError("HF's modules keep no carried cache (keeps_caches is False)")

    def move(self, sources: list[int], targets: list[int], *, num_columns: int) -> None:
        """Keep the rows ``sources`` as slots ``0 .. len(sources) - 1`` (the others leave the batch)."""
        rows = compact_to_front(self, sources, targets, name="HF's modules")
        if sources:
            self.cache.batch_select_indices(rows)
            self.mask = self.mask[rows]
        else:
            self.cache, self.mask = None, None


class HFDecoder:
    """Decode steps through the model's own forward (module docstring)."""

    bucketed = False
    admits_mid_decode = False
    keeps_caches = False

    def __init__(self, forward: Callable[..., torch.Tensor], *, device: torch.device) -> None:
        """``forward(input_ids, attention_mask=, position_ids=, cache=)``: the engine's forward, the
        last position's logits ``[rows, vocab]``."""
        self.forward, self.device = forward, device
        self.num_steps = 0
        self.num_calls = 0

    def reserve(self, *, capacity: int, positions: int) -> HFSlotState:
        return HFSlotState(capacity=capacity, device=self.device)

    def step(self, state: HFSlotState, rows: int) -> torch.Tensor:
        if state.mask is None or rows != state.mask.shape[0]:
            raise ValueError(f"HF's modules step every live row of the batch, got {rows} of "
                             f"{0 if state.mask is None else state.mask.shape[0]}")
        self.num_steps += 1
        state.mask = torch.cat([state.mask, state.mask.new_ones((rows, 1))], dim=1)
        return self.forward(state.tokens[:rows].unsqueeze(1), attention_mask=state.mask,
                            position_ids=state.positions[:rows].unsqueeze(1), cache=state.cache)
