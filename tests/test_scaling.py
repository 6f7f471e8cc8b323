"""The per-rank memory table (benchmarks/scaling.py, docs/scaling.md): computed from FSDP2 / TP layouts
built on the meta device over torch's fake process group, with the activations a micro-batch keeps
counted on fake tensors (llamarl/models/memory.py), the docs say what the code prints, every layout
(the recipes' GPU presets among them) fits an 80 GiB GPU with and without LoRA, activation
checkpointing is on where it has to be, and no trainer rank of a multi-rank layout holds the full
model."""

from pathlib import Path

import pytest
import torch
from conftest import load_benchmark
from tiny_model import build_tiny_llama

from llamarl.models.memory import saved_activation_bytes
from llamarl.models.sharding import shard_model
from llamarl.runtime.boxes import chunk_slice

scaling = load_benchmark("scaling")
LAYOUTS, layout_memory, markdown_table = scaling.LAYOUTS, scaling.layout_memory, scaling.markdown_table
fake_world, meta_model, _local_bytes = scaling.fake_world, scaling.meta_model, scaling._local_bytes
CASES = [(layout, lora) for layout in LAYOUTS for lora in (False, True)]
CASE_IDS = [f"{layout.name}{', LoRA' if lora else ''}" for layout, lora in CASES]

ROOT = Path(__file__).resolve().parents[1]


def test_docs_scaling_holds_the_tables_the_code_computes():
    docs = (ROOT / "docs" / "scaling.md").read_text()
    assert markdown_table(LAYOUTS) in docs
    assert markdown_table(LAYOUTS, lora=True) in docs


@pytest.mark.parametrize(("layout", "lora"), CASES, ids=CASE_IDS)
def test_every_layout_fits_and_no_trainer_rank_holds_the_model(layout, lora):
    memory = layout_memory(layout, lora=lora)
    assert memory["gpu_total"] <= layout.gpu_gib
    trainer = memory["trainer"]
    if layout.trainer_ranks > 1:
        assert trainer["master weights"] < trainer["full model"]
        # rank 0's shard is the largest; the shards together are the model
        assert trainer["master weights"] * layout.trainer_ranks >= trainer["full model"]
    else:
        assert trainer["master weights"] == pytest.approx(trainer["full model"])
    if layout.generator_tp > 1:
        assert memory["generator"]["weights (HF model)"] < memory["generator"]["full model"] / 2 + 3


def test_fake_group_shards_follow_fsdp2_chunks():
    """Rank 0's bytes under the fake group are torch.chunk's first chunk of every parameter (the
    rule FSDP2 uses in a real world; tests/test_weights.py checks the real one)."""
    model = build_tiny_llama(seed=0, vocab_size=131, hidden_size=40, intermediate_size=71)
    expected = sum(chunk_slice(p.shape[0], rank=0, world=3)[1] * (p.numel() // p.shape[0]) * 4
                   for p in model.parameters())
    with torch.device("meta"):
        meta = build_tiny_llama(seed=0, vocab_size=131, hidden_size=40, intermediate_size=71)
    with fake_world(3):
        from torch.distributed.device_mesh import DeviceMesh

        shard_model(meta, DeviceMesh("cpu", [0, 1, 2]))
        assert _local_bytes(meta) == expected


def test_a_vllm_generator_holds_no_hf_copy_and_a_colocated_one_sleeps_through_training():
    """vLLM generator ranks keep no HF model (each sync streams into vLLM) and stage at most the
    buckets plus one parameter; a colocated vLLM's GPU peaks below the sum of both executors'
    totals, since vLLM sleeps while the trainer trains."""
    for layout in LAYOUTS:
        memory = layout_memory(layout)
        generator = memory["generator"]
        if layout.engine != "vllm":
            assert generator["weights (HF model)"] > 0 and generator["stream staging"] == 0
            continue
        assert generator["weights (HF model)"] == 0
        model = meta_model(layout.model, torch.bfloat16)
        largest = max(p.numel() * p.element_size() for p in model.parameters()) / 2**30
        assert 0 < generator["stream staging"] <= generator["DDMA buckets"] + largest + 1e-9
        if layout.colocated:
            assert memory["gpu_total"] < memory["trainer_total"] + memory["generator_total"]



@pytest.mark.parametrize(("layout", "lora"), CASES, ids=CASE_IDS)
def test_activations_are_counted_and_checkpointed_where_they_would_not_fit(layout, lora):
    """The trainer's total includes its activations as ``auto`` resolves checkpointing; wherever the
    activations without checkpointing would not fit the GPU, ``auto`` turned it on (the 8-GPU
    preset's 32,768-token micro-batches among them), and checkpointing keeps a small part."""
    memory = layout_memory(layout, lora=lora)
    trainer = memory["trainer"]
    off, on = trainer["activations, checkpointing off"], trainer["activations, checkpointing on"]
    assert 0 < on < off / 5
    assert trainer["activations"] == (on if trainer["checkpointing"] else off)
    if memory["trainer_total"] - trainer["activations"] + off > layout.gpu_gib:
        assert trainer["checkpointing"]
    if layout.model == "Qwen2.5-1.5B":
        assert trainer["checkpointing"] and off > layout.gpu_gib


def test_the_two_layer_count_is_the_whole_models():
    """The table counts a two-layer slice and repeats its layer to the model's depth: the same bytes
    as counting every layer of the whole model."""
    whole = saved_activation_bytes(meta_model("Qwen2.5-0.5B", torch.float32), tokens=1024, dtype=torch.bfloat16)
    sliced = scaling.activation_count("Qwen2.5-0.5B", 1024)
    for checkpointing in (False, True):
        assert sliced.peak(checkpointing) == whole.peak(checkpointing)


def test_the_layouts_hold_the_recipes_gpu_presets():
    """The two preset layouts are what the GSM8K and MATH recipes' presets configure: model, trainer
    ranks, micro-batch and log-prob chunk tokens, checkpointing left to ``auto``."""
    from recipes import gsm8k, math

    for presets in (gsm8k.PRESETS, math.PRESETS):
        for key, layout in (("qwen2.5-0.5b-1gpu", LAYOUTS[0]), ("qwen2.5-1.5b-8gpu", LAYOUTS[1])):
            config = presets[key][1]
            assert config.model.name == f"Qwen/{layout.model}-Instruct"
            assert config.trainer.max_tokens_per_microbatch == layout.microbatch_tokens
            assert config.trainer.logprob_chunk_tokens == layout.logprob_chunk_tokens
            assert config.trainer.activation_checkpointing == layout.activation_checkpointing == "auto"
            assert config.generator.num_ranks == layout.generator_ranks
            assert (config.run.schedule == "colocated") == layout.colocated
