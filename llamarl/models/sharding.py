"""FSDP2 sharding of an HF causal LM and whole-parameter views of a sharded model.

Shared by every executor that trains or reads a sharded model (the trainer, a reference policy,
a critic) and by the weight channel.
"""

from __future__ import annotations

import torch
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor


def shard_model(model: torch.nn.Module, mesh, *, param_dtype: torch.dtype | None = None) -> torch.nn.Module:
    """FSDP2 ``fully_shard`` each decoder layer, then the root (HF ``model.model.layers`` layout).

    ``param_dtype`` (e.g. bf16) is the compute dtype of a MixedPrecisionPolicy; gradients are
    reduced in fp32 and the sharded master weights keep the model's dtype.
    """
    mp_policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32) \
        if param_dtype is not None and param_dtype != next(model.parameters()).dtype else MixedPrecisionPolicy()
    layers = getattr(getattr(model, "model", None), "layers", None)
    for layer in layers or []:
        fully_shard(layer, mesh=mesh, mp_policy=mp_policy)
    fully_shard(model, mesh=mesh, mp_policy=mp_policy)
    return model


def reshard_after_no_grad(model: torch.nn.Module) -> None:
    """Put an FSDP2 model's parameters back into their shards after forwards without a backward.

    FSDP2 leaves the root module's parameters (embeddings, final norm, lm_head) unsharded after a
    forward, expecting the backward to need them; with no backward (a no-grad proximal or
    reference forward, an evaluation), ``named_parameters()`` would keep returning the whole
    tensors, and a weight read (DDMA, checkpoint, export) would copy wrong rows. A no-op for a
    model that is not FSDP2-sharded or is already resharded."""
    if isinstance(model, FSDPModule):
        model.reshard()


def full_named_parameters(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter materialised whole (collective over the FSDP mesh for DTensors)."""
    return {name: (p.full_tensor() if isinstance(p, DTensor) else p).detach()
            for name, p in model.named_parameters()}
