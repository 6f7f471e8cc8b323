"""In-place weight update of a generation model from a (possibly FSDP2-sharded) training model.

Used by the colocated schedule, where every rank holds both a trainer (FSDP2 over all ranks) and
its own full generation model: after each optimizer step the trainer's parameters are written
into the generation model's storage, parameter by parameter. Like verl's FSDP -> rollout sync,
each sharded parameter is all-gathered on its own (``DTensor.full_tensor``), copied (and cast to
the generation model's dtype) and released before the next one, so no rank ever holds a second
full copy of the model at once. On one rank the "gather" is the local tensor itself: a plain copy.
Plain functions of two modules, which the weights channels call (``llamarl/channels/in_memory.py``);
handing a stream to an executor's weight sink is the channels' (``llamarl/channels/sinks.py``).
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor


def check_same_parameters(source: torch.nn.Module, destination: torch.nn.Module) -> None:
    """Every parameter of ``source`` exists in ``destination`` under the same name with the same
    (full) shape; else a one-line ValueError naming the first that does not."""
    targets = dict(destination.named_parameters())
    sources = list(source.named_parameters())
    missing = [name for name, _ in sources if name not in targets]
    if missing:
        raise ValueError(f"the generation model has no parameter(s) {missing[:3]} of the training model")
    for name, param in sources:
        if tuple(param.shape) != tuple(targets[name].shape):
            raise ValueError(f"parameter {name!r}: training shape {tuple(param.shape)} != "
                             f"generation shape {tuple(targets[name].shape)}")


@torch.no_grad()
def copy_weights_in_place(source: torch.nn.Module, destination: torch.nn.Module) -> int:
    """Copy every parameter of ``source`` into the same-named parameter of ``destination``.

    Contract: collective over ``source``'s FSDP mesh when its parameters are DTensors (every rank
    of the mesh must call it; the order is ``named_parameters()``, identical on every rank).
    Names are HF ``named_parameters()`` names (tied weights appear once). ``destination`` keeps its
    dtype and device; its parameter objects are not replaced, so an engine holding references to
    them sees the new values at once. A missing name or a shape mismatch raises ValueError before
    anything is copied. Returns the number of bytes written into ``destination``.
    """
    check_same_parameters(source, destination)
    targets = dict(destination.named_parameters())
    written = 0
    for name, param in source.named_parameters():
        full = param.full_tensor() if isinstance(param, DTensor) else param
        target = targets[name]
        target.copy_(full.to(device=target.device, dtype=target.dtype))
        written += target.numel() * target.element_size()
        del full
    return written


def stream_full_weights(source: torch.nn.Module, *, dtype: torch.dtype, device: torch.device):
    """Yield ``(name, full parameter)`` for every parameter of ``source`` in ``named_parameters()``
    order, each gathered on its own (``DTensor.full_tensor``, collective over the FSDP mesh) and
    cast to ``dtype`` on ``device``: the colocated hand-over into an engine that loads weights
    itself (vLLM), so no second model is ever built. Every rank of the mesh must consume the whole
    iterator (``feed`` in ``llamarl/channels/sinks.py`` runs it to its end after a consumer that may
    stop early). Each yielded tensor is new storage: a consumer may keep it (vLLM buffers a layer's
    weights until the layer is complete)."""
    with torch.no_grad():
        for name, param in source.named_parameters():
            full = param.full_tensor() if isinstance(param, DTensor) else param.detach()
            yield name, full.to(device=device, dtype=dtype, copy=True)
            del full
