"""Per-token log-probs of completions under a causal LM (the trainer's side of every ratio)."""

from __future__ import annotations

import torch


def completion_logprobs(model, input_ids, attention_mask, *, start: int, temperature: float) -> torch.Tensor:
    """Log-probs [B, L] of ``input_ids[:, t]`` under ``model`` for t >= ``start`` (0 before).

    Only the logits of positions ``start - 1 .. L - 2`` are computed (``logits_to_keep``): the
    prompt's full-vocabulary logits are the most expensive part of the forward and unused.
    Logits are divided by ``temperature`` so the ratio with the behaviour log-probs is exact.
    """
    length = input_ids.shape[1]
    start = max(int(start), 1)
    logits = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False,
                   logits_to_keep=length - start + 1).logits[:, :-1].float()
    if temperature > 0:
        logits = logits / temperature
    targets = input_ids[:, start:]
    token_logp = torch.log_softmax(logits, dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    return torch.nn.functional.pad(token_logp, (start, 0))
