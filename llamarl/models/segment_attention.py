"""Attention over a packed row's structure instead of a ``[W, W]`` mask (issue 46 item 1).

A shared-prompt packed row (llamarl/models/shared_prefix.py) is a context followed by the
completions that share it; each completion token sees the context and the earlier tokens of its
own completion. Through HF's ``sdpa`` that took a ``[rows, 1, W, W]`` boolean mask per micro-batch:
the kernel scores every one of the W² pairs (the mask only zeroes them), and transformers repeats
K / V for GQA because a mask is given. Here the row's attention is computed from its structure,
one ``scaled_dot_product_attention`` per segment, each over exactly the keys it sees:

* the context: causal over the context's own keys (``is_causal``);
* completion i of length L after a context of C: its L queries against the C context keys and its
  own L keys (a ``[L, C + L]`` mask: the context whole, its own keys causally);
* padding past the row's last completion: zeros (no logit of a padding position is read).

Work: ``C² + sum_i L_i (C + L_i)`` scored pairs per row instead of ``W²``, ``W = C + sum_i L_i``
(a group of 8 completions of 30 tokens after 40: 18,400 pairs instead of 78,400; the causal
ideal is 14,140), and GQA through SDPA's ``enable_gqa`` (no K / V copy per query head). Each
segment is one kernel call, in a host loop over the row's segments known beforehand
(``PackedLayout.spans``, built on the host: nothing read back from the device).

How it plugs in (decision): HF's attention modules call the function registered under
``config._attn_implementation``; ``enable`` switches a model from ``sdpa`` to ``NAME`` once and for
good. ``segment_attention`` is HF's own ``sdpa_attention_forward`` for every call that does not
pass ``segment_spans`` (generation, per-row forwards), so the switch changes nothing else; the mask
machinery treats ``NAME`` as ``sdpa``. The switch is permanent rather than scoped to one forward
because activation checkpointing recomputes a layer's forward during the backward, outside any
scope, with the same keyword arguments: a scoped switch would recompute the layer as plain causal
attention, silently. Families this does not reproduce keep the dense mask (``supports``): logit
soft-capping (Gemma2), a sliding window shorter than the packed row, attention sinks.

Numerics: the same softmax over the same keys as the masked kernel, summed in another order:
log-probs agree to fp32 rounding (tests/test_segment_attention.py: 1e-5 in fp32).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["NAME", "Sequences", "Spans", "enable", "segment_attention", "supports"]

NAME = "llamarl_segments"
"""The name this attention is registered under (transformers' ``AttentionInterface``)."""

Spans = tuple[tuple[int, tuple[tuple[int, int], ...]], ...]
"""Per packed row ``(context length, ((start, length) per completion, ascending))``."""

Sequences = tuple[tuple[tuple[int, int], ...], ...]
"""Per packed row the ``(start, length)`` of each independent causal sequence, ascending."""


def supports(model: torch.nn.Module, *, width: int) -> bool:
    """Whether ``model``'s attention is ``sdpa`` (or this, already enabled) and has nothing the
    segments would not reproduce for rows of ``width`` tokens (module docstring)."""
    config = getattr(model, "config", None)
    if getattr(config, "_attn_implementation", None) not in ("sdpa", NAME):
        return False
    if getattr(config, "attn_logit_softcapping", None):
        return False
    window = getattr(config, "sliding_window", None) if getattr(config, "use_sliding_window", True) else None
    if window is not None and window < width:
        return False
    return not any("sink" in name for name, _ in model.named_parameters())


def enable(model: torch.nn.Module) -> None:
    """Switch ``model`` from HF's ``sdpa`` to ``segment_attention`` (module docstring: permanent;
    identical to ``sdpa`` where no ``segment_spans`` are passed). Idempotent."""
    _register()
    if model.config._attn_implementation == "sdpa":
        model.config._attn_implementation = NAME


def segment_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: torch.Tensor | None, *, scaling: float | None = None, dropout: float = 0.0,
                      segment_spans: Spans | None = None, sequence_spans: Sequences | None = None,
                      **kwargs) -> tuple[torch.Tensor, None]:
    """HF's attention-function contract: ``query`` ``[rows, heads, W, d]``, ``key`` / ``value``
    ``[rows, kv_heads, W, d]`` (after RoPE) -> ``([rows, W, heads, d], None)``. With
    ``segment_spans`` (one entry per row) the attention follows them, with ``sequence_spans`` each
    row holds independent causal sequences (a packed prefill: llamarl/engines/packed_prefill.py);
    ``attention_mask`` is then ignored (a placeholder). Without either, HF's ``sdpa``."""
    if sequence_spans is not None:
        return _sequences(query, key, value, sequence_spans, scaling=scaling, dropout=dropout), None
    if segment_spans is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout,
                                      **kwargs)
    return _segments(query, key, value, segment_spans, scaling=scaling, dropout=dropout), None


# Under --trainer.compile layers, a graph break: the loop over a micro-batch's segments runs
# eagerly between the layer's two compiled graphs. Traced, each new layout of spans (every
# micro-batch has its own) would guard a new compile of the layer.
@torch.compiler.disable
def _segments(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, segment_spans: Spans, *,
              scaling: float | None, dropout: float) -> torch.Tensor:
    """``segment_attention``'s output ``[rows, W, heads, d]`` over ``segment_spans``."""
    rows, heads, width, head_dim = query.shape
    if len(segment_spans) != rows:
        raise ValueError(f"segment_attention: {len(segment_spans)} rows of spans for {rows} packed rows")
    gqa = key.shape[1] != heads
    out = []
    for row, (context, completions) in enumerate(segment_spans):
        q, k, v = query[row : row + 1], key[row : row + 1], value[row : row + 1]  # [1, h, W, d]
        parts = [F.scaled_dot_product_attention(q[:, :, :context], k[:, :, :context], v[:, :, :context],
                                                is_causal=True, scale=scaling, dropout_p=dropout, enable_gqa=gqa)]
        end = context
        for start, length in completions:
            own = slice(start, start + length)
            keys = torch.cat((k[:, :, :context], k[:, :, own]), dim=2)
            values = torch.cat((v[:, :, :context], v[:, :, own]), dim=2)
            # [L, C + L]: every context key, its own keys up to itself.
            sees = (torch.arange(context + length, device=query.device)
                    <= torch.arange(length, device=query.device).unsqueeze(1) + context)
            parts.append(F.scaled_dot_product_attention(q[:, :, own], keys, values, attn_mask=sees, scale=scaling,
                                                        dropout_p=dropout, enable_gqa=gqa))
            end = start + length
        if end < width:
            parts.append(q.new_zeros((1, heads, width - end, head_dim)))
        out.append(torch.cat(parts, dim=2))
    return torch.cat(out).transpose(1, 2).contiguous()


def _sequences(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, sequence_spans: Sequences, *,
               scaling: float | None, dropout: float) -> torch.Tensor:
    """Causal attention within each ``(start, length)`` sequence of each row, ``[rows, W, heads, d]``;
    zeros where no sequence is."""
    rows, heads, width, head_dim = query.shape
    if len(sequence_spans) != rows:
        raise ValueError(f"segment_attention: {len(sequence_spans)} rows of sequences for {rows} packed rows")
    gqa, out = key.shape[1] != heads, []
    for row, sequences in enumerate(sequence_spans):
        parts, end = [], 0
        for start, length in sequences:
            if start != end:
                raise ValueError(f"segment_attention: row {row}'s sequences must tile it from 0, got {sequences}")
            own = slice(start, start + length)
            parts.append(F.scaled_dot_product_attention(
                query[row : row + 1, :, own], key[row : row + 1, :, own], value[row : row + 1, :, own],
                is_causal=True, scale=scaling, dropout_p=dropout, enable_gqa=gqa))
            end = start + length
        if end < width:
            parts.append(query.new_zeros((1, heads, width - end, head_dim)))
        out.append(torch.cat(parts, dim=2))
    return torch.cat(out).transpose(1, 2).contiguous()


def _register() -> None:
    """Register ``segment_attention`` with transformers (where it is not yet), its masks made as
    ``sdpa``'s."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    if NAME not in AttentionInterface._global_mapping:
        AttentionInterface.register(NAME, segment_attention)
    if NAME not in AttentionMaskInterface._global_mapping:
        AttentionMaskInterface.register(NAME, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])
