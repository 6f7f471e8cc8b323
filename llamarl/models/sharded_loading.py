"""Load an HF causal LM straight into FSDP2 shards: no rank ever holds the full model.

``load_causal_lm`` + ``shard_model`` materialise every weight on every trainer rank before FSDP2
keeps a 1/N shard of it: 8 ranks x a 7B model in fp32 is 224 GB of host memory on one node, for a
moment. ``load_sharded_causal_lm`` builds the model on the meta device (parameters without storage;
buffers such as RoPE's ``inv_freq`` computed for real on the host), applies the same
``shard_model``, allocates only this rank's shards on its device (``to_empty``), puts the buffers
back, and fills each shard from the checkpoint's safetensors files reading only its own rows
(``safe_open(...).get_slice(name)[start:stop]``, FSDP2's ``Shard(0)`` rows by torch.chunk's rule),
cast to the model's dtype. A rank's peak is its shards plus one parameter's rows, not the model.
torchtitan and verl's FSDP2 workers initialise on the meta device the same way.

Where it does not apply it falls back to the full load with a warning saying why: a checkpoint that
is not a local (or already cached hub) safetensors directory, or one whose tensor names are not the
model's parameter names (transformers renames some legacy checkpoints' keys while loading; the full
path does that). A tied model loads its one shared tensor once (the embedding's name).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
from safetensors import safe_open
from torch.distributed.tensor import DTensor, Shard
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from llamarl.models.colocated_memory import EngineFootprint
from llamarl.models.loading import load_causal_lm, resolve_source
from llamarl.models.lora import LoraSpec, checkpoint_name
from llamarl.models.memory import activation_checkpointing_for
from llamarl.models.sharding import shard_model
from llamarl.runtime.boxes import chunk_slice

logger = logging.getLogger(__name__)

__all__ = ["load_sharded_causal_lm"]


def checkpoint_files(directory: Path) -> dict[str, Path] | None:
    """Tensor name -> the safetensors file holding it, or None when the directory has none."""
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: directory / file for name, file in weight_map.items()}
    single = directory / "model.safetensors"
    if not single.is_file():
        return None
    with safe_open(str(single), "pt") as handle:
        return dict.fromkeys(handle.keys(), single)


def _local_rows(param: DTensor) -> tuple[int, int]:
    """(start, stop) of the global rows this rank's ``Shard(0)`` local tensor holds."""
    (placement,) = param.placements
    assert isinstance(placement, Shard) and placement.dim == 0, placement
    mesh = param.device_mesh
    start, length = chunk_slice(param.shape[0], rank=mesh.get_local_rank(), world=mesh.size())
    return start, start + length


def _adapt(model: torch.nn.Module, lora: LoraSpec | None, *, frozen_dtype: torch.dtype | None) -> None:
    """Inject ``lora``'s adapters (``models/lora.py``), their masters in fp32 whatever ``--model.dtype``,
    and store the frozen base in ``frozen_dtype`` (meta or real parameters; before sharding, so
    FSDP2 shards what training keeps)."""
    if lora is None:
        return
    lora.inject(model)
    for param in model.parameters():
        if param.requires_grad:  # the adapters: fp32 masters (and so fp32 gradients and AdamW state)
            param.data = param.data.to(torch.float32)
        elif frozen_dtype is not None and param.dtype != frozen_dtype:
            param.data = param.data.to(frozen_dtype)


def load_sharded_causal_lm(name_or_path: str, *, dtype: torch.dtype, mesh, device: torch.device,
                           param_dtype: torch.dtype | None = None, lora: LoraSpec | None = None,
                           seed: int = 0, activation_checkpointing: str = "off", microbatch_tokens: int = 0,
                           engine_state: EngineFootprint | None = None, compile_backend: str | None = None):
    """``(model, tokenizer)``: the causal LM at ``name_or_path`` (``load_causal_lm``'s resolution)
    FSDP2-sharded over ``mesh`` by ``shard_model(..., param_dtype=)``, master weights in ``dtype``
    on ``device`` (this rank's ``ctx.device``), loaded shard by shard (module docstring); in train
    mode is left to the caller (returned in eval mode, like ``load_causal_lm``). Collective-free:
    every rank reads only its own rows.

    With ``lora`` the adapters are injected before sharding: the base (frozen, stored in
    ``param_dtype``) loads from the checkpoint under its HF names, the adapters (fp32 masters)
    start as ``LoraSpec.initialise`` draws them from ``seed``.

    ``activation_checkpointing`` (``--trainer.activation-checkpointing``: on / off / auto, auto
    resolved by ``models/memory.py`` for micro-batches of ``microbatch_tokens``) recomputes each
    decoder layer in the backward; ``auto`` also counts ``engine_state``, what a colocated engine
    keeps on the device while the trainer runs (``colocated_memory.EngineFootprint``; None: nothing). ``compile_backend``
    (``--trainer.compile layers``): each decoder layer compiled with it (``sharding.compile_layers``)."""
    checkpointing = {"activation_checkpointing": activation_checkpointing, "microbatch_tokens": microbatch_tokens,
                     "engine_state": engine_state, "compile_backend": compile_backend}
    source = resolve_source(name_or_path)
    directory = Path(source) if Path(source).is_dir() else _cached_snapshot(source)
    files = checkpoint_files(directory) if directory is not None else None
    if files is None:
        return _full_load(name_or_path, dtype=dtype, mesh=mesh, device=device, param_dtype=param_dtype,
                          lora=lora, seed=seed, why="no local safetensors checkpoint", **checkpointing)
    config = AutoConfig.from_pretrained(str(directory))
    # Parameters on meta, buffers (RoPE inv_freq) for real on the host.
    from accelerate import init_empty_weights

    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    # Parameters made on the meta device are not tied yet; tie them as from_pretrained does.
    model.tie_weights()
    names = [checkpoint_name(name) for name, _ in model.named_parameters()]
    missing = [name for name in names if name not in files]
    if missing:
        return _full_load(name_or_path, dtype=dtype, mesh=mesh, device=device, param_dtype=param_dtype,
                          lora=lora, seed=seed, **checkpointing,
                          why=f"the checkpoint has no tensor {missing[0]!r} (names differ from the model's)")
    _adapt(model, lora, frozen_dtype=param_dtype)
    buffers = {name: buf.detach().clone() for name, buf in model.named_buffers()}
    model = shard_model(model, mesh, param_dtype=param_dtype, compile_backend=compile_backend,
                        activation_checkpointing=_checkpointing(model, device=device, mesh=mesh, param_dtype=param_dtype,
                                                                **checkpointing))
    model.to_empty(device=device)
    handles: dict[Path, object] = {}
    try:
        with torch.no_grad():
            # Tied weights are one parameter (listed once, under the embedding's name).
            for name, buf in buffers.items():
                model.get_buffer(name).copy_(buf)
            for name, param in model.named_parameters():
                stored = checkpoint_name(name)
                if stored is None:  # an adapter: initialised below
                    continue
                path = files[stored]
                if path not in handles:
                    handles[path] = safe_open(str(path), "pt")
                rows = handles[path].get_slice(stored)
                local = param.to_local() if isinstance(param, DTensor) else param
                if isinstance(param, DTensor):
                    start, stop = _local_rows(param)
                    if stop > start:
                        local.copy_(rows[start:stop].to(local.dtype))
                else:
                    local.copy_(rows[:].to(local.dtype))
            if lora is not None:
                lora.initialise(model, seed=seed)
    finally:
        handles.clear()
    tokenizer = AutoTokenizer.from_pretrained(str(directory))
    if tokenizer.pad_token is None and tokenizer.eos_token is not None:
        tokenizer.pad_token = tokenizer.eos_token
    return model.eval(), tokenizer


def _cached_snapshot(repo_id: str) -> Path | None:
    """A hub id's local snapshot directory when its files are already cached, else None."""
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(repo_id, allow_patterns=["*.json", "*.safetensors", "*.model", "*.txt"],
                                      local_files_only=True))
    except (ImportError, OSError, ValueError):  # not cached: the full load says what is wrong
        return None


def _checkpointing(model, *, device, mesh, param_dtype, activation_checkpointing: str, microbatch_tokens: int,
                   engine_state: EngineFootprint | None = None, compile_backend: str | None = None) -> bool:
    """Whether to checkpoint each decoder layer (``auto`` counted on ``model`` as it will train)."""
    return activation_checkpointing_for(activation_checkpointing, model=model, device=device,
                                        microbatch_tokens=microbatch_tokens, world_size=mesh.size(),
                                        param_dtype=param_dtype,
                                        resident_bytes=engine_state.bytes(model.config) if engine_state else 0)


def _full_load(name_or_path: str, *, dtype, mesh, device, param_dtype, why: str, lora: LoraSpec | None = None,
               seed: int = 0, activation_checkpointing: str = "off", microbatch_tokens: int = 0,
               engine_state: EngineFootprint | None = None, compile_backend: str | None = None):
    logger.warning("loading %s whole on every trainer rank before sharding: %s", name_or_path, why)
    model, tokenizer = load_causal_lm(name_or_path, dtype=dtype, device="cpu")
    _adapt(model, lora, frozen_dtype=param_dtype)
    if lora is not None:
        lora.initialise(model, seed=seed)  # the same adapters as the sharded path draws
    on = _checkpointing(model, device=device, mesh=mesh, param_dtype=param_dtype,
                        activation_checkpointing=activation_checkpointing, microbatch_tokens=microbatch_tokens,
                        engine_state=engine_state)
    model = shard_model(model, mesh, param_dtype=param_dtype, activation_checkpointing=on,
                        compile_backend=compile_backend)
    return model, tokenizer
