"""Per-token log-probs without the full-vocabulary logits of a whole micro-batch.

The trainer's log-probs need, per completion token, ``log_softmax(logits / T)`` at the sampled id.
Computed the plain way, a micro-batch of 16,384 tokens over Qwen's 151,936-id vocabulary builds
~10 GB of fp32 logits per copy (the projection, the fp32 cast, the division, the log-softmax), and
autograd keeps several of them for the backward. ``selected_logprobs`` computes the same values in
chunks of ``chunk_tokens`` tokens, so at most one chunk's logits are alive at once:

* a plain ``nn.Linear`` head (every family here, tied or untied, under FSDP2 or not; LoRA never
  adapts the head): ``llamarl/models/fused_logprobs.py``'s ``HeadLogprobs``, a custom autograd
  function over the head's weight whose backward recomputes each chunk's softmax and writes the
  hidden-state and weight gradients itself (no fp32 ``[tokens, vocab]`` tensor in either pass); it
  also gives each token's entropy ``-sum_v p_v log p_v`` for free;
* any other head (a tensor-parallel DTensor one, logit soft-capping): the head's own forward on one
  chunk at a time, each chunk checkpointed (its logits recomputed in the backward).

Values and gradients are the whole-logits path's up to summation order (the head's matmul over
fewer rows; the head's gradient summed chunk by chunk).

How it stays correct under FSDP2: the chunked head runs *inside* the model's own forward. For the
duration of the call the model's output-embedding module (``get_output_embeddings()``, the
``lm_head``) is swapped for a small module that takes the final hidden states, picks the selected
positions and returns their log-probs from the original head's weight (unsharded by FSDP2's root
pre-forward, which also gathers the tied embedding) or by calling the original head per chunk.
Models that soft-cap the head's output (Gemma 2's ``final_logit_softcapping``) have the cap
``c * tanh(z / c)`` applied inside, per chunk, in the head's dtype as HF does, with the model's own
cap switched off for the call.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
from torch.utils.checkpoint import checkpoint

from llamarl.models.fused_logprobs import fusable, head_logprobs

__all__ = ["selected_logprobs"]


def _chunk_logprobs(head: torch.nn.Module, hidden: torch.Tensor, targets: torch.Tensor, temperature: float,
                    softcap: float | None, with_entropy: bool,
                    entropy_grad: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``(log_softmax(z)[targets], entropy)`` of one chunk, ``z = softcap(head(hidden)).float() / T``
    (``entropy`` ``[0]`` unless ``with_entropy``; differentiable only with ``entropy_grad``)."""
    logits = head(hidden)
    if softcap:
        logits = torch.tanh(logits / softcap) * softcap
    logits = logits.float()
    if temperature > 0:
        logits = logits / temperature
    log_probs = torch.log_softmax(logits, dim=-1)
    with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
        entropy = -torch.linalg.vecdot(log_probs.exp(), log_probs) if with_entropy else log_probs.new_zeros(0)
    return log_probs.gather(-1, targets.unsqueeze(-1)).squeeze(-1), entropy


class _SelectedLogprobHead(torch.nn.Module):
    """Stands in for the LM head during one forward: hidden states ``[B, K, H]`` in, the log-probs
    ``[N]`` of ``targets`` at ``(rows, positions)`` out, ``chunk_tokens`` rows of logits at a time;
    ``entropy`` ``[N]`` (differentiable only with ``entropy_grad``) is left on the module."""

    def __init__(self, head: torch.nn.Module, *, rows: torch.Tensor, positions: torch.Tensor,
                 targets: torch.Tensor, temperature: float, chunk_tokens: int, softcap: float | None,
                 with_entropy: bool, entropy_grad: bool = False) -> None:
        super().__init__()
        # A plain attribute, not a submodule: the head stays registered where it was.
        object.__setattr__(self, "head", head)
        self.rows, self.positions, self.targets = rows, positions, targets
        self.temperature, self.chunk_tokens, self.softcap = temperature, chunk_tokens, softcap
        self.with_entropy, self.entropy_grad = with_entropy, entropy_grad
        self.entropy: torch.Tensor | None = None

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        picked = hidden[self.rows, self.positions]
        if fusable(self.head) and not self.softcap:
            logp, self.entropy = head_logprobs(self.head, picked, self.targets, temperature=self.temperature,
                                               chunk_tokens=self.chunk_tokens, with_entropy=self.with_entropy,
                                               entropy_grad=self.entropy_grad)
            return logp
        parts, entropies = [], []
        for lo in range(0, picked.shape[0], self.chunk_tokens):
            args = (self.head, picked[lo : lo + self.chunk_tokens], self.targets[lo : lo + self.chunk_tokens],
                    self.temperature, self.softcap, self.with_entropy, self.entropy_grad)
            if torch.is_grad_enabled():
                logp, entropy = checkpoint(_chunk_logprobs, *args, use_reentrant=False)
            else:
                logp, entropy = _chunk_logprobs(*args)
            parts.append(logp)
            entropies.append(entropy)
        empty = picked.new_zeros(0, dtype=torch.float32)
        self.entropy = torch.cat(entropies) if entropies else empty
        return torch.cat(parts) if parts else empty


@contextmanager
def _head_replaced(model: torch.nn.Module, replacement_for):
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    names = [name for name, child in model.named_children() if child is head] if head is not None else []
    if len(names) != 1:
        raise ValueError(f"--trainer.logprob-chunk-tokens needs a model whose LM head is a direct child "
                         f"(get_output_embeddings()); {type(model).__name__} has none; "
                         f"set --trainer.logprob-chunk-tokens 0")
    config = getattr(model, "config", None)
    softcap = getattr(config, "final_logit_softcapping", None)
    stand_in = replacement_for(head, softcap)
    setattr(model, names[0], stand_in)
    if softcap:
        config.final_logit_softcapping = None  # applied inside the stand-in, per chunk
    try:
        yield stand_in
    finally:
        setattr(model, names[0], head)
        if softcap:
            config.final_logit_softcapping = softcap


def selected_logprobs(model: torch.nn.Module, *, rows: torch.Tensor, positions: torch.Tensor,
                      targets: torch.Tensor, temperature: float, chunk_tokens: int,
                      with_entropy: bool = False, entropy_grad: bool = False, **forward_kwargs):
    """``out[n] = log_softmax(logits[rows[n], positions[n]] / T)[targets[n]]`` (fp32, ``[N]``), where
    ``logits = model(**forward_kwargs).logits`` (so ``positions`` index the positions the forward
    keeps, after ``logits_to_keep``), computed ``chunk_tokens`` selected tokens at a time without
    building the whole logits tensor (module docstring). ``temperature <= 0`` means no division
    (greedy's log-probs). Differentiable when grad is enabled. ``chunk_tokens`` must be >= 1.
    ``with_entropy``: ``(out, entropy)``, ``entropy[n] = -sum_v p_v log p_v`` of the same softmax
    (fp32 ``[N]``; differentiable only with ``entropy_grad``: the entropy bonus)."""
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")

    def replacement(head, softcap):
        return _SelectedLogprobHead(head, rows=rows, positions=positions, targets=targets,
                                    temperature=temperature, chunk_tokens=chunk_tokens, softcap=softcap,
                                    with_entropy=with_entropy, entropy_grad=entropy_grad)

    with _head_replaced(model, replacement) as stand_in:
        logp = model(**forward_kwargs).logits
    return (logp, stand_in.entropy) if with_entropy else logp
