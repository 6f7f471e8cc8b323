"""Sharded trainer state (model + optimizer) as per-rank safetensors and a JSON index: no pickle.

Why not DCP's default format: its ``.metadata`` file is read with ``pickle.load``, so resuming from
a checkpoint someone else wrote could run their code. Here every file is either safetensors (a
JSON header and raw bytes) or JSON.

Layout of ``<dir>``:

- ``rank<r>.safetensors``: rank r's local pieces of every state tensor, under flat keys
  ``model/<fqn>`` and ``optim/<fqn>/<name>`` (AdamW's ``exp_avg``, ``exp_avg_sq``, ``step``);
- ``rank<r>.json``: for each key, the global shape and the box (offset, length per dim) rank r holds;
- ``optim_param_groups.json`` (rank 0): the optimizer's hyper-parameters per group.
- ``meta.json`` (rank 0): the number of ranks that wrote, so a missing file is detected, and whether
  the optimizer had any state (``optimizer_state``).

A model with frozen parameters (LoRA's base) saves only those that train (and their optimizer
state): the rest is the model it was loaded from, reloaded at start-up.

Tied parameters (SmolLM2, Qwen2/3, Gemma: ``lm_head.weight`` is ``model.embed_tokens.weight``) are
one tensor under two keys: it is saved once, under the first key, and the index records the other
key as ``{"alias_of": <first key>}``; on load the alias is filled by the same tensor (a model that
ties reads nothing twice; one that does not tie copies the saved tensor into both).

An optimizer that has not stepped yet (a checkpoint before the first update, or after ticks without
signal) has no state, and is saved without any: ``get_optimizer_state_dict`` would initialise AdamW
state in the live optimizer (``step = 1``, zero moments), which shrinks the first real update (the
bias correction of step 2 instead of step 1) and makes a run with checkpoints train differently
from the same run without them.

Loading reads every rank's index and assembles each key's local box on this rank from the
intersecting pieces of the saved boxes (``safe_open(...).get_slice``, reading only those bytes), so a
checkpoint written by T trainer ranks loads onto any other number of ranks (FSDP2 ``Shard(0)`` or
replicated tensors). A missing, truncated or corrupt file, or a key whose box is not fully covered,
is a one-line ValueError naming the file or key.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor

from llamarl.runtime.boxes import BoxLike, dtensor_box, intersect
from llamarl.runtime.checkpoint_files import written


def _flatten(model: torch.nn.Module, optimizer: torch.optim.Optimizer, *,
             with_optimizer: bool) -> tuple[dict, list[dict]]:
    """``{key: tensor}`` of the whole state (DTensors stay sharded) and the param groups; without
    ``with_optimizer`` only the model's entries (and no param groups)."""
    trained = _trained_names(model)
    flat = {f"model/{fqn}": t for fqn, t in get_model_state_dict(model).items() if trained is None or fqn in trained}
    if not with_optimizer:
        return flat, []
    optim = get_optimizer_state_dict(model, optimizer)  # initialises AdamW state if no step ran yet
    for fqn, entries in optim["state"].items():
        for name, value in entries.items():
            if not isinstance(value, torch.Tensor):
                raise TypeError(f"optimizer state {fqn}/{name} is a {type(value).__name__}, not a tensor")
            flat[f"optim/{fqn}/{name}"] = value
    return flat, optim["param_groups"]


def _trained_names(model: torch.nn.Module) -> set[str] | None:
    """The parameters a checkpoint holds when some are frozen (LoRA: the adapters; the base is
    reloaded from the model it came from), else None (every parameter)."""
    params = list(model.named_parameters())
    if all(p.requires_grad for _, p in params):
        return None
    return {name for name, p in params if p.requires_grad}


def _local(key: str, tensor: torch.Tensor) -> tuple[torch.Tensor, BoxLike]:
    if isinstance(tensor, DTensor):
        return tensor.to_local(), dtensor_box(key, tensor)
    return tensor, [[0, int(s)] for s in tensor.shape]


def _aliases(flat: dict[str, torch.Tensor]) -> dict[str, str]:
    """``{alias key: first key}`` for entries that are the same tensor (tied parameters).

    The same object, or a local shard with the same storage, offset, shape and strides: FSDP2 keeps
    one sharded parameter for a tied pair, so either test finds it on every rank alike."""
    first: dict[object, str] = {}
    aliases = {}
    for key, tensor in flat.items():
        local, _ = _local(key, tensor)
        identities = [("id", id(tensor))]
        if local.numel() > 0:
            identities.append(("storage", local.untyped_storage().data_ptr(), local.storage_offset(),
                               tuple(local.shape), tuple(local.stride())))
        owner = next((first[i] for i in identities if i in first), None)
        if owner is not None:
            aliases[key] = owner
        else:
            for identity in identities:
                first[identity] = key
    return aliases


def optimizer_has_state(optimizer: torch.optim.Optimizer) -> bool:
    """Whether the optimizer has stepped (AdamW creates its state lazily at the first step)."""
    return any(len(entries) > 0 for entries in optimizer.state.values())


def save_sharded_state(directory: Path, *, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                       rank: int, world_size: int) -> None:
    """Write this rank's pieces (every rank of the trainer calls it; no collective of its own
    beyond what ``get_*_state_dict`` needs, which is collective over the FSDP mesh)."""
    directory.mkdir(parents=True, exist_ok=True)
    with_optimizer = optimizer_has_state(optimizer)
    flat, groups = _flatten(model, optimizer, with_optimizer=with_optimizer)
    aliases = _aliases(flat)
    tensors, index = {}, {}
    for key, tensor in flat.items():
        if key in aliases:
            index[key] = {"alias_of": aliases[key]}
            continue
        local, box = _local(key, tensor)
        tensors[key] = local.detach().to("cpu").contiguous()
        index[key] = {"shape": [int(s) for s in tensor.shape], "box": box}
    save_file(tensors, str(directory / f"rank{rank}.safetensors"))
    written(directory / f"rank{rank}.safetensors")  # its digest, for COMPLETE.json (llamarl/runtime/checkpoint_files.py)
    (directory / f"rank{rank}.json").write_text(json.dumps(index))
    written(directory / f"rank{rank}.json")
    if rank == 0:
        (directory / "optim_param_groups.json").write_text(json.dumps(groups))
        (directory / "meta.json").write_text(json.dumps({"format": 1, "num_ranks": world_size,
                                                         "optimizer_state": with_optimizer}))
        written(directory / "optim_param_groups.json")
        written(directory / "meta.json")


def _read_json(path: Path):
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"cannot read checkpoint file {path}: {exc}") from None


def load_sharded_state(directory: Path, *, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Restore what ``save_sharded_state`` wrote, onto this rank's current sharding (any size)."""
    meta = _read_json(directory / "meta.json")
    num_ranks = int(meta.get("num_ranks", 0))
    indexes = [_read_json(directory / f"rank{r}.json") for r in range(num_ranks)]
    files = [directory / f"rank{r}.safetensors" for r in range(num_ranks)]
    # Checkpoints from before the flag always had optimizer state (it was initialised on save).
    with_optimizer = bool(meta.get("optimizer_state", True))
    flat, _ = _flatten(model, optimizer, with_optimizer=with_optimizer)
    target_aliases = _aliases(flat)
    handles: dict[int, object] = {}

    def source(r: int):
        if r not in handles:
            try:
                handles[r] = safe_open(str(files[r]), "pt")
            except (OSError, SafetensorError) as exc:
                raise ValueError(f"cannot read checkpoint file {files[r]}: {exc}") from None
        return handles[r]

    for key, target in flat.items():
        if key in target_aliases:
            continue  # the same tensor as its first key, which is filled below
        local, box = _local(key, target)
        entries = [idx.get(key) for idx in indexes]
        stored = key
        for entry in entries:
            if entry is not None and "alias_of" in entry:
                stored = str(entry["alias_of"])  # tied when saved: the bytes are under the first key
        saved = [(r, idx[stored]) for r, idx in enumerate(indexes) if stored in idx and "box" in idx[stored]]
        if not saved:
            raise ValueError(f"checkpoint {directory} has no entry {key!r} (another model or optimizer?)")
        if saved[0][1]["shape"] != [int(s) for s in target.shape]:
            raise ValueError(f"checkpoint {directory}: {key!r} has shape {saved[0][1]['shape']}, "
                             f"the model has {list(target.shape)}")
        covered, volume = 0, math.prod(length for _, length in box)
        for r, entry in saved:
            if covered == volume:
                break
            part = intersect(box, entry["box"]) if box else []
            if part is None:
                continue
            try:
                if not box:  # a 0-d tensor (AdamW's step): read whole
                    piece = source(r).get_tensor(stored)
                else:
                    piece = source(r).get_slice(stored)[tuple(slice(o - so, o - so + n)
                                                           for (o, n), (so, _) in zip(part, entry["box"]))]
            except (SafetensorError, ValueError, RuntimeError) as exc:
                raise ValueError(f"cannot read {key!r} from checkpoint file {files[r]}: {exc}") from None
            destination = local[tuple(slice(o - to, o - to + n) for (o, n), (to, _) in zip(part, box))]
            with torch.no_grad():
                destination.copy_(piece.to(device=destination.device, dtype=destination.dtype))
            covered += math.prod(n for _, n in part)
            if all(o == to and n == tn for (o, n), (to, tn) in zip(part, box)):
                covered = volume  # a replicated piece covers the whole box at once
        if covered != volume:
            raise ValueError(f"checkpoint {directory}: {key!r} is only partly saved (a rank's file is missing "
                             f"or truncated)")
    model_state = {k.removeprefix("model/"): v for k, v in flat.items() if k.startswith("model/")}
    # Frozen parameters are not in the checkpoint (they are the loaded model's); every trained one
    # was read above or raised.
    options = StateDictOptions(strict=_trained_names(model) is None)
    if not with_optimizer:
        set_model_state_dict(model, model_state, options=options)
        return
    groups = _read_json(directory / "optim_param_groups.json")
    optim_state: dict[str, dict] = {}
    for key, value in flat.items():
        if key.startswith("optim/"):
            fqn, name = key.removeprefix("optim/").rsplit("/", 1)
            optim_state.setdefault(fqn, {})[name] = value
    set_model_state_dict(model, model_state, options=options)
    set_optimizer_state_dict(model, optimizer, {"state": optim_state, "param_groups": groups})
