"""Driving a decoder's step by hand, as the decode loop does (llamarl/engines/decode_loop.py):
rows loaded into the first slots of the one KV state (llamarl/engines/kv_slots.py) with their
positions, tokens fed, positions advanced after each step."""

from __future__ import annotations

import torch


def load_rows(state, *, keys: list[torch.Tensor], values: list[torch.Tensor], lengths: list[int],
              left_padded: bool) -> None:
    """Load ``len(lengths)`` rows into slots ``0 ..``; each row's next position is its length."""
    rows = len(lengths)
    state.load(list(range(rows)), keys=keys, values=values, lengths=lengths, left_padded=left_padded)
    state.positions[:rows] = torch.tensor(lengths, dtype=torch.long)


def step_rows(decoder, state, tokens: torch.Tensor, **kwargs) -> torch.Tensor:
    """Feed ``tokens`` to the first ``len(tokens)`` slots, step, advance their positions."""
    rows = tokens.shape[0]
    state.tokens[:rows] = tokens
    logits = decoder.step(state, rows, **kwargs)
    state.positions[:rows] += 1
    return logits
