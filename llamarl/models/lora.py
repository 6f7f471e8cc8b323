"""LoRA adapters on a (possibly FSDP2-sharded) HF causal LM, injected with ``peft``.

``LoraSpec`` is what the trainer, the generator and the exporter share: rank r, alpha (the update
is ``(alpha / r) B A``), the target modules and dropout. On the trainer (``inject``) peft's
``inject_adapter_in_model`` replaces each target ``nn.Linear`` by a LoRA layer in place, so the
HF module tree (``model.layers``) that FSDP2 sharding, micro-batched log-probs and every model
family rely on is unchanged; only the names of the adapted weights gain ``.base_layer`` (their
checkpoint names are ``checkpoint_name``'s). The base is frozen; the adapters are the only
parameters with gradients, optimizer state and checkpoints.

Names on the wire (``adapter_parameters``): ``<module>.lora_A.weight`` [r, in] and
``<module>.lora_B.weight`` [out, r], peft's saved-adapter names without its ``base_model.model.``
prefix, so a generator (``models/lora_merge.py``), a checkpoint and an export agree on them.

Initialisation (``initialise``) is peft's (A: Kaiming-uniform with a = sqrt(5), B: zero, so the
adapted model starts as the base) but drawn from a generator seeded per adapter on the whole
tensor, and each rank keeps its own rows: the same adapters on any number of ranks, as a
resharded resume needs.
"""

from __future__ import annotations

import contextlib
import math
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from torch.distributed.tensor import DTensor

from llamarl.models.lora_forward import use_merged_forward
from llamarl.runtime.boxes import dtensor_box, local_tensor

__all__ = ["AdapterView", "LoraSpec", "adapter_parameters", "adapters_disabled", "merged_named_parameters"]

_ADAPTER = re.compile(r"\.(lora_[AB])\.[^.]+\.weight$")


@dataclass(frozen=True)
class LoraSpec:
    """The adapters of one run: ``rank`` r, ``alpha`` (scale alpha / r), ``targets`` (comma-separated
    module-name suffixes, or ``all-linear``: every ``nn.Linear`` inside the decoder layers), the
    training ``dropout``, and ``merged_forward``: the trainer computes each adapted linear with the
    merged weight the generator samples from (``models/lora_forward.py``) rather than peft's
    unmerged sum."""

    rank: int
    alpha: float
    targets: str = "all-linear"
    dropout: float = 0.0
    merged_forward: bool = True

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    def target_modules(self, model: torch.nn.Module) -> list[str]:
        """The full names of the modules to adapt, in module order. ValueError (one line, naming
        ``--trainer.lora.targets``) when a requested suffix matches no linear of the decoder layers;
        embeddings and the LM head are never candidates."""
        linears = [name for name, module in model.named_modules()
                   if isinstance(module, torch.nn.Linear) and ".layers." in f".{name}"]
        if self.targets.strip() == "all-linear":
            chosen = linears
        else:
            wanted = [t.strip() for t in self.targets.split(",")]
            chosen = [name for name in linears if any(name == w or name.endswith("." + w) for w in wanted)]
            unmatched = [w for w in wanted if not any(n == w or n.endswith("." + w) for n in linears)]
            if unmatched:
                known = sorted({name.rsplit(".", 1)[-1] for name in linears})
                raise ValueError(f"--trainer.lora.targets: {unmatched[0]!r} matches no linear layer of the decoder "
                                 f"layers of {type(model).__name__}; its linears are {known}")
        if not chosen:
            raise ValueError(f"--trainer.lora.targets {self.targets!r}: {type(model).__name__} has no linear layer "
                             "inside its decoder layers to adapt")
        return chosen

    def peft_config(self, model: torch.nn.Module):
        """peft's ``LoraConfig`` for ``model`` (explicit module names: the export's
        ``adapter_config.json`` then loads onto the same architecture with ``PeftModel``)."""
        from peft import LoraConfig

        return LoraConfig(r=self.rank, lora_alpha=self.alpha, target_modules=self.target_modules(model),
                          lora_dropout=self.dropout, bias="none")

    def inject(self, model: torch.nn.Module) -> torch.nn.Module:
        """Adapt ``model`` in place (meta or real parameters): every target linear becomes a peft
        LoRA layer; ``requires_grad`` is True on the adapters and False everywhere else."""
        from peft import inject_adapter_in_model

        inject_adapter_in_model(self.peft_config(model), model)
        for name, param in model.named_parameters():
            param.requires_grad_(_ADAPTER.search(name) is not None)
        if self.merged_forward:
            use_merged_forward(model)
        return model

    @torch.no_grad()
    def initialise(self, model: torch.nn.Module, *, seed: int) -> None:
        """peft's initial adapters, the same on any number of ranks (module docstring): A drawn
        whole from a generator seeded by ``seed`` and the adapter's index, each rank copying its
        rows; B zero."""
        index = 0
        for name, param in model.named_parameters():
            match = _ADAPTER.search(name)
            if match is None:
                continue
            local = local_tensor(param)
            if match.group(1) == "lora_B":
                local.zero_()
                continue
            full = torch.empty(tuple(param.shape), dtype=torch.float32)
            generator = torch.Generator().manual_seed(seed * 1_000_003 + index)
            index += 1
            bound = 1.0 / math.sqrt(full.shape[1])  # kaiming_uniform_(a=sqrt(5)): gain sqrt(1/3) * sqrt(3 / fan_in)
            full.uniform_(-bound, bound, generator=generator)
            if isinstance(param, DTensor):
                box = dtensor_box(name, param)
                full = full[tuple(slice(start, start + length) for start, length in box)]
            local.copy_(full.to(local.dtype))


def checkpoint_name(name: str) -> str | None:
    """The HF checkpoint tensor an adapted model's parameter loads from: the base weight of an
    adapted linear drops ``.base_layer``; an adapter (not in any HF checkpoint) is None."""
    if _ADAPTER.search(name):
        return None
    return name.replace(".base_layer.", ".")


def wire_name(name: str) -> str:
    """``...q_proj.lora_A.default.weight`` -> ``...q_proj.lora_A.weight`` (module docstring)."""
    return _ADAPTER.sub(lambda m: f".{m.group(1)}.weight", name)


def adapter_parameters(model: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    """``{wire name: parameter}`` of every adapter of an injected model, in ``named_parameters()``
    order (DTensors stay sharded)."""
    return {wire_name(name): param for name, param in model.named_parameters() if _ADAPTER.search(name)}


class AdapterView(torch.nn.Module):
    """A module whose ``named_parameters()`` are just the adapters of ``model`` under their wire
    names: what a weights channel (which moves ``get_model().named_parameters()``) sends under
    LoRA, read fresh from ``model`` on every call (FSDP2 may swap parameter objects between
    forward and backward). ``tensors``: a fixed ``{name: tensor}`` instead of a model (the
    generator's receive buffers)."""

    def __init__(self, model: torch.nn.Module | None = None, *,
                 tensors: dict[str, torch.Tensor] | None = None) -> None:
        super().__init__()
        if (model is None) == (tensors is None):
            raise ValueError("AdapterView takes a model or a dict of tensors")
        object.__setattr__(self, "_source", model)  # not a submodule: its parameters are not ours
        object.__setattr__(self, "_tensors", tensors)

    def named_parameters(self, prefix: str = "", recurse: bool = True,
                         remove_duplicate: bool = True) -> Iterator[tuple[str, torch.nn.Parameter]]:
        items = self._tensors if self._tensors is not None else adapter_parameters(self._source)
        for name, tensor in items.items():
            yield (f"{prefix}.{name}" if prefix else name), tensor


@contextlib.contextmanager
def adapters_disabled(model: torch.nn.Module):
    """Forwards of ``model`` inside are the base model's (every peft layer's adapters off): the
    reference policy under LoRA, with no second model."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    layers = [m for m in model.modules() if isinstance(m, BaseTunerLayer)]
    for layer in layers:
        layer.enable_adapters(False)
    try:
        yield model
    finally:
        for layer in layers:
            layer.enable_adapters(True)  # also marks the adapters trainable again, as they were


@torch.no_grad()
def merged_named_parameters(model: torch.nn.Module, spec: LoraSpec, *, base: Callable[[str], torch.Tensor] | None = None,
                            dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """``(HF name, full tensor)`` of the merged model ``W = W_base + (alpha / r) B A`` (merged in
    fp32), every other parameter as it is, in ``dtype`` (None: the adapters'); one parameter gathered at a time
    (collective over an FSDP2 mesh: every rank must consume the whole iterator). ``base(name)``:
    the base tensor as the checkpoint stores it (the frozen copy in ``model`` may be rounded to
    ``--trainer.param-dtype``, the generator's is not); None: ``model``'s own. The merged export."""
    params = dict(model.named_parameters())
    dtype = dtype or next((p.dtype for p in params.values() if p.requires_grad), None)

    def full(name: str) -> torch.Tensor:
        param = params[name]
        return (param.full_tensor() if isinstance(param, DTensor) else param).detach()

    def frozen(name: str) -> torch.Tensor:
        return (full(name) if base is None else base(checkpoint_name(name))).to(dtype or params[name].dtype)

    for name in params:
        if _ADAPTER.search(name):
            continue
        if not name.endswith(".base_layer.weight"):  # not adapted, or an adapted linear's bias
            yield checkpoint_name(name), frozen(name)
            continue
        module = name.removesuffix(".base_layer.weight")
        weight = frozen(name)
        a = full(next(n for n in params if n.startswith(module + ".lora_A.")))
        b = full(next(n for n in params if n.startswith(module + ".lora_B.")))
        yield checkpoint_name(name), torch.addmm(weight.float(), b.float(), a.float(), alpha=spec.scale).to(weight.dtype)
