"""DDMA planning: per-rank parameter layouts and their intersection into a static transfer plan.

A *layout* is what one rank holds of each parameter, as JSON (it travels as TensorBatch
metadata, never pickle)::

    {"dtype": "bfloat16", "params": [{"name": ..., "shape": [...], "box": [[start, length], ...]}]}

``shape`` is the parameter's global shape (an entry is ``null`` where the rank cannot know it:
the sliced dim of an explicit slice spec); ``box`` is the region of the global tensor this rank
holds, one ``[start, length]`` per dim. A replica holds the whole box; an FSDP2 ``Shard(0)`` rank
holds rows ``[offset, offset + local_rows)``; a TP ``Shard(1)`` rank holds a column range. Boxes
make the intersection generic: trainer box ∩ generator box is the block one pair moves.

``build_plan`` turns every trainer and generator layout into a ``DdmaPlan``: for each
(trainer index, generator index) pair the ordered pieces (parameter, source box in the trainer's
local tensor, destination box in the generator's local tensor, offset in the pair's bucket).
Every rank computes the same plan from the same layouts, so every rank validates identically and
a bad layout raises the same one-line ValueError everywhere instead of hanging a peer.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch.distributed.tensor import DTensor

from llamarl.runtime.batch import DTYPE_NAMES, DTYPES
from llamarl.runtime.boxes import Box, box_index, dtensor_box, inside, intersect, local_tensor, shift, volume

__all__ = ["Box", "DdmaPlan", "Piece", "box_index", "build_plan", "describe_local_layout", "local_tensor"]


def describe_local_layout(
    model: torch.nn.Module,
    *,
    slices: dict[str, tuple[int, int, int]] | None = None,
    single_dtype: bool = False,
) -> dict:
    """This rank's layout of ``model`` (see the module docstring), in ``named_parameters()`` order.

    DTensor parameters describe themselves from their placements (Shard / Replicate on any
    mesh); a plain tensor named in ``slices`` as ``(dim, start, length)`` holds that slice of
    dim ``dim`` (its local size there must be ``length``); any other plain tensor is a replica.
    With ``single_dtype`` the parameters must share one dtype (ValueError otherwise), reported as
    ``dtype``; else ``dtype`` is the first parameter's.
    """
    slices = dict(slices or {})
    params, dtypes = [], []
    for name, param in model.named_parameters():
        dtypes.append(param.dtype)
        spec = slices.pop(name, None)
        if isinstance(param, DTensor):
            if spec is not None:
                raise ValueError(f"parameter {name!r} is a DTensor; it cannot also take an explicit slice")
            shape, box = list(param.shape), dtensor_box(name, param)
        else:
            shape, box = list(param.shape), [[0, s] for s in param.shape]
            if spec is not None:
                dim, start, length = (int(x) for x in spec)
                if not 0 <= dim < param.dim() or start < 0 or param.shape[dim] != length:
                    raise ValueError(f"slice {tuple(spec)} of parameter {name!r} does not fit its local shape "
                                     f"{list(param.shape)}")
                shape[dim], box[dim] = None, [start, length]
        params.append({"name": name, "shape": shape, "box": box})
    if slices:
        raise ValueError(f"slice spec names unknown parameter {min(slices)!r}")
    if single_dtype and len(set(dtypes)) > 1:
        raise ValueError(f"generator parameters mix dtypes {sorted(map(str, set(dtypes)))}; cast the model to one dtype")
    if dtypes and dtypes[0] not in DTYPE_NAMES:
        raise ValueError(f"parameter dtype {dtypes[0]} is not supported by the weight channel")
    return {"dtype": DTYPE_NAMES[dtypes[0]] if dtypes else "float32", "params": params}


@dataclass(frozen=True)
class Piece:
    """One block a (trainer rank, generator rank) pair moves: ``numel`` elements at ``offset``."""

    name: str
    src: Box
    dst: Box
    offset: int

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(length for _, length in self.src)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass
class DdmaPlan:
    """Pieces per (trainer index, generator index) pair and each generator rank's dtype."""

    pieces: dict[tuple[int, int], list[Piece]]
    dtypes: list[str]

    def numel(self, pair: tuple[int, int]) -> int:
        """Elements (of the generator's dtype) the pair moves each sync."""
        return sum(p.numel for p in self.pieces.get(pair, []))


def _trainer_params(layouts: list[dict], label: str) -> dict[str, tuple[list[int], list[Box]]]:
    """name -> (global shape, every trainer rank's box); checks the trainer ranks agree."""
    first = [(p["name"], p["shape"]) for p in layouts[0]["params"]]
    params: dict[str, tuple[list[int], list[Box]]] = {}
    for rank, layout in enumerate(layouts):
        if [(p["name"], p["shape"]) for p in layout["params"]] != first:
            raise ValueError(f"{label}: trainer rank {rank} disagrees with trainer rank 0 on the parameters")
        for p in layout["params"]:
            if any(s is None for s in p["shape"]):
                raise ValueError(f"{label}: trainer parameter {p['name']!r} has an unknown global shape")
            params.setdefault(p["name"], (p["shape"], []))[1].append(tuple(tuple(x) for x in p["box"]))
    for name, (shape, boxes) in params.items():
        distinct = sorted({b for b in boxes if volume(b) > 0})
        full = tuple((0, s) for s in shape)
        overlap = any(intersect(a, b) is not None for i, a in enumerate(distinct) for b in distinct[i + 1:])
        within = all(inside(b, full) for b in distinct)
        if overlap or not within or sum(map(volume, distinct)) != math.prod(shape):
            raise ValueError(f"{label}: the trainer's shards of {name!r} do not tile its shape {shape} exactly")
    return params


def _check_generator_param(label: str, rank: int, p: dict, trainer: dict) -> Box:
    name = p["name"]
    if name not in trainer:
        raise ValueError(f"{label}: generator parameter {name!r} does not exist in the trainer's model")
    shape, box = trainer[name][0], tuple(tuple(x) for x in p["box"])
    gshape = p["shape"]
    if len(gshape) != len(shape) or any(g is not None and g != t for g, t in zip(gshape, shape)):
        shown = ["?" if g is None else g for g in gshape]
        raise ValueError(f"{label}: parameter {name!r} is {shape} on the trainer but {shown} on the generator")
    if len(box) != len(shape) or not inside(box, tuple((0, s) for s in shape)):
        raise ValueError(f"{label}: generator rank {rank} holds {[list(b) for b in box]} of parameter {name!r}, "
                         f"outside its trainer shape {shape}")
    return box


def build_plan(trainer_layouts: list[dict], generator_layouts: list[dict], *, label: str = "weights") -> DdmaPlan:
    """Intersect every trainer layout with every generator layout into a static ``DdmaPlan``.

    Generator parameters must exist in the trainer with the same (known) shape and lie inside it;
    the trainer's non-empty boxes must tile each parameter exactly (identical boxes are replicas:
    generator rank ``g`` takes such a block from the ``g % k``-th of its ``k`` holders, so each
    byte goes once to each generator rank). Extra trainer parameters are ignored. Violations raise
    a one-line ValueError naming ``label`` and the parameter.
    """
    trainer = _trainer_params(trainer_layouts, label)
    holders = {name: {} for name in trainer}  # name -> {box: [trainer indices]}
    for name, (_, boxes) in trainer.items():
        for index, box in enumerate(boxes):
            if volume(box) > 0:
                holders[name].setdefault(box, []).append(index)
    pieces: dict[tuple[int, int], list[Piece]] = {}
    offsets: dict[tuple[int, int], int] = {}
    for g, layout in enumerate(generator_layouts):
        if layout["dtype"] not in DTYPES:
            raise ValueError(f"{label}: generator rank {g} has unsupported dtype {layout['dtype']!r}")
        for p in layout["params"]:
            gbox = _check_generator_param(label, g, p, trainer)
            for tbox, owners in sorted(holders[p["name"]].items()):
                block = intersect(tbox, gbox)
                if block is None:
                    continue
                pair = (owners[g % len(owners)], g)
                piece = Piece(p["name"], shift(block, tbox), shift(block, gbox), offsets.get(pair, 0))
                pieces.setdefault(pair, []).append(piece)
                offsets[pair] = piece.offset + piece.numel
    return DdmaPlan(pieces=pieces, dtypes=[layout["dtype"] for layout in generator_layouts])
