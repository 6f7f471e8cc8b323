"""Token-budgeted micro-batching by first-fit-decreasing (FFD) bin packing.

RL batches have very uneven sequence lengths; packing samples into micro-batches under a token
budget keeps memory bounded and the number of forward passes small. FFD (Johnson et al.,
"Worst-case performance bounds for simple one-dimensional packing algorithms", SIAM J. Comput.
1974) uses at most 11/9 OPT + 6/9 bins (Dosa, 2007), and is simple and deterministic.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

__all__ = ["check_token_counts", "pack_microbatches"]


def check_token_counts(counts: Sequence[int], *, max_tokens_per_microbatch: int) -> None:
    """Raise ValueError naming the first sample whose token count is negative or over the budget."""
    for i, c in enumerate(counts):
        if c < 0:
            raise ValueError(f"sample {i} has a negative token count {c}")
        if c > max_tokens_per_microbatch:
            raise ValueError(
                f"sample {i} has {c} tokens, more than max_tokens_per_microbatch={max_tokens_per_microbatch}"
            )


def pack_microbatches(
    token_counts: Sequence[int] | Tensor, *, max_tokens_per_microbatch: int
) -> list[list[int]]:
    """Pack sample indices into micro-batches of at most ``max_tokens_per_microbatch`` tokens.

    First-fit decreasing: visit samples by token count, largest first (ties by lower index), and
    put each into the first already-open micro-batch (in opening order) that still has room,
    opening a new one otherwise. The result is deterministic: each micro-batch's indices are
    sorted ascending and micro-batches are ordered by their first index. Every index appears
    exactly once; an empty input gives ``[]``; zero-token samples are allowed.

    Raises ValueError if the budget is < 1, ``token_counts`` is not 1-D, a count is negative, or
    a single sample exceeds the budget (naming its index and size).
    """
    if max_tokens_per_microbatch < 1:
        raise ValueError(f"max_tokens_per_microbatch must be >= 1, got {max_tokens_per_microbatch}")
    if isinstance(token_counts, Tensor):
        if token_counts.dim() != 1:
            raise ValueError(f"token_counts must be 1-D, got shape {tuple(token_counts.shape)}")
        counts = [int(c) for c in token_counts.to(torch.int64).tolist()]
    else:
        counts = [int(c) for c in token_counts]

    check_token_counts(counts, max_tokens_per_microbatch=max_tokens_per_microbatch)

    bins: list[list[int]] = []
    room: list[int] = []
    # Stable sort on -count: ties keep ascending index order, which makes the packing deterministic.
    for i in sorted(range(len(counts)), key=lambda j: -counts[j]):
        for b, free in enumerate(room):
            if counts[i] <= free:
                bins[b].append(i)
                room[b] -= counts[i]
                break
        else:
            bins.append([i])
            room.append(max_tokens_per_microbatch - counts[i])

    packed = [sorted(b) for b in bins]
    packed.sort(key=lambda b: b[0])
    return packed
