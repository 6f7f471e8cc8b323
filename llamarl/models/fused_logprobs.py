"""The sampled tokens' log-probs (and the entropy) straight from hidden states through the LM head,
in chunks, without a ``[tokens, vocab]`` fp32 tensor in the forward or the backward.

For hidden states ``h`` ``[N, H]``, the head's weight ``W`` ``[V, H]`` (and bias ``b``), targets
``y`` ``[N]`` and a temperature ``T`` (no division when ``T <= 0``)::

    z_n      = (h_n W^T + b) / T          (the head in its own dtype, then cast to fp32, as HF's path)
    logp_n   = log_softmax(z_n)[y_n]
    H_n      = -sum_v p_nv log p_nv       with p_n = softmax(z_n)   (the entropy)

and for upstream gradients ``g_n = dL / d logp_n`` and ``k_n = dL / d H_n`` (the entropy bonus,
``--algo.entropy-coef``; only with ``entropy_grad``, else the entropy has no gradient and ``k = 0``),
with ``e_n`` the one-hot row of ``y_n``::

    dL/dz_n = g_n (e_n - p_n) - k_n p_n (log p_n + H_n)
    dL/dh_n = (dL/dz_n / T) W        dL/dW = sum_n (dL/dz_n / T)^T h_n        dL/db = sum_n dL/dz_n / T

``HeadLogprobs`` computes these ``chunk_tokens`` rows at a time. The forward keeps nothing of size
vocab (only ``h``, which the head's own backward keeps too); the backward recomputes each chunk's
softmax from ``h`` and ``W`` (one more head matmul per chunk) and writes that chunk's gradients, so
at most one chunk of logits (a few ``[chunk, V]`` fp32 temporaries) is alive at a time. When every
token fits one chunk, the forward keeps that chunk's probabilities instead (the memory of one chunk
and no extra matmul: ``make run``'s micro-batches; with ``entropy_grad`` its log-probabilities too).

The values are the whole-logits path's (``log_softmax(logits.float() / T)`` gathered) row for row;
a head matmul over fewer rows may round differently on some BLAS kernels, so fp32 agrees to ~1e-6
relative and bf16 to bf16's own rounding of the logits (``tests/test_logprob_chunks.py``). The head
gradient of a bf16 head is summed over chunks in fp32. This is Liger-Kernel's fused linear
cross-entropy with plain torch ops and a per-token (not reduced) output.
"""

from __future__ import annotations

import torch

__all__ = ["HeadLogprobs", "fusable", "head_logprobs"]


def _chunk_logits(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                  temperature: float) -> torch.Tensor:
    """``[c, V]`` fp32 ``(h W^T + b) / T`` (no division when ``T <= 0``), one fp32 buffer."""
    logits = torch.nn.functional.linear(hidden, weight, bias)
    logits = logits.float() if logits.dtype != torch.float32 else logits
    return logits.div_(temperature) if temperature > 0 else logits


class HeadLogprobs(torch.autograd.Function):
    """``(logp [N], entropy [N])`` of ``targets`` under ``hidden [N, H] @ weight^T + bias``, both fp32
    (module docstring for the formulas); differentiable in ``hidden``, ``weight`` and ``bias``, the
    entropy only with ``entropy_grad`` (``[0]`` unless ``with_entropy``)."""

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                targets: torch.Tensor, temperature: float, chunk_tokens: int, with_entropy: bool,
                entropy_grad: bool = False):
        count = hidden.shape[0]
        logp = hidden.new_empty(count, dtype=torch.float32)
        entropy = hidden.new_empty(count if with_entropy else 0, dtype=torch.float32)
        single = count <= chunk_tokens
        entropy_grad = bool(entropy_grad and with_entropy)
        kept = kept_log = None
        for lo in range(0, count, chunk_tokens):
            hi = min(lo + chunk_tokens, count)
            log_probs = torch.log_softmax(_chunk_logits(hidden[lo:hi], weight, bias, temperature), dim=-1)
            logp[lo:hi] = log_probs.gather(-1, targets[lo:hi].unsqueeze(-1)).squeeze(-1)
            if with_entropy or single:
                probs = log_probs.exp()
                if with_entropy:
                    entropy[lo:hi] = -torch.linalg.vecdot(probs, log_probs)
                if single and any(ctx.needs_input_grad[:3]):
                    kept = probs
                    kept_log = log_probs if entropy_grad else None
            del log_probs
        if any(ctx.needs_input_grad[:3]):
            ctx.save_for_backward(hidden, weight, bias, targets, kept, kept_log, entropy if entropy_grad else None)
        ctx.temperature, ctx.chunk_tokens, ctx.entropy_grad = temperature, chunk_tokens, entropy_grad
        if not entropy_grad:
            ctx.mark_non_differentiable(entropy)
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp: torch.Tensor, grad_entropy: torch.Tensor):
        hidden, weight, bias, targets, kept, kept_log, entropy = ctx.saved_tensors
        temperature, chunk_tokens, entropy_grad = ctx.temperature, ctx.chunk_tokens, ctx.entropy_grad
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        grad_h = torch.empty_like(hidden) if need_h else None
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
        grad_b = torch.zeros(bias.shape, dtype=torch.float32, device=bias.device) if need_b else None
        count = hidden.shape[0]
        for lo in range(0, count, chunk_tokens):
            hi = min(lo + chunk_tokens, count)
            g = grad_logp[lo:hi].float().unsqueeze(-1)
            if entropy_grad:
                log_probs = kept_log if kept_log is not None else \
                    torch.log_softmax(_chunk_logits(hidden[lo:hi], weight, bias, temperature), dim=-1)
                probs = kept if kept is not None else log_probs.exp()
                # -g p - k p (log p + H), in place on log p (module docstring), then + g e_y below.
                k = grad_entropy[lo:hi].float().unsqueeze(-1)
                grad_z = log_probs.add_(entropy[lo:hi].unsqueeze(-1)).mul_(k).add_(g).mul_(probs).neg_()
                del log_probs, probs
            else:
                probs = kept if kept is not None else \
                    torch.softmax(_chunk_logits(hidden[lo:hi], weight, bias, temperature), dim=-1)
                grad_z = probs.mul_(-g)  # in place on p
            # dL/dz = g (e_y - p) [- k p (log p + H)], then / T: the gradient of the head's own logits.
            grad_z = grad_z.scatter_add_(-1, targets[lo:hi].unsqueeze(-1), g)
            if temperature > 0:
                grad_z.div_(temperature)
            grad_z = grad_z.to(hidden.dtype)  # as autograd casts it back through ``.float()``
            if need_h:
                grad_h[lo:hi] = grad_z @ weight
            if need_w:
                if grad_w.dtype == grad_z.dtype:
                    grad_w.addmm_(grad_z.t(), hidden[lo:hi])
                else:
                    grad_w += grad_z.t() @ hidden[lo:hi]
            if need_b:
                grad_b += grad_z.float().sum(dim=0)
            del grad_z
        kept = kept_log = None
        return (grad_h, grad_w.to(weight.dtype) if need_w else None, grad_b.to(bias.dtype) if need_b else None,
                None, None, None, None, None)


def fusable(head: torch.nn.Module) -> bool:
    """Whether ``head`` is a plain ``nn.Linear`` with local (not DTensor) weights, so ``HeadLogprobs``
    can take its weight; other heads (a tensor-parallel one) go through their own forward, chunk by
    chunk (``llamarl/models/logprob_chunks.py``)."""
    from torch.distributed.tensor import DTensor

    return (type(head) is torch.nn.Linear and not isinstance(head.weight, DTensor)
            and (head.bias is None or not isinstance(head.bias, DTensor)))


def head_logprobs(head: torch.nn.Linear, hidden: torch.Tensor, targets: torch.Tensor, *, temperature: float,
                  chunk_tokens: int, with_entropy: bool = False,
                  entropy_grad: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``HeadLogprobs`` of ``hidden [N, H]`` through ``head`` (``fusable(head)``): ``(logp, entropy)``,
    fp32 ``[N]`` each (entropy ``[0]`` unless ``with_entropy``; differentiable with ``entropy_grad``).
    ``chunk_tokens >= 1``."""
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
    return HeadLogprobs.apply(hidden, head.weight, head.bias, targets, temperature, chunk_tokens, with_entropy,
                              entropy_grad)
