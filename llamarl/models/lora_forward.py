"""The trainer's forward of an adapted linear: the merged weight the generator samples from.

peft computes an adapted linear unmerged, ``x W_base^T + (alpha / r) (x A^T) B^T``, each term
rounded to the compute dtype on its own. The generator (``models/lora_merge.py``) samples from the
merged weight ``W = round(W_base + (alpha / r) B A)``, one bf16 ``addmm``. In fp32 the two are the
same function; in bf16 they are not, and the difference grows with the adapters: measured on
``make run`` (SmolLM2, rank 8, lr 8e-4, colocated, so staleness 0), the k3 KL between the
generator's and the trainer's log-probs of the sampled tokens rose from 2e-3 at the first tick
(B = 0: the same weights) to 1-3e-2 by tick 10, with importance weights up to 10 on the answer's
first digit, while full fine-tuning (both sides the same bf16 weights) stayed at 1-3e-3 (the
whole run in fp32: exactly 0). That is off-policy noise the loss has to clip away, made by LoRA
alone.

``merged_forward`` makes the trainer compute what the generator does: each adapted linear is
``F.linear(x, addmm(W_base, B, A, alpha=alpha / r), bias)`` in the compute dtype, the same
``addmm`` the generator's merge runs on the same bf16 values (A and B as FSDP2's mixed precision
casts them, which is how the wire rounds them), so the two sides hold bitwise the same merged
weights and the trainer's log-probs are the generator's model's exactly (``tests/test_lora_forward.py``,
FSDP2 mixed precision and activation checkpointing included). A TP rank's merge of its slice computes
each element from the same r products; on this machine's kernels it matched the whole merge bitwise.
The backward is LoRA's own, never materialising a full weight gradient: with ``g`` the output's
gradient, ``dx = g W``, ``dA = s (g B)^T x``, ``dB = s g^T (x A^T)`` (s = alpha / r), which is the
gradient of the merged forward exactly (d/dA and d/dB of ``x (W_base + s B A)^T``). Cost: one
``[out, r] x [r, in]`` GEMM per adapted linear per micro-batch forward, again in the backward (the
merged weight is recomputed, not saved: no memory beyond the unmerged path's).

Falls back to peft's own forward where it does not apply: adapters disabled (the reference policy
of ``recipes/ref_kl.py``), peft-merged weights, dropout (which acts on the adapter's input only).
"""

from __future__ import annotations

import types

import torch
import torch.nn.functional as F

__all__ = ["MergedLinear", "use_merged_forward"]


class MergedLinear(torch.autograd.Function):
    """``F.linear(x, W_base + scale B A, bias)`` with W_base and bias frozen (module docstring)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, base: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                bias: torch.Tensor | None, scale: float) -> torch.Tensor:
        ctx.save_for_backward(x, base, a, b)
        ctx.scale = scale
        return F.linear(x, torch.addmm(base, b, a, alpha=scale), bias)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, base, a, b = ctx.saved_tensors
        scale = ctx.scale
        grad_x = grad_a = grad_b = None
        if ctx.needs_input_grad[0]:
            grad_x = grad @ torch.addmm(base, b, a, alpha=scale)
        g = grad.reshape(-1, grad.shape[-1])
        flat_x = x.reshape(-1, x.shape[-1])
        if ctx.needs_input_grad[2]:
            grad_a = (g @ b).t() @ flat_x * scale
        if ctx.needs_input_grad[3]:
            grad_b = g.t() @ (flat_x @ a.t()) * scale
        return grad_x, None, grad_a, grad_b, None, None


def _forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    adapters = [name for name in self.active_adapters if name in self.lora_A]
    if (self.disable_adapters or self.merged or args or kwargs or len(adapters) != 1
            or adapters[0] in self.lora_variant or not isinstance(self.lora_dropout[adapters[0]], torch.nn.Identity)):
        return self._peft_forward(x, *args, **kwargs)
    name = adapters[0]
    base = self.base_layer.weight
    a = self.lora_A[name].weight.to(base.dtype)
    b = self.lora_B[name].weight.to(base.dtype)
    return MergedLinear.apply(x.to(base.dtype), base, a, b, self.base_layer.bias, self.scaling[name])


def use_merged_forward(model: torch.nn.Module) -> int:
    """Give every peft LoRA linear of ``model`` the merged forward (module docstring), before or
    after sharding; returns how many it changed."""
    from peft.tuners.lora import Linear as LoraLinear

    count = 0
    for module in model.modules():
        if isinstance(module, LoraLinear) and not hasattr(module, "_peft_forward"):
            module._peft_forward = types.MethodType(LoraLinear.forward, module)
            module.forward = types.MethodType(_forward, module)
            count += 1
    return count
