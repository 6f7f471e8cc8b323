"""Boxes: the region of a global tensor one rank holds, as ``(start, length)`` per dim.

One vocabulary for everything that moves or stores shards: the DDMA plan intersects a trainer's
box with a generator's to find the block a pair moves (``llamarl/channels/ddma_plan.py``), a
sharded checkpoint intersects the saved boxes with this rank's to read only the bytes it needs
(``llamarl/runtime/sharded_state.py``), and a trainer rank loading its FSDP2 shard reads only its own rows
(``chunk_slice``, ``llamarl/models/sharded_loading.py``). Boxes are tuples in memory and
``[[start, length], ...]`` in JSON; every function here takes either. A foundation module: it
imports nothing of llamarl, so models, channels and checkpoints can all use it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

Box = tuple[tuple[int, int], ...]
BoxLike = Sequence[Sequence[int]]


def box_index(box: BoxLike) -> tuple[slice, ...]:
    """Basic-indexing slices selecting ``box`` (a view, never a copy)."""
    return tuple(slice(start, start + length) for start, length in box)


def intersect(a: BoxLike, b: BoxLike) -> Box | None:
    """The box both ``a`` and ``b`` cover, or None when they do not overlap."""
    out = []
    for (sa, la), (sb, lb) in zip(a, b):
        start, stop = max(sa, sb), min(sa + la, sb + lb)
        if stop <= start:
            return None
        out.append((start, stop - start))
    return tuple(out)


def shift(box: BoxLike, origin: BoxLike) -> Box:
    """``box`` in the coordinates of the tensor holding ``origin`` (its start subtracted)."""
    return tuple((s - o, length) for (s, length), (o, _) in zip(box, origin))


def inside(box: BoxLike, outer: BoxLike) -> bool:
    """Whether ``box`` lies within ``outer``."""
    return all(so <= s and s + length <= so + lo for (s, length), (so, lo) in zip(box, outer))


def volume(box: BoxLike) -> int:
    """Elements in ``box``."""
    return math.prod(length for _, length in box)


def chunk_slice(size: int, *, rank: int, world: int) -> tuple[int, int]:
    """``(start, length)`` of ``rank``'s part of ``size`` under torch.chunk (FSDP2 / DTensor) rules."""
    chunk = -(-size // world)
    start = min(chunk * rank, size)
    return start, min(chunk, size - start)


def local_tensor(param: torch.Tensor) -> torch.Tensor:
    """The tensor this rank holds for ``param`` (the DTensor's local shard, else the tensor)."""
    return param.to_local() if isinstance(param, DTensor) else param


def dtensor_box(name: str, param: DTensor) -> list[list[int]]:
    """The box this rank's shard of ``param`` covers, as JSON (``[[offset, length], ...]``).

    Raises ValueError for placements that are not one contiguous box per rank (``_StridedShard``
    of FSDP2 + TP, ``Partial``) and for a local shard that is not torch's chunk-rule shape."""
    for placement in param.placements:
        if type(placement) not in (Shard, Replicate):
            raise ValueError(f"parameter {name!r} has placement {placement}; only Shard and Replicate are supported")
    # torch computes the offsets with small host tensors made on the default device: pin it to the
    # host explicitly (this is shape metadata, never device data; it also keeps the device guard,
    # which sets the default to meta, from tripping on torch's own code).
    with torch.device("cpu"):
        shape, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
    local = tuple(param.to_local().shape)
    if tuple(shape) != local:
        raise ValueError(f"parameter {name!r}: local shard {list(local)} is not the chunk-rule shape {list(shape)}")
    return [[int(o), int(s)] for o, s in zip(offset, shape)]
