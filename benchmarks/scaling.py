"""Per-rank GPU memory of a layout, computed from the real sharded objects without the hardware.

Not a test, and not part of the library (nothing in ``llamarl`` uses it). Usage::

    .venv/bin/python benchmarks/scaling.py    # prints docs/scaling.md's table

``layout_memory`` builds, in one CPU process, what each rank of a GPU job would build: the trainer's
model on the meta device, FSDP2-sharded (``shard_model``) over a mesh of a **fake process group**
(torch's ``fake`` backend: every collective returns at once, so one process can play rank 0 of any
world size), and the generator's model tensor-parallel sliced (``apply_tensor_parallel``) the same
way. The parameter bytes of a rank are then read off those objects (each DTensor's local shard),
not from a formula of the model's size, and the rest is sized from them:

* trainer: master weights (their dtype), fp32 gradients (the same shards), AdamW's two fp32 moments,
  the unsharded parameters of two decoder layers in ``param_dtype`` (FSDP2 all-gathers a layer
  while the next is prefetched) and the root's (embeddings, final norm, LM head: gathered through
  forward and backward), and the log-probs' logits: ``3 x tokens x vocab x 4`` bytes (the fp32
  copy, the division by the temperature and the log-softmax; measured 2.6 copies on CPU in
  benchmarks/logprob_memory.py) for a whole micro-batch, or for one chunk under
  ``--trainer.logprob-chunk-tokens``, and the activations one micro-batch keeps for its backward,
  counted by ``llamarl/models/memory.py`` (a fake-tensor forward and backward at the micro-batch's
  tokens, as one packed row: the attention mask's worst case) on a two-layer slice of the model,
  its layers repeated to the model's depth (every layer of these models is the same; two, so that
  what several layers share is seen as shared). Activation checkpointing is what
  ``--trainer.activation-checkpointing auto`` resolves to for the layout (``Layout.activation_checkpointing``):
  on when those activations and the rank's parameters, gradients and AdamW moments pass 3/4 of the
  GPU (``resolve_activation_checkpointing``, the trainer's own decision); the activations are then
  each layer's input plus one layer recomputed in the backward.
* trainer with LoRA (``lora=True``: rank 16 on every linear of the decoder layers): the base frozen
  in bf16 (its shard, no gradients, no AdamW state), the adapters ``r x (in + out)`` per adapted
  linear in fp32 with fp32 gradients and two fp32 AdamW moments, sharded by the same torch.chunk
  rule (the rule ``test_fake_group_shards_follow_fsdp2_chunks`` checks); activations counted with
  peft's adapters injected into the counted slice. The generator is as in full fine-tuning (an
  upper bound: a LoRA sync moves the adapters only).
* generator: the native engine's HF model (the TP slice, in the generator's dtype; a vLLM
  generator keeps none), the DDMA receive buckets (at most ``--weights.bucket-mb`` per trainer
  peer; none colocated, where weights are handed over in memory), what a stream into vLLM stages
  (a round's finished parameters plus one spanning rounds; colocated, one gathered parameter), and
  the engine: vLLM takes ``--generator.vllm.gpu-memory-utilization`` of the GPU for weights,
  activations and cache together; the native engine's cache is
  ``rows x tokens x layers x 2 x (KV heads / TP) x head_dim x 2`` bytes for ``kv_rows`` rows of
  ``kv_tokens`` tokens (bf16 keys and values).
* the busiest GPU: the larger rank, or with both on one GPU (colocated) their sum, except that a
  colocated vLLM sleeps while the trainer trains, so the peak is the larger of the trainer's total
  and its weights, gradients and AdamW moments plus the generator.

A rank "holds a full model" when its parameter bytes equal the whole model's; the tests assert no
trainer rank does at more than one rank, and that every rank fits the GPU. ``docs/scaling.md`` is
the table ``python benchmarks/scaling.py`` prints.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from llamarl.models.memory import (
    ActivationCount,
    resolve_activation_checkpointing,
    saved_activation_bytes,
    trainer_state_bytes,
)
from llamarl.models.sharding import decoder_layers, shard_model
from llamarl.models.tensor_parallel import apply_tensor_parallel
from llamarl.runtime.boxes import chunk_slice

GIB = 2**30
LORA_RANK = 16

# Public model shapes (their config.json), so no download is needed.
MODELS = {
    "Qwen2.5-0.5B": {"hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24, "num_attention_heads": 14,
                     "num_key_value_heads": 2, "vocab_size": 151_936, "tie_word_embeddings": True},
    "Qwen2.5-1.5B": {"hidden_size": 1536, "intermediate_size": 8960, "num_hidden_layers": 28, "num_attention_heads": 12,
                     "num_key_value_heads": 2, "vocab_size": 151_936, "tie_word_embeddings": True},
    "Qwen2.5-7B": {"hidden_size": 3584, "intermediate_size": 18944, "num_hidden_layers": 28, "num_attention_heads": 28,
                   "num_key_value_heads": 4, "vocab_size": 152_064, "tie_word_embeddings": False},
}


@dataclass(frozen=True)
class Layout:
    """One job: a model and how its ranks are split (the GPU presets' values by default)."""

    name: str
    model: str
    trainer_ranks: int
    generator_ranks: int
    generator_tp: int = 1
    engine: str = "vllm"
    colocated: bool = False
    """Trainer and generator on the same GPU (the one-GPU preset)."""
    microbatch_tokens: int = 16_384
    logprob_chunk_tokens: int = 4096
    bucket_mb: float = 512.0
    gpu_memory_utilization: float = 0.5
    gpu_gib: float = 80.0
    kv_rows: int = 256
    """Native engine: rows decoding at once on a generator rank (its KV cache grows with them)."""
    kv_tokens: int = 2048
    """Native engine: prompt + completion tokens per row."""
    activation_checkpointing: str = "auto"
    """``--trainer.activation-checkpointing`` (auto: resolved as the trainer resolves it)."""


LAYOUTS = [
    Layout("GSM8K / MATH preset, 1 GPU (colocated)", "Qwen2.5-0.5B", 1, 1, colocated=True),
    Layout("GSM8K / MATH preset, 8 GPUs", "Qwen2.5-1.5B", 4, 4, microbatch_tokens=32_768),
    Layout("7B, 8 GPUs (4 trainer + 4 vLLM)", "Qwen2.5-7B", 4, 4, microbatch_tokens=16_384),
    Layout("7B, 2 x 8 GPUs (8 trainer + 8 vLLM)", "Qwen2.5-7B", 8, 8, microbatch_tokens=16_384),
    Layout("7B, 2 x 8 GPUs, native engine TP 2 (8 trainer + 4 x TP 2)", "Qwen2.5-7B", 8, 8, generator_tp=2,
           engine="torch", microbatch_tokens=16_384),
]


@contextlib.contextmanager
def fake_world(world_size: int, rank: int = 0):
    """A fake process group (torch's ``fake`` backend) as the default group, removed on exit."""
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers the "fake" backend

    if dist.is_initialized():
        raise RuntimeError("fake_world needs a process without a process group")
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


def meta_model(name: str, dtype: torch.dtype, *, num_layers: int | None = None) -> torch.nn.Module:
    """``name``'s model on the meta device (``num_layers``: only its first that many layers)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    shape = MODELS[name] | ({"num_hidden_layers": num_layers} if num_layers else {})
    config = Qwen2Config(**shape, max_position_embeddings=32_768)
    with torch.device("meta"):
        model = Qwen2ForCausalLM(config).to(dtype)
    model.tie_weights()
    return model


def _adapted_linears(model: torch.nn.Module) -> list[torch.nn.Linear]:
    """``--trainer.lora.targets all-linear``: every nn.Linear inside the decoder layers."""
    return [m for layer in decoder_layers(model) for m in layer.modules() if isinstance(m, torch.nn.Linear)]


def lora_meta_model(name: str, *, num_layers: int | None = None) -> torch.nn.Module:
    """``name`` on the meta device as a LoRA trainer holds it: peft's rank-16 adapters (fp32,
    trainable) on every linear of the decoder layers, every other parameter frozen in bf16."""
    from peft import LoraConfig, inject_adapter_in_model

    model = meta_model(name, torch.float32, num_layers=num_layers)
    targets = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and ".layers." in f".{n}"]
    inject_adapter_in_model(LoraConfig(r=LORA_RANK, lora_alpha=2 * LORA_RANK, target_modules=targets), model)
    for pname, param in model.named_parameters():
        if ".lora_" not in pname:
            param.requires_grad_(False)
            param.data = param.data.to(torch.bfloat16)
    return model


@functools.cache
def activation_count(name: str, tokens: int, *, lora: bool = False) -> ActivationCount:
    """What a ``tokens``-token micro-batch of ``name`` keeps for its backward in bf16 (one packed
    row), counted on a two-layer slice and its layers repeated to the model's depth."""
    model = lora_meta_model(name, num_layers=2) if lora else meta_model(name, torch.float32, num_layers=2)
    count = saved_activation_bytes(model, tokens=tokens, dtype=torch.bfloat16)
    depth = MODELS[name]["num_hidden_layers"]
    return dataclasses.replace(count, layers=count.layers[-1:] * depth, layer_inputs=count.layer_inputs[-1:] * depth)


def _local_bytes(model: torch.nn.Module) -> int:
    total = 0
    for param in model.parameters():
        local = param.to_local() if isinstance(param, DTensor) else param
        total += local.numel() * local.element_size()
    return total


def _full_bytes(model: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def _lora_rank0_bytes(model: torch.nn.Module, world: int) -> tuple[int, int]:
    """Rank 0's fp32 adapter bytes (FSDP2's torch.chunk rows of A [r, in] and B [out, r]) and
    the adapters' numel in one decoder layer."""
    local = 0
    for linear in _adapted_linears(model):
        out_features, in_features = linear.weight.shape
        local += chunk_slice(LORA_RANK, rank=0, world=world)[1] * in_features * 4
        local += chunk_slice(out_features, rank=0, world=world)[1] * LORA_RANK * 4
    per_layer = sum(LORA_RANK * (m.in_features + m.out_features) for m in _adapted_linears(model)) // max(
        1, len(decoder_layers(model)))
    return local, per_layer


def trainer_rank(layout: Layout, *, lora: bool = False) -> dict:
    """Rank 0 of the trainer (FSDP2's largest shard under torch.chunk) in GiB, by component, and
    (not components) the activations with checkpointing off and on and whether it is on."""
    model = meta_model(layout.model, torch.bfloat16 if lora else torch.float32)
    numel = sum(p.numel() for p in model.parameters())
    layer_numel = sum(p.numel() for p in model.model.layers[0].parameters())
    root_numel = numel - layer_numel * len(model.model.layers)
    adapters, adapter_layer_numel = _lora_rank0_bytes(model, layout.trainer_ranks) if lora else (0, 0)
    full = _full_bytes(model) + (adapter_layer_numel * len(model.model.layers) * 4 if lora else 0)
    if lora:
        model.requires_grad_(False)
    # The trainer's own estimate (memory.activation_checkpointing_for): adapters added by hand.
    state = trainer_state_bytes(model, world_size=layout.trainer_ranks) + 4 * adapters
    with fake_world(layout.trainer_ranks):
        mesh = DeviceMesh("cpu", list(range(layout.trainer_ranks)))
        shard_model(model, mesh, param_dtype=torch.bfloat16)
        base = _local_bytes(model)
    trainable = adapters if lora else base
    vocab = MODELS[layout.model]["vocab_size"]
    tokens = layout.logprob_chunk_tokens or layout.microbatch_tokens
    count = activation_count(layout.model, layout.microbatch_tokens, lora=lora)
    checkpointing = resolve_activation_checkpointing(layout.activation_checkpointing,
                                                     estimated_bytes=count.peak(False) + state,
                                                     device_bytes=int(layout.gpu_gib * GIB))
    return {
        "full model": full / GIB, "master weights": (base + adapters) / GIB, "gradients": trainable / GIB,
        "AdamW": 2 * trainable / GIB,
        "gathered (2 layers + root, bf16)": (2 * (layer_numel + adapter_layer_numel) + root_numel) * 2 / GIB,
        "logits": 3 * tokens * vocab * 4 / GIB, "activations": count.peak(checkpointing) / GIB,
        "activations, checkpointing off": count.peak(False) / GIB,
        "activations, checkpointing on": count.peak(True) / GIB, "checkpointing": checkpointing,
    }


NOT_COMPONENTS = ("full model", "activations, checkpointing off", "activations, checkpointing on", "checkpointing")


def generator_rank(layout: Layout, *, num_trainer_peers: int) -> dict:
    """One generator rank in GiB, by component (bf16 weights)."""
    model = meta_model(layout.model, torch.bfloat16)
    full = _full_bytes(model)
    largest = max(p.numel() * p.element_size() for p in model.parameters())
    if layout.generator_tp > 1:
        with fake_world(layout.generator_tp):
            apply_tensor_parallel(model, DeviceMesh("cpu", list(range(layout.generator_tp))))
            weights = _local_bytes(model)
    else:
        weights = full
    if layout.colocated:  # in-memory hand-over, one gathered parameter at a time: no DDMA buckets
        buckets, staging = 0, largest
    else:
        buckets = min(full, num_trainer_peers * layout.bucket_mb * 2**20)
        # streamed into vLLM: a round's finished parameters plus one that spans rounds
        staging = min(full, buckets + largest) if layout.engine == "vllm" else 0
    if layout.engine == "vllm":
        weights = 0  # no HF copy: vLLM's own weights are inside its fraction of the GPU
    out = {"full model": full / GIB, "weights (HF model)": weights / GIB, "DDMA buckets": buckets / GIB,
           "stream staging": staging / GIB}
    if layout.engine == "vllm":
        out["vLLM (its weights, activations, KV cache)"] = layout.gpu_memory_utilization * layout.gpu_gib
    else:
        shape = MODELS[layout.model]
        head_dim = shape["hidden_size"] // shape["num_attention_heads"]
        kv_heads = shape["num_key_value_heads"] // layout.generator_tp
        out["KV cache"] = (layout.kv_rows * layout.kv_tokens * shape["num_hidden_layers"] * 2 * kv_heads
                           * head_dim * 2) / GIB
    return out


@functools.cache
def layout_memory(layout: Layout, *, lora: bool = False) -> dict:
    """``{"trainer": {...}, "generator": {...}, "trainer_total", "generator_total", "gpu_total"}``
    in GiB for one layout (module docstring), its trainer fine-tuning fully or with LoRA;
    ``gpu_total`` is the busiest GPU's. Cached: treat the result as read-only."""
    trainer = trainer_rank(layout, lora=lora)
    generator = generator_rank(layout, num_trainer_peers=layout.trainer_ranks)
    trainer_total = sum(v for k, v in trainer.items() if k not in NOT_COMPONENTS)
    generator_total = sum(v for k, v in generator.items() if k != "full model")
    if not layout.colocated:
        gpu_total = max(trainer_total, generator_total)
    elif layout.engine == "vllm":
        # vLLM sleeps while the trainer trains (its weights in host memory, its KV cache freed); the
        # trainer's weights, gradients and AdamW moments stay on the GPU while vLLM generates.
        persistent = sum(trainer[k] for k in ("master weights", "gradients", "AdamW"))
        gpu_total = max(trainer_total, persistent + generator_total)
    else:
        gpu_total = trainer_total + generator_total
    return {"trainer": trainer, "generator": generator, "trainer_total": trainer_total,
            "generator_total": generator_total, "gpu_total": gpu_total}


def _gib(value: float) -> str:
    # LoRA's adapters, gradients and moments are tens of MiB: two places, not 0.0.
    return f"{value:.2f}" if 0 < value < 0.1 else f"{value:.1f}"


def markdown_table(layouts: list[Layout], *, lora: bool = False) -> str:
    """The per-layout table of docs/scaling.md (``lora``: the trainer with rank-16 adapters)."""
    header = ("| layout | model | trainer rank: master / grads / AdamW / gathered / logits / activations (GiB) | "
              "activations without / with checkpointing (GiB): auto | trainer rank | "
              "generator rank: HF weights / DDMA buckets / stream staging / vLLM or KV cache (GiB) | generator rank | "
              "busiest GPU of 80 GiB |")
    lines = [header, "|---|---|---|---|---|---|---|---|"]
    for layout in layouts:
        m = layout_memory(layout, lora=lora)
        t, g = m["trainer"], m["generator"]
        trainer = " / ".join(_gib(t[k]) for k in ("master weights", "gradients", "AdamW",
                                                  "gathered (2 layers + root, bf16)", "logits", "activations"))
        activations = (f"{t['activations, checkpointing off']:.1f} / {t['activations, checkpointing on']:.1f}: "
                       f"{'on' if t['checkpointing'] else 'off'}")
        engine = g.get("vLLM (its weights, activations, KV cache)", g.get("KV cache", 0.0))
        generator = (f"{g['weights (HF model)']:.1f} / {g['DDMA buckets']:.1f} / {g['stream staging']:.1f} / "
                     f"{engine:.1f}")
        model = (f"{t['full model']:.1f} GiB: bf16 base, r={LORA_RANK} fp32 adapters" if lora
                 else f"{t['full model']:.1f} GiB fp32")
        lines.append(f"| {layout.name} | {layout.model} ({model}) | {trainer} | {activations} | "
                     f"{m['trainer_total']:.1f} | {generator} | {m['generator_total']:.1f} | {m['gpu_total']:.1f} |")
    return "\n".join(lines)


def main() -> None:
    argparse.ArgumentParser(description="Print docs/scaling.md's per-rank memory tables (full fine-tuning, "
                                        "then LoRA).").parse_args()
    print(markdown_table(LAYOUTS))
    print()
    print(markdown_table(LAYOUTS, lora=True))


if __name__ == "__main__":
    main()
