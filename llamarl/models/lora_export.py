"""Export of a LoRA-trained policy: a PEFT adapter directory, and on request the merged model.

``<dir>/adapter_config.json`` + ``<dir>/adapter_model.safetensors`` are what ``peft`` saves
(``PeftModel.from_pretrained(base, dir)`` loads them; keys ``base_model.model.<module>.lora_A.weight``
and ``lora_B``), with the tokenizer beside them and ``base_model_name_or_path`` the base the run
loaded, so ``AutoPeftModelForCausalLM`` finds it. The adapters are gathered whole one at a time
(collective over the trainer's FSDP2 mesh), a few MB in all. With ``merged`` the merged model
``W = W_base + (alpha / r) B A`` (``lora.merged_named_parameters``) is written as an HF directory
in ``<dir>/merged`` by ``export.write_hf_tensors``, shard by shard as the full export is. Both
appear atomically (``<dir>.partial`` renamed).
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch.distributed.tensor import DTensor

from llamarl.models.export import write_hf_tensors
from llamarl.models.loading import resolve_source
from llamarl.models.lora import LoraSpec, adapter_parameters, checkpoint_name, merged_named_parameters

__all__ = ["export_adapter", "peft_key"]

logger = logging.getLogger(__name__)


def peft_key(wire_name: str) -> str:
    """The key peft saves an adapter under: ``base_model.model.`` + its wire name."""
    return f"base_model.model.{wire_name}"


def adapted_modules(model: torch.nn.Module) -> list[str]:
    """The full names of the modules ``model``'s adapters adapt, in order."""
    return list(dict.fromkeys(name.rsplit(".lora_", 1)[0] for name in adapter_parameters(model)))


def _base_reader(base: str, *, writer: bool):
    """``name -> tensor`` reading the base model's checkpoint (the values the generator loaded,
    before the trainer stored its frozen copy in ``--trainer.param-dtype``); None when it is not a
    local safetensors directory (the trainer's frozen copy is merged then, with a warning). Only
    the writer reads the bytes: another rank's merged tensors are discarded, so it gets uninitialised
    ones of the stored shape (read from the header)."""
    from llamarl.models.sharded_loading import checkpoint_files

    files = checkpoint_files(Path(resolve_source(base)))
    if files is None:
        logger.warning("merged export: %s is not a local safetensors directory; merging onto the trainer's "
                       "frozen copy of the base (in --trainer.param-dtype)", base)
        return None

    def read(name: str) -> torch.Tensor:
        with safe_open(str(files[name]), "pt") as handle:
            if writer:
                return handle.get_tensor(name)
            return torch.empty(handle.get_slice(name).get_shape())
    return read


@torch.no_grad()
def export_adapter(directory: Path, *, model: torch.nn.Module, spec: LoraSpec, base: str, tokenizer=None,
                   writer: bool, merged: bool = False, dtype: torch.dtype = torch.float32) -> None:
    """Write the adapters of ``model`` (an injected, possibly FSDP2-sharded model) as a PEFT
    directory at ``directory`` (module docstring), and with ``merged`` the merged model in
    ``directory / "merged"`` in ``dtype`` (``--model.dtype``). Collective over the FSDP2 mesh;
    ``writer`` True on exactly one rank."""
    from peft import LoraConfig

    partial = directory.with_name(directory.name + ".partial")
    tensors = {}
    for name, param in adapter_parameters(model).items():
        full = (param.full_tensor() if isinstance(param, DTensor) else param).detach()
        if writer:
            tensors[peft_key(name)] = full.to("cpu").contiguous()
    if writer:
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)
        save_file(tensors, str(partial / "adapter_model.safetensors"), metadata={"format": "pt"})
        config = LoraConfig(r=spec.rank, lora_alpha=spec.alpha, target_modules=adapted_modules(model),
                            lora_dropout=spec.dropout, bias="none", base_model_name_or_path=resolve_source(base),
                            task_type="CAUSAL_LM")
        config.save_pretrained(str(partial))
        if tokenizer is not None:
            tokenizer.save_pretrained(str(partial))
    if merged:
        params = dict(model.named_parameters())
        sizes = [(checkpoint_name(name), p.numel() * dtype.itemsize) for name, p in params.items()
                 if checkpoint_name(name) is not None]
        tensors = merged_named_parameters(model, spec, base=_base_reader(base, writer=writer), dtype=dtype)
        write_hf_tensors(partial / "merged", model=model, sizes=sizes, tensors=tensors, dtype=dtype,
                         tokenizer=tokenizer, writer=writer)
    if writer:
        shutil.rmtree(directory, ignore_errors=True)
        partial.rename(directory)
