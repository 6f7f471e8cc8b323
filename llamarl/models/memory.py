"""How many bytes a training forward keeps for its backward, counted without running it.

``saved_activation_bytes`` runs the model's forward and backward under ``FakeTensorMode`` (tensors
with shapes, dtypes and devices but no storage: a 1.5B model at 32,768 tokens costs nothing) with
``torch.autograd.graph.saved_tensors_hooks`` summing the bytes of every tensor autograd saves,
once per storage (a tensor saved by two ops, or a view of it, counts once), leaving out the
parameters and their views (they are not activations). Each saved tensor is attributed to the
decoder layer whose forward saved it, to several (``shared``: RoPE's cos / sin) or to none
(``other``: the embedding's ids, the final norm, the head). The forward is the trainer's: packed
rows behind a boolean 4D attention mask (``shared_prefix.py``), which sdpa turns into an additive
mask of the compute dtype in every layer, so a layer also keeps ``rows x W x W`` mask elements for
rows of ``W`` tokens. The attention kernel is the CPU one (FakeTensor cannot fake CUDA kernels
without CUDA); with a mask, HF's sdpa path saves the same tensors on CUDA (query, repeated keys and
values, output, log-sum-exp, the mask), up to CUDA's few bytes of RNG state.

With per-layer activation checkpointing (``sharding.checkpoint_layers``) a layer keeps only its
input through the forward and recomputes the rest in the backward, one layer at a time, so the
bytes kept are each layer's input plus ``shared`` and ``other``, and the backward's peak adds one
layer's activations (``ActivationCount.kept`` / ``peak``).

``resolve_activation_checkpointing`` is ``--trainer.activation-checkpointing``'s decision (``auto``:
on where a micro-batch's activations and the trainer's state would not fit the device), and
``activation_checkpointing_for`` makes it for a model about to be sharded; colocated, the state a
native engine keeps between its generations (``--generator.torch.no-sleep``: its KV cache and
graph pool, ``colocated_memory.engine_state_bytes``) is counted with it. A whole colocated rank by
the same counts (weights, gradients, AdamW, the engine's copy and state, logits chunk):
``colocated_memory.py``. Nothing here imports the config or an executor: plain arguments only.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch.autograd.graph import saved_tensors_hooks
from torch.func import functional_call
from torch.multiprocessing.reductions import StorageWeakRef

from llamarl.models.sharding import decoder_layers

logger = logging.getLogger(__name__)

__all__ = ["AUTO_DEVICE_FRACTION", "ActivationCount", "activation_checkpointing_for", "device_memory_bytes",
           "resolve_activation_checkpointing", "saved_activation_bytes", "trainer_state_bytes"]

AUTO_DEVICE_FRACTION = 0.75
"""``auto`` turns checkpointing on when the estimate passes this fraction of the device's memory: the
estimate leaves out the gathered FSDP2 layers, the log-probs' logits, the CUDA context, allocator
fragmentation and, colocated, the generator's copy of the weights and what a sleeping vLLM keeps,
which the rest is for."""


@dataclass(frozen=True)
class ActivationCount:
    """Bytes a forward of ``tokens`` tokens (``rows`` packed rows) keeps for its backward, by where."""

    tokens: int
    rows: int
    layers: tuple[int, ...]
    """Saved inside one decoder layer only, per layer (its activations, the attention mask's
    additive copy included)."""
    layer_inputs: tuple[int, ...]
    """Each layer's input hidden states: what a checkpointed layer keeps instead."""
    shared: int
    """Saved by more than one decoder layer (RoPE's cos / sin)."""
    other: int
    """Saved outside the decoder layers (embedding ids, final norm, the head)."""
    inputs: int
    """The forward's own inputs, alive throughout: ids, positions, the boolean 4D mask."""

    def kept(self, checkpointing: bool) -> int:
        """Bytes autograd holds once the forward has returned (what a backward needs)."""
        inside = sum(self.layer_inputs) if checkpointing else sum(self.layers)
        return inside + self.shared + self.other

    def peak(self, checkpointing: bool) -> int:
        """The backward's peak of activation bytes: what is kept, the inputs, and with
        checkpointing the recomputed activations of the largest layer (one at a time)."""
        recompute = max(self.layers, default=0) if checkpointing else 0
        return self.kept(checkpointing) + self.inputs + recompute

    def per_token_per_layer(self, checkpointing: bool = False) -> float:
        """Decoder-layer bytes per token per layer (without checkpointing it includes the mask's
        ``rows x W x W`` share, so it grows with the rows' width ``W``)."""
        inside = sum(self.layer_inputs) if checkpointing else sum(self.layers)
        return inside / max(1, self.tokens * len(self.layers))


def saved_activation_bytes(model: torch.nn.Module, *, tokens: int, row_tokens: int | None = None,
                           dtype: torch.dtype | None = None) -> ActivationCount:
    """Count what one training forward of ``model`` saves for its backward (module docstring).

    ``tokens`` are laid out as ``tokens // row_tokens`` packed rows of ``row_tokens`` (default: one
    row; ValueError unless it divides ``tokens``), each behind a causal boolean 4D mask, the way the
    trainer's shared-prefix forward calls the model (``logits_to_keep=1``: the head's logits are not
    counted here, the log-probs' chunks own them). ``model`` may be on the meta device or real; it
    is neither run nor changed: fake copies of its parameters (``dtype``, default their own; the
    ones that require grad still do) take their place. Forward and backward both run, fake.
    ValueError for a model whose layers are already checkpointed (count it before)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    row_tokens = row_tokens or tokens
    if tokens < 1 or tokens % row_tokens:
        raise ValueError(f"row_tokens ({row_tokens}) must divide tokens ({tokens})")
    rows = tokens // row_tokens
    layers = decoder_layers(model)
    if not layers:
        raise ValueError(f"{type(model).__name__} has no decoder layers (model.model.layers) to count")
    if any("forward" in vars(layer) for layer in layers):
        # A checkpointed layer's tensors go to the checkpoint's own hooks, not to ours.
        raise ValueError("count a model before checkpoint_layers: ActivationCount gives both cases")
    index = {id(layer): i for i, layer in enumerate(layers)}
    where: list[int] = []  # the stack of decoder layers running now (-1: outside every layer)
    saved: dict[StorageWeakRef, tuple[int, set[int]]] = {}
    keep: list[torch.Tensor] = []  # saved tensors stay referenced, so no storage id is reused
    layer_inputs = [0] * len(layers)

    def enter(module, args, kwargs):
        hidden = args[0] if args else kwargs["hidden_states"]
        layer_inputs[index[id(module)]] = hidden.numel() * hidden.element_size()
        where.append(index[id(module)])

    def leave(module, args, kwargs, output):
        where.pop()

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = StorageWeakRef(tensor.untyped_storage())
        if storage not in params:
            nbytes, regions = saved.get(storage, (tensor.untyped_storage().nbytes(), set()))
            saved[storage] = (nbytes, regions | {where[-1] if where else -1})
            keep.append(tensor)
        return tensor

    hooks = [h for layer in layers for h in (layer.register_forward_pre_hook(enter, with_kwargs=True),
                                             layer.register_forward_hook(leave, with_kwargs=True))]
    try:
        with FakeTensorMode():
            state = {name: torch.empty(p.shape, dtype=dtype or p.dtype).requires_grad_(p.requires_grad)
                     for name, p in model.named_parameters()}
            params = {StorageWeakRef(t.untyped_storage()) for t in state.values()}
            state |= {name: torch.empty(b.shape, dtype=b.dtype) for name, b in model.named_buffers()}
            ids = torch.zeros(rows, row_tokens, dtype=torch.long)
            positions = torch.arange(row_tokens).expand(rows, -1)
            mask = torch.ones(rows, 1, row_tokens, row_tokens, dtype=torch.bool).tril()
            with saved_tensors_hooks(pack, lambda tensor: tensor):
                out = functional_call(model, state, args=(), kwargs={
                    "input_ids": ids, "attention_mask": mask, "position_ids": positions, "use_cache": False,
                    "logits_to_keep": 1})
            if out.logits.requires_grad:
                out.logits.float().sum().backward()
            inputs = sum(t.numel() * t.element_size() for t in (ids, positions.contiguous(), mask))
    finally:
        for hook in hooks:
            hook.remove()
    per_layer = [0] * len(layers)
    shared = other = 0
    for nbytes, regions in saved.values():
        if regions == {-1}:
            other += nbytes
        elif len(regions) == 1:
            per_layer[next(iter(regions))] += nbytes
        else:
            shared += nbytes
    return ActivationCount(tokens=tokens, rows=rows, layers=tuple(per_layer), layer_inputs=tuple(layer_inputs),
                           shared=shared, other=other, inputs=inputs)


def trainer_state_bytes(model: torch.nn.Module, *, world_size: int = 1) -> int:
    """One trainer rank's parameters, gradients and AdamW moments: every parameter's 1/``world_size``
    share in its own dtype, and for those that require grad a gradient and two moments more of the
    same dtype (a frozen LoRA base has neither)."""
    total = 0
    for p in model.parameters():
        copies = 4 if p.requires_grad else 1
        total += -(-p.numel() // world_size) * p.element_size() * copies
    return total


def device_memory_bytes(device: torch.device | str) -> int | None:
    """A CUDA device's total memory in bytes; None for a CPU, whose limit is the host's and shared
    with every other process on it (``auto`` then stays off: see ``resolve_activation_checkpointing``)."""
    device = torch.device(device)
    if device.type != "cuda":
        return None
    return torch.cuda.get_device_properties(device).total_memory


def resolve_activation_checkpointing(setting: str, *, estimated_bytes: int | None, device_bytes: int | None,
                                     fraction: float = AUTO_DEVICE_FRACTION) -> bool:
    """``--trainer.activation-checkpointing``: ``on`` / ``off`` as said; ``auto`` on when
    ``estimated_bytes`` (a micro-batch's activations plus the rank's parameters, gradients and
    optimizer state) exceed ``fraction`` of ``device_bytes``. ``device_bytes`` None (a CPU) keeps
    ``auto`` off: CPU runs are the small ones, host memory is shared with the generator and the
    scorers so no budget of the trainer's own is known, and recomputing costs a CPU a whole extra
    forward of time. ValueError for any other setting."""
    if setting not in ("auto", "on", "off"):
        raise ValueError(f"--trainer.activation-checkpointing must be auto, on or off, got {setting!r}")
    if setting != "auto":
        return setting == "on"
    if device_bytes is None or estimated_bytes is None:
        return False
    return estimated_bytes > fraction * device_bytes


def activation_checkpointing_for(setting: str, *, model: torch.nn.Module, device: torch.device | str,
                                 microbatch_tokens: int, world_size: int,
                                 param_dtype: torch.dtype | None = None, resident_bytes: int = 0) -> bool:
    """``resolve_activation_checkpointing`` for ``model`` (meta or real, before sharding, its
    ``requires_grad`` as it will train) on ``device``, over ``world_size`` FSDP2 ranks, with
    micro-batches of up to ``microbatch_tokens`` tokens in compute dtype ``param_dtype``. The
    micro-batch is counted as one packed row (the mask's worst case). ``resident_bytes``: what the
    device holds for another executor while the trainer runs (colocated: a native engine's kept
    KV state and graph workspace), added to the estimate. Counts only when the answer depends on
    it (``auto`` on a CUDA device); logs the decision and its numbers."""
    device_bytes = device_memory_bytes(device)
    if setting != "auto" or device_bytes is None:
        return resolve_activation_checkpointing(setting, estimated_bytes=None, device_bytes=device_bytes)
    count = saved_activation_bytes(model, tokens=microbatch_tokens, dtype=param_dtype)
    estimate = count.peak(False) + trainer_state_bytes(model, world_size=world_size) + resident_bytes
    on = resolve_activation_checkpointing(setting, estimated_bytes=estimate, device_bytes=device_bytes)
    logger.info("activation checkpointing %s (auto): a %d-token micro-batch keeps %.1f GiB of activations "
                "(%.1f GiB checkpointed); with the rank's state and %.1f GiB resident for the engine %.1f GiB "
                "of the device's %.1f GiB", "on" if on else "off", microbatch_tokens, count.peak(False) / 2**30,
                count.peak(True) / 2**30, resident_bytes / 2**30, estimate / 2**30, device_bytes / 2**30)
    return on
