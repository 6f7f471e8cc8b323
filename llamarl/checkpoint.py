"""Checkpoints: DCP for sharded trainer state, JSON + safetensors for everything else, HF export.

Nothing here unpickles: DCP stores tensors in its own format, small state goes to JSON, RNG
states to safetensors. Layout of one executor's checkpoint directory:

- trainer: ``dcp/`` (model + AdamW, sharded, written by every trainer rank),
  ``state.json`` (version), ``hf/`` (a safetensors + config.json export of the policy, loadable
  with ``from_pretrained``);
- generator: ``state.json`` per generator rank (data position, weight version, carried-over
  samples, unfinished groups) and ``rng_rank<k>.safetensors``.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file, save_file
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from llamarl.channels.weights import full_named_parameters


def save_sharded(directory: Path, *, model: torch.nn.Module, optimizer: torch.optim.Optimizer, group) -> None:
    """Write the FSDP2 model and optimizer state with DCP (collective over ``group``)."""
    state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optimizer)}
    dcp.save(state, checkpoint_id=str(directory / "dcp"), process_group=group)


def load_sharded(directory: Path, *, model: torch.nn.Module, optimizer: torch.optim.Optimizer, group) -> None:
    """Inverse of ``save_sharded``; the trainer may use a different number of ranks than at save."""
    path = directory / "dcp"
    if not (path / ".metadata").is_file():
        raise ValueError(f"no DCP checkpoint at {path}")
    state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optimizer)}
    dcp.load(state, checkpoint_id=str(path), process_group=group)
    set_model_state_dict(model, state["model"], options=StateDictOptions(strict=True))
    set_optimizer_state_dict(model, optimizer, state["optim"])


def export_hf(directory: Path, *, model: torch.nn.Module, write: bool) -> None:
    """Export the full policy as an HF safetensors directory (all-gather; ``write`` on one rank)."""
    params = full_named_parameters(model)  # collective: every trainer rank must call it
    if write:
        directory.mkdir(parents=True, exist_ok=True)
        save_file({k: v.contiguous().cpu() for k, v in params.items()}, str(directory / "model.safetensors"),
                  metadata={"format": "pt"})
        model.config.to_json_file(str(directory / "config.json"))


def write_json(path: Path, value: dict) -> None:
    """Atomically write JSON (temp file + rename) so a killed run never leaves half a file."""
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(value))
    tmp.replace(path)


def read_json(path: Path) -> dict:
    """Read a JSON checkpoint file; a missing or corrupt file is a one-line ValueError."""
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"cannot read checkpoint file {path}: {exc}") from None


def save_rng(path: Path, generator: torch.Generator) -> None:
    save_file({"state": generator.get_state()}, str(path))


def load_rng(path: Path, generator: torch.Generator) -> None:
    generator.set_state(load_file(str(path))["state"])
