"""Colocated memory (issue 46 item 6): the native engine's state released between generations
(``--generator.torch.sleep``; on CPU through the fake CUDA graphs of tests/fake_cuda.py), the
memory model's count of a colocated rank (llamarl/models/colocated_memory.py) at Qwen2.5-1.5B full
fine-tuning and Qwen2.5-7B LoRA r16 shapes (configs from numbers: no download), and ``auto``
activation checkpointing counting a kept engine state."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from fake_cuda import FakeCudaGraphs
from model_families import build_family
from test_cuda_graph_proxies import GREEDY, assert_same, generate, graph_engine, hf_engine
from test_fused_decode import staggered
from tiny_model import build_tiny_llama
from transformers import Qwen2Config

from llamarl.engines.base import EngineSetup, Sleeps
from llamarl.engines.engine_configs import TorchEngineConfig
from llamarl.models import memory
from llamarl.models.colocated_memory import (
    EngineFootprint,
    colocated_memory,
    engine_state_bytes,
    kv_state_bytes,
)
from llamarl.rl.config import RLConfig
from llamarl.rl.standard_pipeline import kept_engine_state

GB = 10**9
H100_80GB = 80 * GB
"""An "80 GB" GPU, counted low (an H100's 81.5e9 bytes less its context)."""


def qwen25_1_5b() -> Qwen2Config:
    return Qwen2Config(vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                       num_attention_heads=12, num_key_value_heads=2, max_position_embeddings=32768,
                       tie_word_embeddings=True, rope_theta=1e6)


def qwen25_7b() -> Qwen2Config:
    return Qwen2Config(vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                       num_attention_heads=28, num_key_value_heads=4, max_position_embeddings=32768,
                       tie_word_embeddings=False, rope_theta=1e6)


def test_sleep_releases_the_engine_state_and_the_next_generate_reserves_it_again(monkeypatch):
    fake = FakeCudaGraphs(monkeypatch)
    model = build_family("qwen2")
    built = graph_engine(model, eos_check_every=2, sleep_mode=True)
    assert isinstance(built, Sleeps) and built.sleep_mode
    first = generate(built, staggered(), GREEDY)
    state = built.static_decoder.state
    cache, captures = weakref.ref(state.caches[0]), fake.captures
    assert fake.live_graphs > 0 and captures > 0
    built.sleep()
    del state
    gc.collect()
    assert built.static_decoder.state is None
    assert cache() is None and fake.live_graphs == 0  # the KV cache, the graphs and their pool freed
    again = generate(built, staggered(), GREEDY)  # reserved and captured again: the same tokens
    assert built.static_decoder.state is not None and fake.captures == 2 * captures
    assert_same(again, first)
    assert_same(first, generate(hf_engine(model), staggered(), GREEDY))


def test_the_engine_sleeps_only_when_sharing_its_device_and_allowed():
    model = build_tiny_llama(seed=0)

    def built(config: TorchEngineConfig, shares: bool):
        return config.build(EngineSetup(model=model, model_path="", dtype="float32", eos_token_ids=[2], pad_token_id=0,
                                        seed=0, device=torch.device("cpu"), shares_device=shares))

    assert built(TorchEngineConfig(), True).sleep_mode
    assert not built(TorchEngineConfig(), False).sleep_mode
    assert not built(TorchEngineConfig(sleep=False), True).sleep_mode


def test_state_bytes_by_hand():
    config = qwen25_1_5b()
    # 28 layers x [2, 256, 2, 1024, 128] bf16
    assert kv_state_bytes(config, slots=256, width=1024, dtype=torch.bfloat16) == 28 * 2 * 256 * 2 * 1024 * 128 * 2
    kept = engine_state_bytes(config, slots=256, width=1024, dtype=torch.bfloat16)
    assert 7.5 * GB < kept < 9 * GB  # the issue's ~7.5 GB, plus logits and the graph workspace
    assert EngineFootprint(slots=256, width=1024, dtype=torch.bfloat16).bytes(config) == kept


def test_colocated_runs_fit_an_80_gb_gpu_by_the_models_count():
    """1.5B full fine-tuning (fp32 masters and AdamW) and 7B LoRA r16 (bf16 base), each with a kept
    256 x 1,024 engine state and 16k-token micro-batches, fit; 7B full fine-tuning does not."""
    tokens = 16384
    full = colocated_memory(qwen25_1_5b(), microbatch_tokens=tokens, engine_slots=256, engine_width=1024)
    params = 1_543_714_304  # Qwen2.5-1.5B's parameters (tied head counted once)
    assert full.weights == params * 4 and full.gradients == params * 4 and full.optimizer == params * 8
    assert full.engine_weights == params * 2
    assert full.engine_state == engine_state_bytes(qwen25_1_5b(), slots=256, width=1024, dtype=torch.bfloat16)
    assert full.logits_chunk == 3 * 1024 * 151936 * 4
    assert full.activations > 0 and full.fits(H100_80GB), full.gib()
    lora = colocated_memory(qwen25_7b(), microbatch_tokens=tokens, engine_slots=256, engine_width=1024, lora_rank=16)
    # the adapters' only: per layer r (in + out) over q, k, v, o, gate, up, down, in fp32
    adapters = 28 * 16 * ((3584 + 3584) * 2 + (3584 + 512) * 2 + (3584 + 18944) * 3)
    assert lora.gradients == adapters * 4 and lora.optimizer == 2 * lora.gradients
    assert lora.weights == 7_615_616_512 * 2 + adapters * 4  # the frozen bf16 base and the fp32 adapters
    assert lora.fits(H100_80GB), lora.gib()
    released = colocated_memory(qwen25_7b(), microbatch_tokens=tokens, engine_slots=256, engine_width=1024,
                                lora_rank=16, keep_engine_state=False)
    assert released.engine_state == 0 and lora.total - released.total == lora.engine_state > 15 * GB
    oversized = colocated_memory(qwen25_7b(), microbatch_tokens=tokens, engine_slots=256, engine_width=1024)
    assert not oversized.fits(H100_80GB), oversized.gib()  # 7B full fine-tuning: ~120 GB of AdamW alone
    # without checkpointing, a 16k-token micro-batch's activations alone leave no room at 7B
    assert not colocated_memory(qwen25_7b(), microbatch_tokens=tokens, engine_slots=256, engine_width=1024,
                                lora_rank=16, checkpointing=False).fits(H100_80GB)
    with pytest.raises(ValueError, match="colocated_memory"):
        colocated_memory(qwen25_7b(), microbatch_tokens=0, engine_slots=256, engine_width=1024)


def test_auto_checkpointing_counts_a_kept_engine_state(monkeypatch):
    """The trainer's ``auto`` turns on where the engine's kept state tips the estimate over."""
    model = build_tiny_llama(seed=0)
    monkeypatch.setattr(memory, "device_memory_bytes", lambda device: 8 * 2**20)  # an 8 MiB "GPU"
    assert not memory.activation_checkpointing_for("auto", model=model, device="cuda", microbatch_tokens=64,
                                                   world_size=1)
    assert memory.activation_checkpointing_for("auto", model=model, device="cuda", microbatch_tokens=64,
                                               world_size=1, resident_bytes=6 * 2**20)


def test_the_run_counts_the_engine_state_only_when_colocated_and_kept():
    config = RLConfig()
    assert kept_engine_state(config) is None  # async: the generator has ranks of its own
    config.run.schedule = "colocated"
    assert kept_engine_state(config) is None  # released between generations (the default)
    config.generator.torch.sleep = False
    kept = kept_engine_state(config)
    # every sample of a step (16 x 4), as wide as a micro-batch (2,048 tokens), in the generator's dtype
    assert kept == EngineFootprint(slots=64, width=2048, dtype=torch.float32)
