"""Hugging Face export of the trained policy: a directory ``from_pretrained`` (and vLLM) loads as-is.

Written by one rank, shard by shard: parameters are gathered one at a time (``full_tensor`` over
the FSDP2 mesh, so each rank holds at most one full parameter beyond its shards); only the writer
keeps them, until a shard of ``max_shard_bytes`` is full and written. No rank ever holds the full
model. The shard plan (which parameter goes to which file) is computed up front from the global
shapes, which every rank knows, so file names follow the HF convention
(``model-00001-of-00003.safetensors`` + ``model.safetensors.index.json``; a single
``model.safetensors`` when it fits one shard). The directory appears atomically (written as
``<dir>.partial`` and renamed), with ``config.json`` and the tokenizer files beside the weights.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch.distributed.tensor import DTensor


def _shard_plan(sizes: list[tuple[str, int]], max_shard_bytes: int) -> list[list[str]]:
    shards: list[list[str]] = [[]]
    size = 0
    for name, nbytes in sizes:
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    return shards


def _full(param: torch.Tensor) -> torch.Tensor:
    return (param.full_tensor() if isinstance(param, DTensor) else param).detach()


@torch.no_grad()
def export_hf(directory: Path, *, model: torch.nn.Module, tokenizer=None, writer: bool,
              max_shard_bytes: int = 2 << 30) -> None:
    """Write ``model`` (HF names, its own dtype) as an HF directory at ``directory``.

    Contract: collective over the model's FSDP2 mesh (every rank holding a shard calls it, with
    ``writer`` True on exactly one of them); the writer creates ``directory`` (replacing an older
    one) with the weights, ``config.json``, ``generation_config.json`` and, when given, the tokenizer.
    """
    params = dict(model.named_parameters())
    sizes = [(name, p.numel() * p.element_size()) for name, p in params.items()]
    write_hf_tensors(directory, model=model, sizes=sizes, tensors=((n, _full(p)) for n, p in params.items()),
                     dtype=next(iter(params.values())).dtype, tokenizer=tokenizer, writer=writer,
                     max_shard_bytes=max_shard_bytes)


@torch.no_grad()
def write_hf_tensors(directory: Path, *, model: torch.nn.Module, sizes: list[tuple[str, int]], tensors,
                     dtype: torch.dtype, tokenizer=None, writer: bool, max_shard_bytes: int = 2 << 30) -> None:
    """``export_hf`` for any stream of whole tensors: ``sizes`` lists ``(name, bytes)`` in the order
    ``tensors`` yields ``(name, full tensor)`` (every rank must consume it: the tensors may be
    gathered collectively); ``model`` gives the config and generation config, ``dtype`` the config's
    ``dtype``. The merged export of LoRA adapters writes through it."""
    plan = _shard_plan(sizes, max_shard_bytes)
    partial = directory.with_name(directory.name + ".partial")
    if writer:
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)
    weight_map = {}
    stream = iter(tensors)
    for index, names in enumerate(plan):
        filename = "model.safetensors" if len(plan) == 1 else f"model-{index + 1:05d}-of-{len(plan):05d}.safetensors"
        shard = {}
        for name in names:
            got, full = next(stream)
            assert got == name, f"export stream out of order: {got!r} where {name!r} was planned"
            if writer:
                shard[name] = full.to("cpu").contiguous()
                weight_map[name] = filename
            del full
        if writer:
            save_file(shard, str(partial / filename), metadata={"format": "pt"})
        del shard
    if not writer:
        return
    if len(plan) > 1:
        total = sum(nbytes for _, nbytes in sizes)
        (partial / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    config = model.config
    config.dtype = dtype  # transformers 5's name (``torch_dtype`` is deprecated: a warning per export)
    config.to_json_file(str(partial / "config.json"))
    # The generation config carries every end-of-turn id (Qwen2.5, Llama-3 list several): without
    # it a reloaded export would stop only at the tokenizer's EOS.
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.save_pretrained(str(partial))
    if tokenizer is not None:
        tokenizer.save_pretrained(str(partial))
    shutil.rmtree(directory, ignore_errors=True)
    partial.rename(directory)
