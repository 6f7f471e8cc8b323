"""Per-token log-probs of completions under a causal LM (the trainer's side of every ratio).

Model-level math: a forward of the model and the log-softmax of its logits, used by the trainer's
micro-batches (``llamarl/models/microbatch.py``) and the reference policy; the losses that use the
values are in ``llamarl/algorithms/``."""

from __future__ import annotations

import torch

from llamarl.models.logprob_chunks import selected_logprobs

DEFAULT_CHUNK_TOKENS = 1024
"""``--trainer.logprob-chunk-tokens``'s default: the log-probs from the hidden states 1,024 tokens at
a time (``llamarl/models/fused_logprobs.py``): ~200 MB of fp32 logits per chunk at Qwen's vocabulary."""


def completion_logprobs(model, input_ids, attention_mask, *, start: int, temperature: float,
                        chunk_tokens: int = 0, entropy_out: list | None = None,
                        entropy_grad: bool = False) -> torch.Tensor:
    """Log-probs [B, L] of ``input_ids[:, t]`` under ``model`` for t >= ``start`` (0 before):
    ``out[b, t] = log_softmax(logits[b, t - 1] / T)[input_ids[b, t]]`` (fp32; no division when
    ``T <= 0``).

    Only the logits of positions ``start - 1 .. L - 2`` are computed (``logits_to_keep``): the
    prompt's full-vocabulary logits are the most expensive part of the forward and unused.
    Logits are divided by ``temperature`` so the ratio with the behaviour log-probs is exact.
    ``chunk_tokens > 0``: the same values from the hidden states, that many tokens at a time, never
    the whole ``[tokens, vocab]`` logits (``llamarl/models/logprob_chunks.py``); 0: the whole logits.
    ``entropy_out``: a list that gets the entropy ``-sum_v p_v log p_v`` of each of those
    distributions appended, ``[B, L]`` fp32 (0 before ``start``; differentiable only with
    ``entropy_grad``, the entropy bonus's path).
    """
    length = input_ids.shape[1]
    start = max(int(start), 1)
    if chunk_tokens > 0:
        batch, kept = input_ids.shape[0], length - start
        rows = torch.arange(batch, device=input_ids.device).repeat_interleave(kept)
        positions = torch.arange(kept, device=input_ids.device).repeat(batch)
        token_logp = selected_logprobs(
            model, rows=rows, positions=positions, targets=input_ids[:, start:].reshape(-1),
            temperature=temperature, chunk_tokens=chunk_tokens, with_entropy=entropy_out is not None,
            entropy_grad=entropy_grad, input_ids=input_ids, attention_mask=attention_mask, use_cache=False, logits_to_keep=kept + 1)
        if entropy_out is not None:
            token_logp, entropy = token_logp
            entropy_out.append(torch.nn.functional.pad(entropy.view(batch, kept), (start, 0)))
        return torch.nn.functional.pad(token_logp.view(batch, kept), (start, 0))
    logits = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False,
                   logits_to_keep=length - start + 1).logits[:, :-1].float()
    if temperature > 0:
        logits = logits / temperature
    targets = input_ids[:, start:]
    log_probs = torch.log_softmax(logits, dim=-1)
    if entropy_out is not None:
        with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
            entropy_out.append(torch.nn.functional.pad(-torch.linalg.vecdot(log_probs.exp(), log_probs), (start, 0)))
    token_logp = log_probs.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    return torch.nn.functional.pad(token_logp, (start, 0))
