"""Megatron-style tensor parallelism for HF Llama-family causal LMs on a 1-D TP DeviceMesh.

``apply_tensor_parallel`` shards every decoder layer with ``parallelize_module``:

- attention ``q_proj`` / ``k_proj`` / ``v_proj`` and MLP ``gate_proj`` / ``up_proj``:
  ``ColwiseParallel`` (weight ``Shard(0)``): each rank computes its own heads / MLP columns;
- attention ``o_proj`` and MLP ``down_proj``: ``RowwiseParallel`` (weight ``Shard(1)``): partial
  sums all-reduced over the TP group, so every rank leaves the layer with the full hidden state.

Every TP module hands out plain local tensors (``use_local_output=True``), so the rest of the HF
code never sees a DTensor. That works because transformers' ``LlamaAttention`` reshapes with
``(*input_shape, -1, head_dim)`` and ``reshape(*input_shape, -1)``: with ``num_heads / tp`` local
query heads and ``num_kv_heads / tp`` local KV heads, the ``-1`` picks up the local head count and
``num_key_value_groups`` (their ratio) is unchanged; the KV cache allocates lazily from the local
key/value shapes. Models whose attention reshapes with the config's head counts are not supported.

Embeddings, norms and ``lm_head`` stay plain replicated tensors: the simplest layout (no vocab
parallel loss / gather needed for sampling); they cost one full copy per rank, which for small
models is less than the extra collectives would.

All-reduced activations are bitwise identical on every TP rank, so ranks that feed identical
inputs and seeded generators sample identical tokens (the generator relies on that).
The resulting parameters are DTensors on ``tp_mesh``, which the DDMA weight channel reads as
per-rank boxes, so each TP rank receives exactly its shard.
"""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

COLUMN = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj")
ROW = ("self_attn.o_proj", "mlp.down_proj")


def check_tp_divisibility(config, tp: int) -> None:
    """Raise a one-line ValueError unless heads, KV heads and the MLP width divide by ``tp``."""
    sizes = {"num_heads": config.num_attention_heads,
             "num_kv_heads": getattr(config, "num_key_value_heads", None) or config.num_attention_heads,
             "intermediate_size": config.intermediate_size}
    for name, size in sizes.items():
        if size % tp:
            raise ValueError(f"tensor parallelism tp={tp} needs {name} ({size}) divisible by {tp}")


def check_tp_supported(model: torch.nn.Module) -> None:
    """Raise a one-line ValueError unless ``model`` has the layout this TP plan shards: decoder
    layers at ``model.model.layers``, each with every ``COLUMN`` / ``ROW`` projection as an
    ``nn.Linear``. An architecture with fused or differently named projections (GPT-2's
    ``c_attn``, Phi-3's ``qkv_proj``) would otherwise stay silently unsharded, or half sharded."""
    name = type(model).__name__
    layers = getattr(getattr(model, "model", None), "layers", None)
    if not layers:
        raise ValueError(f"tensor parallelism (--generator.tp) supports Llama-family models with decoder layers "
                         f"at model.model.layers; {name} has none")
    for index, layer in enumerate(layers):
        missing = [path for path in COLUMN + ROW if not isinstance(_submodule(layer, path), torch.nn.Linear)]
        if missing:
            linears = sorted(n for n, m in layer.named_modules() if isinstance(m, torch.nn.Linear))
            raise ValueError(f"tensor parallelism (--generator.tp) cannot shard {name}: decoder layer {index} has no "
                             f"nn.Linear {', '.join(missing)} (its linear layers: {', '.join(linears) or 'none'}); "
                             "use --generator.tp 1 for this architecture")


def _submodule(module: torch.nn.Module, path: str) -> torch.nn.Module | None:
    try:
        return module.get_submodule(path)
    except AttributeError:
        return None


def layer_plan() -> dict:
    """The per-decoder-layer ``parallelize_module`` plan (fresh style objects each call)."""
    plan = {name: ColwiseParallel(use_local_output=True) for name in COLUMN}
    plan.update({name: RowwiseParallel(use_local_output=True) for name in ROW})
    return plan


def apply_tensor_parallel(model: torch.nn.Module, tp_mesh: DeviceMesh) -> torch.nn.Module:
    """Shard ``model``'s decoder layers over ``tp_mesh`` in place (see the module docstring).

    Contract: ``model`` is an HF Llama-family causal LM (``model.model.layers[i].self_attn`` /
    ``.mlp`` with the usual projection names); ``tp_mesh`` is 1-D. Every rank of ``tp_mesh``
    must call it with the same (identically loaded) weights: each rank keeps its own slice
    without any communication. Heads, KV heads and ``intermediate_size`` must divide by the
    mesh size (ValueError naming the first that does not), and the layers must have this plan's
    projections (``check_tp_supported``). Returns ``model``; a TP size of 1 leaves it untouched.
    """
    tp = tp_mesh.size()
    check_tp_divisibility(model.config, tp)
    if tp == 1:
        return model
    check_tp_supported(model)
    for layer in model.model.layers:
        # src_data_rank=None: every rank slices its own (identical) copy, no scatter from rank 0.
        parallelize_module(layer, tp_mesh, layer_plan(), src_data_rank=None)
    return model
