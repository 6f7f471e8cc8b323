"""How a policy loss turns per-token terms into one number (``--algo.loss-agg``), exact across
micro-batches and data-parallel ranks.

With ``l_t`` a token's loss term, ``M`` the masked (loss) tokens, ``N`` the optimizer step's global
number of loss tokens and ``S`` its global number of samples with a loss token:

* ``token-mean`` (default; DAPO's "token-level" loss, arXiv:2503.14476):
  ``sum_{t in M} l_t / N``;
* ``seq-mean-token-mean`` (GRPO as published, arXiv:2402.03300; GSPO): each sample's mean over its
  own tokens, then the mean over samples: ``sum_i (sum_{t in M_i} l_t / |M_i|) / S``;
* ``seq-mean-token-sum-norm`` (Dr. GRPO, arXiv:2503.20783): each sample's sum divided by one
  constant ``L`` (``--generator.max-new-tokens``, the longest a generation can be), then the mean
  over samples: ``sum_i sum_{t in M_i} l_t / (L S)``: no length bias.

Each is a sum over rows of a term that depends on that row alone, divided by global counts, so
the gradients of any micro-batch split, summed (and all-reduced with SUM over ranks), are the
gradient of the whole batch. A sample's tokens are never split over micro-batches.

A loss receives the aggregation as ``num_loss_tokens``: a number (or 0-d tensor, or None: the
local count) means ``token-mean`` over that count, exactly today's formula; an ``Aggregation``
carries the mode and its global counts. ``aggregate(per_token, mask, num_loss_tokens)`` handles
both, so a registered loss written against the number keeps working for ``token-mean``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

LOSS_AGGS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm")


@dataclass(frozen=True)
class Aggregation:
    """A loss aggregation and the optimizer step's global counts (module docstring)."""

    mode: str
    num_tokens: float
    """Global loss tokens of the optimizer step (``token-mean``'s denominator)."""
    num_seqs: float
    """Global samples with at least one loss token (the ``seq-mean`` modes' denominator)."""
    constant: float = 1.0
    """``seq-mean-token-sum-norm``'s per-sample denominator ``L``."""

    def __post_init__(self) -> None:
        if self.mode not in LOSS_AGGS:
            raise ValueError(f"loss aggregation must be one of {LOSS_AGGS}, got {self.mode!r}")
        if self.num_tokens < 0 or self.num_seqs < 0 or self.constant <= 0:
            raise ValueError(f"aggregation counts must be >= 0 (constant > 0), got {self}")


def token_denominator(mask: Tensor, num_loss_tokens: float | Tensor | None, dtype: torch.dtype) -> Tensor:
    """``token-mean``'s denominator: the global count (clamped to >= 1), or the local one for None."""
    if num_loss_tokens is None:
        return mask.sum().to(dtype).clamp_min(1.0)
    if isinstance(num_loss_tokens, Tensor):
        # No sign check: it would force a device sync every micro-batch.
        return num_loss_tokens.detach().to(device=mask.device, dtype=dtype).clamp_min(1.0)
    if num_loss_tokens < 0:
        raise ValueError(f"num_loss_tokens must be >= 0, got {num_loss_tokens}")
    # A global count of 0 means every call's sum is 0 too; clamp so the loss is 0, not NaN.
    return torch.tensor(max(float(num_loss_tokens), 1.0), dtype=dtype, device=mask.device)


def aggregate(per_token: Tensor, mask: Tensor, num_loss_tokens: float | Tensor | Aggregation | None) -> Tensor:
    """The loss from per-token terms ``per_token`` ``[B, T]`` over the bool ``mask`` (module
    docstring); off-mask entries are ignored (they may hold anything finite or not)."""
    masked = torch.where(mask, per_token, 0.0)
    if not isinstance(num_loss_tokens, Aggregation):
        return masked.sum() / token_denominator(mask, num_loss_tokens, per_token.dtype)
    agg = num_loss_tokens
    if agg.mode == "token-mean":
        return masked.sum() / token_denominator(mask, agg.num_tokens, per_token.dtype)
    seqs = max(agg.num_seqs, 1.0)
    if agg.mode == "seq-mean-token-mean":
        rows = masked.sum(dim=1) / mask.sum(dim=1).clamp_min(1).to(per_token.dtype)
        return rows.sum() / seqs
    return masked.sum() / (agg.constant * seqs)


def token_weights(mask: Tensor, num_loss_tokens: float | Tensor | Aggregation | None, dtype: torch.dtype) -> Tensor:
    """``w`` ``[B, T]`` with ``aggregate(x, mask, num_loss_tokens) == sum(w * x)`` for any ``x``: each
    token's share of the loss (for metrics weighted as the loss is)."""
    ones = mask.to(dtype)
    if not isinstance(num_loss_tokens, Aggregation) or num_loss_tokens.mode == "token-mean":
        count = num_loss_tokens.num_tokens if isinstance(num_loss_tokens, Aggregation) else num_loss_tokens
        return ones / token_denominator(mask, count, dtype)
    seqs = max(num_loss_tokens.num_seqs, 1.0)
    if num_loss_tokens.mode == "seq-mean-token-mean":
        return ones / (mask.sum(dim=1, keepdim=True).clamp_min(1).to(dtype) * seqs)
    return ones / (num_loss_tokens.constant * seqs)
