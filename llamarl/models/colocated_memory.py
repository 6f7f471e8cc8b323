"""A colocated rank's memory by the model's own count (issue 46 item 6), computed from a model's
config alone (a meta-device model: no weights, no download).

Under ``--run.schedule colocated`` one device holds, while the trainer runs: the trainer's
weights, gradients and AdamW moments (full fine-tuning: every parameter in ``--model.dtype``;
LoRA: the frozen base in ``--trainer.param-dtype`` and only the adapters' fp32 masters, gradients
and moments), the layers FSDP2 gathers for compute (the root's embedding and head for the whole
step, two decoder layers at a time), a micro-batch's activations (``memory.saved_activation_bytes``,
its backward's peak), the log-probs' logits chunk, the generator's own full copy of the weights
(``weight_copy.py``: the weights channel writes it in place) and, when the native engine keeps it
(``--generator.torch.no-sleep``), the engine's state: the KV cache (``kv_slots.py``: per layer
``[2, slots, kv_heads, width, head_dim]`` in the generator's dtype), the step's ``[slots, vocab]``
logits, and the CUDA-graph pool's workspace (``graph_workspace_bytes``, an estimate: the
captured step's largest intermediates at the state's largest bucket).

The decision (``TorchEngineConfig.sleep``): colocated, the native engine releases its state after
each generation step by default (``StaticDecoder.release``; the next ``generate`` reserves a new
one and captures its graphs again, which ``capture_seconds`` counts), so the trainer's peak gets
the memory; ``--generator.torch.no-sleep`` keeps it for the engine's life and the trainer's
``auto`` activation checkpointing counts it (``memory.activation_checkpointing_for(...,
resident_bytes=)``). ``colocated_memory`` counts either (``keep_engine_state``).

Left out, and what ``fits``' fraction is for: the CUDA context, allocator fragmentation, NCCL's
buffers, the inputs' few bytes per token.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from llamarl.models.memory import saved_activation_bytes

__all__ = ["COLOCATED_FIT_FRACTION", "ColocatedMemory", "EngineFootprint", "colocated_memory", "engine_state_bytes",
           "graph_workspace_bytes", "kv_state_bytes"]

COLOCATED_FIT_FRACTION = 0.9
"""``ColocatedMemory.fits``: the count must stay within this fraction of the device (the rest for
the CUDA context, fragmentation and NCCL, which the count leaves out)."""


def _head_dim(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def kv_state_bytes(config, *, slots: int, width: int, dtype: torch.dtype) -> int:
    """The native engine's KV cache: per layer ``[2, slots, kv_heads, width, head_dim]`` in ``dtype``."""
    per_layer = 2 * slots * config.num_key_value_heads * width * _head_dim(config)
    return config.num_hidden_layers * per_layer * torch.empty((), dtype=dtype).element_size()


def graph_workspace_bytes(config, *, slots: int, dtype: torch.dtype) -> int:
    """An estimate of the CUDA-graph pool: one captured step's largest live intermediates at
    ``slots`` rows (layers run one after another, so one layer's: the fused q / k / v, the
    attention output, the fused gate / up and the MLP's product, in ``dtype``), plus the sampler's
    fp32 ``[slots, vocab]`` copies (processed logits, probabilities, their cumulative sums)."""
    size = torch.empty((), dtype=dtype).element_size()
    heads, kv, d = config.num_attention_heads, config.num_key_value_heads, _head_dim(config)
    layer = slots * ((heads + 2 * kv) * d + heads * d + 3 * config.intermediate_size + 2 * config.hidden_size) * size
    return layer + 3 * slots * config.vocab_size * 4


def engine_state_bytes(config, *, slots: int, width: int, dtype: torch.dtype) -> int:
    """What the native engine keeps between generations when it does not release it: the KV
    cache, the step's ``[slots, vocab]`` logits (``dtype``) and the graph pool's workspace."""
    size = torch.empty((), dtype=dtype).element_size()
    return (kv_state_bytes(config, slots=slots, width=width, dtype=dtype) + slots * config.vocab_size * size
            + graph_workspace_bytes(config, slots=slots, dtype=dtype))


@dataclass(frozen=True)
class EngineFootprint:
    """A kept engine state's shape: ``slots`` rows of ``width`` columns in ``dtype``."""

    slots: int
    width: int
    dtype: torch.dtype

    def bytes(self, config) -> int:
        """``engine_state_bytes`` of this shape for a model's ``config``."""
        return engine_state_bytes(config, slots=self.slots, width=self.width, dtype=self.dtype)


@dataclass(frozen=True)
class ColocatedMemory:
    """One colocated rank's bytes while its trainer runs, by part (module docstring)."""

    weights: int
    """The trainer's parameters (this rank's shard): masters, or LoRA's frozen base and adapters."""
    gradients: int
    """Gradients of the trainable parameters (master dtype)."""
    optimizer: int
    """AdamW's two moments of the trainable parameters (master dtype)."""
    gathered: int
    """FSDP2's unsharded compute copies: the root's (embedding, final norm, head) and two layers'."""
    activations: int
    """A micro-batch's activations at its backward's peak (``ActivationCount.peak``)."""
    logits_chunk: int
    """The log-probs' chunk of logits: its logits, fp32 softmax and gradient."""
    engine_weights: int
    """The generator's own full copy of the weights (generator dtype)."""
    engine_state: int
    """The engine's KV cache, logits and graph workspace when kept; 0 when released."""

    @property
    def total(self) -> int:
        return sum(getattr(self, f.name) for f in fields(self))

    def fits(self, device_bytes: int, *, fraction: float = COLOCATED_FIT_FRACTION) -> bool:
        """Whether the count stays within ``fraction`` of ``device_bytes``."""
        return self.total <= fraction * device_bytes

    def gib(self) -> dict[str, float]:
        """Every part and the total in GiB (docs/gpu.md's table)."""
        return {**{f.name: getattr(self, f.name) / 2**30 for f in fields(self)}, "total": self.total / 2**30}


def _meta_model(config) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def _lora_parameters(model: torch.nn.Module, rank: int) -> int:
    """Adapter parameters of ``all-linear`` LoRA at ``rank``: ``r (in + out)`` per decoder-layer linear."""
    return sum(rank * (m.in_features + m.out_features) for name, m in model.named_modules()
               if isinstance(m, torch.nn.Linear) and ".layers." in f".{name}")


def colocated_memory(config, *, microbatch_tokens: int, engine_slots: int, engine_width: int,
                     master_dtype: torch.dtype = torch.float32, param_dtype: torch.dtype = torch.bfloat16,
                     engine_dtype: torch.dtype = torch.bfloat16, lora_rank: int | None = None,
                     logprob_chunk_tokens: int = 1024, keep_engine_state: bool = True,
                     checkpointing: bool = True, world_size: int = 1) -> ColocatedMemory:
    """One colocated rank's memory (module docstring) for an HF ``config`` (a ``PretrainedConfig``;
    the model is built on the meta device), micro-batches of ``microbatch_tokens`` in compute dtype
    ``param_dtype``, masters and AdamW moments in ``master_dtype`` (``--model.dtype``; LoRA's adapters
    are fp32 whatever it is), LoRA at ``lora_rank`` (None: full fine-tuning), log-prob chunks of
    ``logprob_chunk_tokens`` (0: the whole micro-batch's logits), an engine state of
    ``engine_slots`` x ``engine_width`` in ``engine_dtype`` counted when ``keep_engine_state``,
    activation ``checkpointing`` per layer, FSDP2 over ``world_size`` ranks. Under LoRA the
    activations are counted with every weight trainable: an upper bound (the adapters save each
    adapted linear's input, which the frozen base would not). ValueError for a size below 1."""
    if min(microbatch_tokens, engine_slots, engine_width, world_size) < 1 or logprob_chunk_tokens < 0:
        raise ValueError("colocated_memory: token, slot, width and rank counts must be >= 1 (the chunk >= 0)")
    model = _meta_model(config)
    numel = sum(p.numel() for p in model.parameters())
    m_size, p_size, e_size = (torch.empty((), dtype=d).element_size() for d in (master_dtype, param_dtype, engine_dtype))
    if lora_rank is None:
        trainable, trainable_size, weights = numel, m_size, numel * m_size
    else:
        trainable, trainable_size = _lora_parameters(model, lora_rank), 4
        weights = numel * p_size + trainable * trainable_size
    layers = list(model.model.layers)
    root = numel - sum(p.numel() for layer in layers for p in layer.parameters())
    layer = sum(p.numel() for p in layers[0].parameters())
    count = saved_activation_bytes(model, tokens=microbatch_tokens, dtype=param_dtype)
    chunk = logprob_chunk_tokens or microbatch_tokens
    return ColocatedMemory(
        weights=-(-weights // world_size), gradients=-(-trainable * trainable_size // world_size),
        optimizer=-(-2 * trainable * trainable_size // world_size), gathered=(root + 2 * layer) * p_size,
        activations=count.peak(checkpointing), logits_chunk=3 * min(chunk, microbatch_tokens) * config.vocab_size * 4,
        engine_weights=numel * e_size,
        engine_state=engine_state_bytes(config, slots=engine_slots, width=engine_width, dtype=engine_dtype)
        if keep_engine_state else 0)
