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

Per-layer compilation (``compile_layers``, ``--trainer.compile layers``) is applied in torchtitan's
order (activation checkpointing, then compile, then ``fully_shard``) with the same reasoning for
the instance: each decoder layer's own forward is replaced by its ``torch.compile``, not the module
by an ``OptimizedModule`` (whose ``_orig_mod.`` would enter every parameter's name). Unlike
torchtitan's, the compiled region is inside the checkpoint, not around it: the trainer's segment
attention is a graph break, and dynamo cannot break a graph inside a checkpointed region (it would
run the whole layer eagerly). FSDP2's hooks stay outside the compiled region: they are the
module's hooks, run by ``__call__`` around ``forward``.
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


COMPILE_BACKENDS = ("inductor", "aot_eager", "eager")
"""``--trainer.compile-backend``: inductor (generated kernels: the one that speeds up), aot_eager and
eager (trace only, seconds on a CPU: tests)."""


def compile_layers(model: torch.nn.Module, *, backend: str = "inductor") -> int:
    """``torch.compile`` each decoder layer's forward on its instance (module docstring), with
    ``backend``; names, module tree and the values computed (up to the backend's fusion order) are
    unchanged. Apply after ``checkpoint_layers`` and before ``fully_shard``. Idempotent; returns the
    number of layers. A checkpointed layer's own forward is compiled and the checkpoint stays
    outside it, eager: a graph break inside a checkpointed region (segment attention's host loop)
    would leave dynamo nothing to compile, and the recompute runs the compiled forward again. Every
    layer runs the same code, so dynamo keeps one cache entry per layer on that code: the recompile
    limit is raised to cover them (``_layer_recompile_limit``)."""
    if backend not in COMPILE_BACKENDS:
        raise ValueError(f"--trainer.compile-backend must be one of {COMPILE_BACKENDS}, got {backend!r}")
    layers = decoder_layers(model)
    _layer_recompile_limit(len(layers))
    for layer in layers:
        if is_compiled(layer):
            continue
        forward = vars(layer).get("forward")
        if isinstance(forward, functools.partial) and forward.func is _checkpointed:  # compiled inside
            layer.forward = functools.partial(_checkpointed, torch.compile(forward.args[0], backend=backend))
        else:
            layer.forward = torch.compile(layer.forward, backend=backend)
    return len(layers)


def is_compiled(layer: torch.nn.Module) -> bool:
    """Whether ``compile_layers`` compiled ``layer``'s forward."""
    forward = vars(layer).get("forward")
    if isinstance(forward, functools.partial) and forward.func is _checkpointed:
        forward = forward.args[0]
    return getattr(forward, "_torchdynamo_orig_callable", None) is not None


# Per layer: static shapes, then automatic dynamic shapes, grad and no-grad (proximal, reference).
_ENTRIES_PER_LAYER = 4


def _layer_recompile_limit(num_layers: int) -> None:
    # Older torch (< 2.7) names the limit cache_size_limit; never lowered (another model may need more).
    config = torch._dynamo.config
    name = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"
    setattr(config, name, max(getattr(config, name), _ENTRIES_PER_LAYER * num_layers))
    if hasattr(config, "accumulated_recompile_limit"):
        config.accumulated_recompile_limit = max(config.accumulated_recompile_limit, _ENTRIES_PER_LAYER * num_layers * 4)


def shard_model(model: torch.nn.Module, mesh, *, param_dtype: torch.dtype | None = None,
                activation_checkpointing: bool = False, compile_backend: str | None = None) -> torch.nn.Module:
    """FSDP2 ``fully_shard`` each decoder layer, then the root (HF ``model.model.layers`` layout).

    ``param_dtype`` (e.g. bf16) is the compute dtype of a MixedPrecisionPolicy; gradients are
    reduced in fp32 and the sharded master weights keep the model's dtype.
    ``activation_checkpointing``: each decoder layer recomputes its activations in the backward
    (``checkpoint_layers``; ``models/memory.py`` counts what that saves). ``compile_backend``
    (``--trainer.compile layers``): each decoder layer's forward compiled with it (``compile_layers``,
    after checkpointing, before sharding: torchtitan's order); None: eager.
    """
    # The trainable parameters' dtype decides: under LoRA the frozen base may already be stored in
    # param_dtype while the adapters keep fp32 masters that must be cast for compute.
    params = list(model.parameters())
    master = next((p.dtype for p in params if p.requires_grad), params[0].dtype)
    mp_policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32) \
        if param_dtype is not None and param_dtype != master else MixedPrecisionPolicy()
    if activation_checkpointing:
        checkpoint_layers(model)
    if compile_backend is not None:
        compile_layers(model, backend=compile_backend)
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
