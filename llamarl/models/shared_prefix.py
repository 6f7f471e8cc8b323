"""Shared-prompt forwards: a GRPO group's prompt is run once, not once per sample.

A GRPO batch holds each prompt ``G`` times (one row per sample of its group). Forwarding the rows
as they are runs the prompt's tokens ``G`` times, forward and backward; on the short-answer tasks
RL recipes start with (a 45-token chat prompt, 12 new tokens) that is ~80 % of the trainer's work.
Here every distinct *context* (the tokens before a row's first loss token) is laid out once, followed
by the completion of each row that shares it, and one attention mask lets each completion token see
the context and the earlier tokens of its own completion only — the "shared prefix" / tree packing
used for the same purpose in RL and preference-optimisation trainers::

    packed row:  [ prompt p0..p44 | sample 1: c0..c11 | sample 2: c0..c11 | ... ]
    positions:     0 .. 44          45 .. 56            45 .. 56
    attends to:    causal prompt    prompt + own past   prompt + own past

Each completion token sees exactly the keys and positions it would see in its own row, so the
log-probs (and their gradients, which sum over the shared prompt) are those of the per-row forward,
up to floating-point summation order. The batch layout going in and out is unchanged (right-padded
``[N, L]`` rows), so losses and callers do not know the difference.

The attention follows the layout's structure (llamarl/models/segment_attention.py: one kernel call
per context and per completion, over exactly the keys each sees), not a ``[rows, 1, W, W]`` mask,
where the model's family allows (``segment_attention.supports``); elsewhere (Gemma2's soft-capped
attention, a sliding window shorter than the row) the tree mask above, as a boolean 4D mask. Needs
``sdpa`` in transformers either way; ``supports`` says whether a model qualifies, and callers fall
back to per-row forwards when it does not.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from llamarl.models import segment_attention

__all__ = ["PackedLayout", "context_groups", "pack_groups", "packed_layout", "shared_prefix_logprobs", "supports"]


def supports(model: torch.nn.Module) -> bool:
    """Whether ``model``'s attention takes the boolean 4D mask these forwards need (HF ``sdpa``)."""
    from llamarl.models.segment_attention import NAME

    config = getattr(model, "config", None)
    return getattr(config, "_attn_implementation", None) in ("sdpa", NAME)


def context_groups(input_ids: torch.Tensor, num_tokens: list[int], loss_mask: torch.Tensor):
    """Group rows by their context; return ``(groups, context_lengths)``.

    A row's context is its tokens before its first loss token (at least one token; a row without
    loss tokens keeps all but its last token as context). ``groups`` lists row indices of equal
    contexts, in order of first appearance, each ascending; ``context_lengths[r]`` is row ``r``'s
    context length. ``num_tokens[r]`` is the row's length (prompt + completion).
    """
    has_loss = loss_mask[:, : input_ids.shape[1]] > 0
    first = has_loss.float().argmax(dim=1).tolist()
    any_loss = has_loss.any(dim=1).tolist()
    rows_host = input_ids.tolist()
    groups: dict[tuple[int, ...], list[int]] = {}
    context_lengths = []
    for row, length in enumerate(num_tokens):
        context = max(first[row] if any_loss[row] else length - 1, 1)
        context_lengths.append(context)
        groups.setdefault(tuple(rows_host[row][:context]), []).append(row)
    return list(groups.values()), context_lengths


def pack_groups(groups: list[list[int]], context_lengths: list[int], num_tokens: list[int], *,
                max_tokens: int) -> list[tuple[list[int], int]]:
    """Split groups whose packed row would exceed ``max_tokens``; return ``(rows, packed_tokens)`` items.

    A packed row costs its context once plus each member's completion. Members are taken in order
    and a new chunk starts (repeating the context) when the next would not fit; a single row always
    fits when ``num_tokens[r] <= max_tokens``, which the caller has checked.
    """
    items = []
    for rows in groups:
        context = context_lengths[rows[0]]
        chunk, cost = [], context
        for row in rows:
            extra = num_tokens[row] - context
            if chunk and cost + extra > max_tokens:
                items.append((chunk, cost))
                chunk, cost = [], context
            chunk.append(row)
            cost += extra
        items.append((chunk, cost))
    return items


@dataclass
class PackedLayout:
    """Where every token of a micro-batch goes when each context is forwarded once, built on the
    host from lengths and tokens known there (``packed_layout``), moved to the device in one go
    (``to``): nothing on the device is read back to build it.

    ``tokens`` / ``positions`` / ``segments`` ``[G, W]``: the packed rows (one per context group),
    their position ids, and each token's segment (0: the context, k: the group's k-th completion,
    -1: padding). ``rows`` / ``columns`` / ``packed_rows`` / ``sources`` ``[K]``, one entry per
    completion token: its row and column in the ``[B, L]`` input, its packed row, and the position
    (after ``logits_to_keep``, i.e. minus ``first_kept``) of the logit that predicts it. ``spans``
    (host integers): per packed row its context length and each completion's ``(start, length)``,
    what the structured attention follows (llamarl/models/segment_attention.py)."""

    tokens: torch.Tensor
    positions: torch.Tensor
    segments: torch.Tensor
    rows: torch.Tensor
    columns: torch.Tensor
    packed_rows: torch.Tensor
    sources: torch.Tensor
    first_kept: int
    spans: tuple = ()

    def to(self, device: torch.device | str) -> PackedLayout:
        """The same layout with every tensor on ``device`` (host-to-device copies only)."""
        return PackedLayout(**{f.name: getattr(self, f.name).to(device) if f.name not in ("first_kept", "spans")
                               else getattr(self, f.name) for f in fields(self)})


def packed_layout(input_ids: torch.Tensor, num_tokens: list[int], loss_mask: torch.Tensor) -> PackedLayout:
    """The ``PackedLayout`` of right-padded rows ``input_ids`` ``[B, L]`` of lengths ``num_tokens``
    with ``loss_mask`` (``context_groups`` decides the contexts), on the CPU. ``input_ids`` and
    ``loss_mask`` should be host tensors: they are read (``tolist``)."""
    groups, context_lengths = context_groups(input_ids, num_tokens, loss_mask)
    rows_host = input_ids.tolist()
    packed, positions, segments, spans = [], [], [], []
    rows, columns, packed_rows, sources = [], [], [], []
    # Logits only from the shortest context's last token on (the rest of the prompts is unused).
    first_kept = min(context_lengths[group[0]] for group in groups) - 1
    for g, group in enumerate(groups):
        context = context_lengths[group[0]]
        tokens, pos, seg = list(rows_host[group[0]][:context]), list(range(context)), [0] * context
        completions = []
        for member, row in enumerate(group, start=1):
            start = len(tokens)  # where this row's completion starts in its packed row
            completion = rows_host[row][context:num_tokens[row]]
            # Completion token k (input column context + k) is predicted by the context's last
            # position for k = 0, else by the packed position of token k - 1.
            for k in range(len(completion)):
                rows.append(row)
                columns.append(context + k)
                packed_rows.append(g)
                sources.append((context - 1 if k == 0 else start + k - 1) - first_kept)
            if completion:
                completions.append((start, len(completion)))
            tokens += completion
            pos += range(context, context + len(completion))
            seg += [member] * len(completion)
        packed.append(tokens)
        positions.append(pos)
        segments.append(seg)
        spans.append((context, tuple(completions)))
    width = max(len(t) for t in packed)

    def padded(lists, fill):
        return torch.tensor([x + [fill] * (width - len(x)) for x in lists], dtype=torch.long, device="cpu")

    def flat(values):
        return torch.tensor(values, dtype=torch.long, device="cpu").reshape(len(values))

    # Padding gets a segment of its own (-1): it sees the context and itself, never a completion.
    return PackedLayout(tokens=padded(packed, 0), positions=padded(positions, 0), segments=padded(segments, -1),
                        rows=flat(rows), columns=flat(columns), packed_rows=flat(packed_rows), sources=flat(sources),
                        first_kept=first_kept, spans=tuple(spans))


def shared_prefix_logprobs(model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                           loss_mask: torch.Tensor, *, temperature: float, chunk_tokens: int = 0,
                           entropy_out: list | None = None, layout: PackedLayout | None = None,
                           entropy_grad: bool = False, structured: bool = True) -> torch.Tensor:
    """Per-token log-probs ``[B, L]`` of each row's completion, each distinct context forwarded once.

    Same contract as ``llamarl.models.logprobs.completion_logprobs`` on the same inputs
    (right-padded ``input_ids`` / ``attention_mask`` ``[B, L]``; logits divided by ``temperature``
    when it is > 0): ``out[r, t] = log p(input_ids[r, t] | input_ids[r, :t])`` for every ``t`` from
    row ``r``'s first loss token to its last token; 0 elsewhere. Differentiable (the shared
    context's gradient is the sum of its rows'). Needs ``supports(model)``. ``chunk_tokens > 0``:
    the logits of at most that many tokens alive at once (``llamarl.models.logprob_chunks``).
    ``entropy_out``: a list that gets each predicted distribution's entropy appended, ``[B, L]``
    fp32 at the same positions (0 elsewhere; differentiable only with ``entropy_grad``). ``layout``: these rows'
    ``packed_layout``, built on the host beforehand (then nothing here reads a device value); None:
    built here from the inputs (each read once on the host). ``structured`` (default): attend
    through the segments' structure where the model supports it (llamarl/models/segment_attention.py),
    not a ``[rows, 1, W, W]`` mask; False: the mask (the reference the tests compare with).
    """
    batch, width = input_ids.shape
    device = input_ids.device
    if layout is None:
        layout = packed_layout(input_ids.cpu(), attention_mask.sum(dim=1).tolist(), loss_mask.cpu())
    layout = layout.to(device)
    packed_width = layout.tokens.shape[1]
    forward = {"input_ids": layout.tokens, "position_ids": layout.positions, "use_cache": False,
               "logits_to_keep": packed_width - layout.first_kept}
    if structured and layout.spans and segment_attention.supports(model, width=packed_width):
        # Attention over the segments (llamarl/models/segment_attention.py), no [W, W] mask: HF
        # takes a 4D mask as given, and this one is a placeholder the segments' attention ignores.
        segment_attention.enable(model)
        forward |= {"attention_mask": torch.ones((len(layout.spans), 1, 1, 1), dtype=torch.bool, device=device),
                    "segment_spans": layout.spans}
    else:
        causal = torch.ones(packed_width, packed_width, dtype=torch.bool, device=device).tril()
        seg = layout.segments
        visible = (seg.unsqueeze(1) == 0) | (seg.unsqueeze(1) == seg.unsqueeze(2))
        forward["attention_mask"] = (causal.unsqueeze(0) & visible).unsqueeze(1)
    targets = input_ids[layout.rows, layout.columns]
    entropy = None
    if chunk_tokens > 0:
        from llamarl.models.logprob_chunks import selected_logprobs

        picked = selected_logprobs(model, rows=layout.packed_rows, positions=layout.sources, targets=targets,
                                   temperature=temperature, chunk_tokens=chunk_tokens,
                                   with_entropy=entropy_out is not None, entropy_grad=entropy_grad, **forward)
        token_logp, entropy = picked if entropy_out is not None else (picked, None)
    else:
        logits = model(**forward).logits[layout.packed_rows, layout.sources].float()
        if temperature > 0:
            logits = logits / temperature
        log_probs = torch.log_softmax(logits, dim=-1)
        token_logp = log_probs.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
        if entropy_out is not None:
            with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
                entropy = -torch.linalg.vecdot(log_probs.exp(), log_probs)
    if entropy_out is not None:
        entropy_out.append(torch.zeros(batch, width, device=device).index_put((layout.rows, layout.columns), entropy))
    out = torch.zeros(batch, width, dtype=token_logp.dtype, device=device)
    return out.index_put((layout.rows, layout.columns), token_logp)
