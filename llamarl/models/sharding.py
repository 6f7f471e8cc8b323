"""FSDP2 sharding of an HF causal LM, per-layer activation checkpointing, and whole-parameter
views of a sharded model.

Shared by every executor that trains or reads a sharded model (the trainer, a reference policy,
a critic) and by the weight channel.

Activation checkpointing (``checkpoint_layers``) replaces each decoder layer's ``forward`` on the
instance by a non-reentrant ``torch.utils.checkpoint`` call of the original, instead of wrapping the
layer in torch's ``checkpoint_wrapper`` module (torchtitan's way): the wrapper puts
``_checkpoint_wrapped_module.`` into every parameter's name, and checkpoints, weight sync and
export match parameters by their HF names. Either way FSDP2's hooks stay outside the checkpointed
call: ``fully_shard``'s pre-forward unshard and post-forward reshard run once per forward, and the
recompute in the backward runs after FSDP2's pre-backward unshard, on the gathered parameters.
"""

from __future__ import annotations

import functools

import torch
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor
from torch.utils.checkpoint import checkpoint


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The decoder layers of an HF causal LM (``model.model.layers``), [] when it has none."""
    return list(getattr(getattr(model, "model", None), "layers", None) or [])


def _checkpointed(forward, *args, **kwargs):
    # No graph, nothing to recompute: a no-grad forward (proximal, reference, evaluation) runs as is.
    if not torch.is_grad_enabled():
        return forward(*args, **kwargs)
    return checkpoint(forward, *args, use_reentrant=False, **kwargs)


def checkpoint_layers(model: torch.nn.Module) -> int:
    """Make each decoder layer recompute its activations in the backward (module docstring); the
    module tree, parameter names and the values computed are unchanged. Idempotent; returns the
    number of decoder layers. Apply before ``fully_shard``."""
    layers = decoder_layers(model)
    for layer in layers:
        if "forward" not in vars(layer):  # not yet replaced on this instance
            layer.forward = functools.partial(_checkpointed, layer.forward)
    return len(layers)


def shard_model(model: torch.nn.Module, mesh, *, param_dtype: torch.dtype | None = None,
                activation_checkpointing: bool = False) -> torch.nn.Module:
    """FSDP2 ``fully_shard`` each decoder layer, then the root (HF ``model.model.layers`` layout).

    ``param_dtype`` (e.g. bf16) is the compute dtype of a MixedPrecisionPolicy; gradients are
    reduced in fp32 and the sharded master weights keep the model's dtype.
    ``activation_checkpointing``: each decoder layer recomputes its activations in the backward
    (``checkpoint_layers``; ``models/memory.py`` counts what that saves).
    """
    # The trainable parameters' dtype decides: under LoRA the frozen base may already be stored in
    # param_dtype while the adapters keep fp32 masters that must be cast for compute.
    params = list(model.parameters())
    master = next((p.dtype for p in params if p.requires_grad), params[0].dtype)
    mp_policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32) \
        if param_dtype is not None and param_dtype != master else MixedPrecisionPolicy()
    if activation_checkpointing:
        checkpoint_layers(model)
    for layer in decoder_layers(model):
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
