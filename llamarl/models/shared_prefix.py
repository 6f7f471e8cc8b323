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

Needs an attention that takes a custom boolean 4D mask (``sdpa`` in transformers); ``supports``
says whether a model qualifies, and callers fall back to per-row forwards when it does not.
"""

from __future__ import annotations

import torch

__all__ = ["context_groups", "pack_groups", "shared_prefix_logprobs", "supports"]


def supports(model: torch.nn.Module) -> bool:
    """Whether ``model``'s attention takes the boolean 4D mask these forwards need (HF ``sdpa``)."""
    config = getattr(model, "config", None)
    return getattr(config, "_attn_implementation", None) == "sdpa"


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


def shared_prefix_logprobs(model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                           loss_mask: torch.Tensor, *, temperature: float, chunk_tokens: int = 0) -> torch.Tensor:
    """Per-token log-probs ``[B, L]`` of each row's completion, each distinct context forwarded once.

    Same contract as ``llamarl.models.logprobs.completion_logprobs`` on the same inputs
    (right-padded ``input_ids`` / ``attention_mask`` ``[B, L]``; logits divided by ``temperature``
    when it is > 0): ``out[r, t] = log p(input_ids[r, t] | input_ids[r, :t])`` for every ``t`` from
    row ``r``'s first loss token to its last token; 0 elsewhere. Differentiable (the shared
    context's gradient is the sum of its rows'). Needs ``supports(model)``. ``chunk_tokens > 0``:
    the logits of at most that many tokens alive at once (``llamarl.models.logprob_chunks``).
    """
    batch, width = input_ids.shape
    device = input_ids.device
    num_tokens = attention_mask.sum(dim=1).tolist()
    groups, context_lengths = context_groups(input_ids, num_tokens, loss_mask)
    rows_host = input_ids.tolist()
    packed, positions, segments = [], [], []
    # Where each row's completion starts in its packed row.
    segment_start = [0] * batch
    for rows in groups:
        context = context_lengths[rows[0]]
        tokens, pos, seg = list(rows_host[rows[0]][:context]), list(range(context)), [0] * context
        for member, row in enumerate(rows, start=1):
            segment_start[row] = len(tokens)
            completion = rows_host[row][context:num_tokens[row]]
            tokens += completion
            pos += range(context, context + len(completion))
            seg += [member] * len(completion)
        packed.append(tokens)
        positions.append(pos)
        segments.append(seg)
    packed_width = max(len(t) for t in packed)

    def padded(lists, fill):
        # Built on the host from Python lists, one copy to ``device``.
        return torch.tensor([x + [fill] * (packed_width - len(x)) for x in lists], dtype=torch.long,
                            device="cpu").to(device)
    # Padding gets a segment of its own (-1): it sees the context and itself, never a completion.
    tokens_t, pos_t, seg_t = padded(packed, 0), padded(positions, 0), padded(segments, -1)
    causal = torch.ones(packed_width, packed_width, dtype=torch.bool, device=device).tril()
    visible = (seg_t.unsqueeze(1) == 0) | (seg_t.unsqueeze(1) == seg_t.unsqueeze(2))
    mask_4d = (causal.unsqueeze(0) & visible).unsqueeze(1)

    # Logits only from the shortest context's last token on (the rest of the prompts is unused).
    first_kept = min(context_lengths[rows[0]] for rows in groups) - 1
    forward = {"input_ids": tokens_t, "attention_mask": mask_4d, "position_ids": pos_t, "use_cache": False,
               "logits_to_keep": packed_width - first_kept}

    # For completion token k of row r (input column context + k), the logit that predicts it sits at
    # the context's last position for k = 0, else at the packed position of token k - 1.
    max_completion = max(max(num_tokens[r] - context_lengths[r] for r in range(batch)), 1)
    group_of, source, column, valid = ([[0] * max_completion for _ in range(batch)] for _ in range(4))
    for g, rows in enumerate(groups):
        for row in rows:
            context = context_lengths[row]
            for k in range(num_tokens[row] - context):
                group_of[row][k] = g
                source[row][k] = (context - 1 if k == 0 else segment_start[row] + k - 1) - first_kept
                column[row][k] = context + k
                valid[row][k] = 1
    group_of, source, column, valid = (torch.tensor(x, dtype=torch.long, device=device)
                                       for x in (group_of, source, column, valid))
    targets = torch.gather(input_ids, 1, column)
    if chunk_tokens > 0:
        from llamarl.models.logprob_chunks import selected_logprobs

        # Only the real completion tokens are computed; the padding slots stay 0.
        where = valid.bool()
        token_logp = torch.zeros(valid.shape, dtype=torch.float32, device=device)
        token_logp = token_logp.masked_scatter(where, selected_logprobs(
            model, rows=group_of[where], positions=source[where], targets=targets[where],
            temperature=temperature, chunk_tokens=chunk_tokens, **forward))
    else:
        logits = model(**forward).logits
        picked = logits[group_of, source].float()
        if temperature > 0:
            picked = picked / temperature
        token_logp = torch.log_softmax(picked, dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
        token_logp = torch.where(valid.bool(), token_logp, 0.0)
    out = torch.zeros(batch, width + 1, dtype=token_logp.dtype, device=device)
    # Invalid slots land in the spare last column, cut below.
    return out.scatter(1, torch.where(valid.bool(), column, width), token_logp)[:, :width]
