"""HF export: shard files + index that ``from_pretrained`` loads as-is, with config and tokenizer."""

import json
import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

sys.path.insert(0, str(Path(__file__).parent))
from tiny_model import save_tiny_model

from llamarl.models.export import export_hf
from llamarl.models.loading import load_causal_lm


def test_sharded_export_loads_with_from_pretrained(tmp_path):
    model, tokenizer = load_causal_lm(str(save_tiny_model(tmp_path / "src")))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01)  # not the source checkpoint's values
    out = tmp_path / "export"
    (out).mkdir()
    (out / "stale.txt").write_text("from an older export")
    export_hf(out, model=model, tokenizer=tokenizer, writer=True, max_shard_bytes=40_000)
    shards = sorted(p.name for p in out.glob("model-*.safetensors"))
    assert len(shards) > 1 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == {n for n, _ in model.named_parameters()}
    assert not (out / "stale.txt").exists() and not (tmp_path / "export.partial").exists()
    loaded = AutoModelForCausalLM.from_pretrained(out)
    for name, param in model.named_parameters():
        assert torch.equal(dict(loaded.named_parameters())[name], param), name
    assert AutoTokenizer.from_pretrained(out)("1+2")["input_ids"] == tokenizer("1+2")["input_ids"]


def test_a_non_writer_rank_writes_nothing(tmp_path):
    model, _ = load_causal_lm(str(save_tiny_model(tmp_path / "src")))
    export_hf(tmp_path / "export", model=model, writer=False)
    assert not (tmp_path / "export").exists() and not (tmp_path / "export.partial").exists()
