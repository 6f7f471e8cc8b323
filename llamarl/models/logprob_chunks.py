"""Per-token log-probs without the full-vocabulary logits of a whole micro-batch.

The trainer's log-probs need, per completion token, ``log_softmax(logits / T)`` at the sampled id.
Computed the plain way, a micro-batch of 16,384 tokens over Qwen's 151,936-id vocabulary builds
~10 GB of fp32 logits per copy (the projection, the fp32 cast, the division, the log-softmax), and
autograd keeps several of them for the backward. ``selected_logprobs`` computes the same values in
chunks of ``chunk_tokens`` tokens: the LM head runs on one chunk of hidden states at a time and, when
gradients are needed, each chunk is checkpointed (its logits are recomputed in the backward instead
of kept), so at most one chunk's logits are alive at once. Values and gradients are today's up to
summation order (the head's matmul over fewer rows; the head's gradient summed chunk by chunk).

How it stays correct under FSDP2: the chunked head runs *inside* the model's own forward. For the
duration of the call the model's output-embedding module (``get_output_embeddings()``, the
``lm_head``) is swapped for a small module that takes the final hidden states, picks the selected
positions and returns their log-probs, calling the original head on each chunk. The model's forward
hooks (FSDP2's root unshard, which also gathers the head's and the tied embedding's weights) run as
before, and the head's parameters are the ones FSDP2 manages. Models that post-process the head's
output (Gemma 2's ``final_logit_softcapping``) are refused with a one-line error: the softcap would
be applied to log-probs.

This is the approach of Liger-Kernel's fused linear cross-entropy and verl's
``use_fused_kernels`` / chunked entropy, written with plain torch ops (no custom kernel).
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
from torch.utils.checkpoint import checkpoint

__all__ = ["selected_logprobs"]


def _chunk_logprobs(head: torch.nn.Module, hidden: torch.Tensor, targets: torch.Tensor,
                    temperature: float) -> torch.Tensor:
    logits = head(hidden).float()
    if temperature > 0:
        logits = logits / temperature
    return torch.log_softmax(logits, dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)


class _SelectedLogprobHead(torch.nn.Module):
    """Stands in for the LM head during one forward: hidden states ``[B, K, H]`` in, the log-probs
    ``[N]`` of ``targets`` at ``(rows, positions)`` out, ``chunk_tokens`` rows of logits at a time."""

    def __init__(self, head: torch.nn.Module, *, rows: torch.Tensor, positions: torch.Tensor,
                 targets: torch.Tensor, temperature: float, chunk_tokens: int) -> None:
        super().__init__()
        # A plain attribute, not a submodule: the head stays registered where it was.
        object.__setattr__(self, "head", head)
        self.rows, self.positions, self.targets = rows, positions, targets
        self.temperature, self.chunk_tokens = temperature, chunk_tokens

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        picked = hidden[self.rows, self.positions]
        parts = []
        for lo in range(0, picked.shape[0], self.chunk_tokens):
            args = (self.head, picked[lo : lo + self.chunk_tokens], self.targets[lo : lo + self.chunk_tokens],
                    self.temperature)
            if torch.is_grad_enabled():
                parts.append(checkpoint(_chunk_logprobs, *args, use_reentrant=False))
            else:
                parts.append(_chunk_logprobs(*args))
        return torch.cat(parts) if parts else picked.new_zeros(0, dtype=torch.float32)


@contextmanager
def _head_replaced(model: torch.nn.Module, replacement_for):
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    names = [name for name, child in model.named_children() if child is head] if head is not None else []
    if len(names) != 1:
        raise ValueError(f"--trainer.logprob-chunk-tokens needs a model whose LM head is a direct child "
                         f"(get_output_embeddings()); {type(model).__name__} has none")
    if getattr(getattr(model, "config", None), "final_logit_softcapping", None):
        raise ValueError(f"--trainer.logprob-chunk-tokens: {type(model).__name__} soft-caps its logits after "
                         f"the LM head (final_logit_softcapping); set --trainer.logprob-chunk-tokens 0")
    setattr(model, names[0], replacement_for(head))
    try:
        yield
    finally:
        setattr(model, names[0], head)


def selected_logprobs(model: torch.nn.Module, *, rows: torch.Tensor, positions: torch.Tensor,
                      targets: torch.Tensor, temperature: float, chunk_tokens: int,
                      **forward_kwargs) -> torch.Tensor:
    """``out[n] = log_softmax(logits[rows[n], positions[n]] / T)[targets[n]]`` (fp32, ``[N]``), where
    ``logits = model(**forward_kwargs).logits`` (so ``positions`` index the positions the forward
    keeps, after ``logits_to_keep``), computed ``chunk_tokens`` selected tokens at a time without
    building the whole logits tensor (module docstring). ``temperature <= 0`` means no division
    (greedy's log-probs). Differentiable when grad is enabled. ``chunk_tokens`` must be >= 1."""
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")

    def replacement(head):
        return _SelectedLogprobHead(head, rows=rows, positions=positions, targets=targets,
                                    temperature=temperature, chunk_tokens=chunk_tokens)

    with _head_replaced(model, replacement):
        return model(**forward_kwargs).logits
