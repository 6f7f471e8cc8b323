"""Per-token log-probs of completions under a causal LM (the trainer's side of every ratio).

Model-level math: a forward of the model and the log-softmax of its logits, used by the trainer's
micro-batches (``llamarl/models/microbatch.py``) and the reference policy; the losses that use the
values are in ``llamarl/algorithms/``."""

from __future__ import annotations

import torch

from llamarl.models.logprob_chunks import selected_logprobs


def completion_logprobs(model, input_ids, attention_mask, *, start: int, temperature: float,
                        chunk_tokens: int = 0) -> torch.Tensor:
    """Log-probs [B, L] of ``input_ids[:, t]`` under ``model`` for t >= ``start`` (0 before).

    Only the logits of positions ``start - 1 .. L - 2`` are computed (``logits_to_keep``): the
    prompt's full-vocabulary logits are the most expensive part of the forward and unused.
    Logits are divided by ``temperature`` so the ratio with the behaviour log-probs is exact.
    ``chunk_tokens > 0``: the same values, never more than that many tokens' logits alive at once
    (``llamarl/models/logprob_chunks.py``).
    """
    length = input_ids.shape[1]
    start = max(int(start), 1)
    if chunk_tokens > 0:
        batch, kept = input_ids.shape[0], length - start
        rows = torch.arange(batch, device=input_ids.device).repeat_interleave(kept)
        positions = torch.arange(kept, device=input_ids.device).repeat(batch)
        token_logp = selected_logprobs(
            model, rows=rows, positions=positions, targets=input_ids[:, start:].reshape(-1),
            temperature=temperature, chunk_tokens=chunk_tokens, input_ids=input_ids,
            attention_mask=attention_mask, use_cache=False, logits_to_keep=kept + 1).view(batch, kept)
        return torch.nn.functional.pad(token_logp, (start, 0))
    logits = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False,
                   logits_to_keep=length - start + 1).logits[:, :-1].float()
    if temperature > 0:
        logits = logits / temperature
    targets = input_ids[:, start:]
    token_logp = torch.log_softmax(logits, dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    return torch.nn.functional.pad(token_logp, (start, 0))
