"""The per-rank memory table (benchmarks/scaling.py, docs/scaling.md): computed from FSDP2 / TP layouts
built on the meta device over torch's fake process group, the docs say what the code prints,
every layout fits an 80 GiB GPU, and no trainer rank of a multi-rank layout holds the full model."""

from pathlib import Path

import pytest
import torch
from conftest import load_benchmark
from tiny_model import build_tiny_llama

from llamarl.boxes import chunk_slice
from llamarl.models.sharding import shard_model

scaling = load_benchmark("scaling")
LAYOUTS, layout_memory, markdown_table = scaling.LAYOUTS, scaling.layout_memory, scaling.markdown_table
fake_world, meta_model, _local_bytes = scaling.fake_world, scaling.meta_model, scaling._local_bytes

ROOT = Path(__file__).resolve().parents[1]


def test_docs_scaling_holds_the_table_the_code_computes():
    assert markdown_table(LAYOUTS) in (ROOT / "docs" / "scaling.md").read_text()


@pytest.mark.parametrize("layout", LAYOUTS, ids=[layout.name for layout in LAYOUTS])
def test_every_layout_fits_and_no_trainer_rank_holds_the_model(layout):
    memory = layout_memory(layout)
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

