"""A Megatron-style tensor-parallel layout of an HF Llama, standing in for a TP engine's weights in
the weight-channel tests and ``benchmarks/weight_sync.py`` (no TP engine runs on CPU)."""

from __future__ import annotations

import torch

from llamarl.runtime.boxes import chunk_slice


def llama_tp_slices(model: torch.nn.Module, *, tp_rank: int, tp_size: int) -> dict[str, tuple[int, int, int]]:
    """Megatron-style TP slice spec of an HF Llama: q/k/v/gate/up ``Shard(0)``, o/down ``Shard(1)``.

    Everything else (embeddings, norms, lm_head) is a replica. Names and shapes are those of
    ``model`` (the full model); slices follow the chunk rule, so uneven sizes are allowed.
    """
    column = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
    row = ("o_proj", "down_proj")
    spec = {}
    for name, param in model.named_parameters():
        module = name.rsplit(".", 2)[-2] if name.endswith(".weight") and name.count(".") >= 1 else ""
        dim = 0 if module in column else 1 if module in row else None
        if dim is not None:
            spec[name] = (dim, *chunk_slice(param.shape[dim], rank=tp_rank, world=tp_size))
    return spec


def narrow_to_slices(model: torch.nn.Module, slices: dict[str, tuple[int, int, int]]) -> torch.nn.Module:
    """Replace each parameter named in ``slices`` by a copy of its ``(dim, start, length)`` slice.

    Stands in for a TP engine in tests and benchmarks: the module is no longer runnable, but its
    parameters have the local shapes a TP rank would hold. Works on meta tensors too.
    """
    for name, (dim, start, length) in slices.items():
        owner, _, leaf = name.rpartition(".")
        module = model.get_submodule(owner)
        old = getattr(module, leaf)
        setattr(module, leaf, torch.nn.Parameter(old.detach().narrow(dim, start, length).clone(),
                                                 requires_grad=old.requires_grad))
    return model
