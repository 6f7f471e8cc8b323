"""The fused decode step (llamarl/engines/fused_decode.py) against the HF modules' loop it replaces:
fp32 greedy and seeded sampling give the same tokens, log-probs agree to rounding, for every
family it supports, with left padding, shared prompts, carried-in tokens (rows finishing at
different steps) and an in-place weight update between calls; the others fall back."""

from __future__ import annotations

import pytest
import torch
from model_families import build_family, chat_tokenizer

from llamarl.engines.base import Request, SamplingParams
from llamarl.engines.fused_decode import FusedDecoder
from llamarl.engines.torch_engine import TorchEngine


def requests() -> list[Request]:
    tok = chat_tokenizer()
    short, long = tok("2 + 2 =")["input_ids"], tok("Write the product of 347 and 23, then stop.")["input_ids"]
    return [Request(sample_id=0, prompt_ids=short), Request(sample_id=1, prompt_ids=long),
            Request(sample_id=2, prompt_ids=long),  # a shared prompt: prefilled once, copied
            Request(sample_id=3, prompt_ids=short, completion_ids=[11, 12, 13], logprobs=[-1.0] * 3,
                    versions=[0] * 3)]  # carried in: its row finishes three steps earlier


def run(model, *, fused: bool, sampling: SamplingParams, seed: int = 0):
    engine = TorchEngine(model, eos_token_ids=[], pad_token_id=chat_tokenizer().pad_token_id, fused_decode=fused)
    return engine.generate(requests(), sampling=sampling, version=1, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("family", ["llama-tied", "llama-untied", "qwen2", "mistral"])
def test_fused_steps_give_the_hf_loops_tokens(family, monkeypatch):
    model = build_family(family)
    assert FusedDecoder.supports(model, length=100)
    steps = []
    step = FusedDecoder.step
    monkeypatch.setattr(FusedDecoder, "step", lambda self, *a: steps.append(1) or step(self, *a))
    for sampling in (SamplingParams(temperature=0.0, max_new_tokens=12),
                     SamplingParams(temperature=1.0, max_new_tokens=12)):
        steps.clear()
        hf = run(model, fused=False, sampling=sampling)
        assert not steps
        fused = run(model, fused=True, sampling=sampling)
        assert len(steps) == 11  # every decode step after the prefill's token ran fused
        assert [c.completion_ids for c in fused] == [c.completion_ids for c in hf], sampling
        assert [len(c.completion_ids) for c in fused] == [12, 12, 12, 12]
        for f, h in zip(fused, hf):
            torch.testing.assert_close(torch.tensor(f.logprobs), torch.tensor(h.logprobs), rtol=0, atol=1e-5)


def test_an_in_place_weight_update_reaches_the_next_call():
    model = build_family("llama-untied")
    engine = TorchEngine(model, eos_token_ids=[], pad_token_id=chat_tokenizer().pad_token_id)
    greedy = SamplingParams(temperature=0.0, max_new_tokens=8)
    before = engine.generate(requests(), sampling=greedy, version=0)
    with torch.no_grad():
        for layer in model.model.layers:  # what a weight channel does: copy_ into the live tensors
            layer.mlp.up_proj.weight.copy_(torch.randn_like(layer.mlp.up_proj.weight))
            layer.self_attn.v_proj.weight.mul_(-1.0)
    after = engine.generate(requests(), sampling=greedy, version=1)
    reference = run(model, fused=False, sampling=greedy)
    assert [c.completion_ids for c in after] == [c.completion_ids for c in reference]
    assert [c.completion_ids for c in after] != [c.completion_ids for c in before]


def test_other_layouts_use_the_hf_modules():
    for family in ("qwen3", "gemma2"):  # q/k norms; soft-capping and alternating windows
        assert not FusedDecoder.supports(build_family(family), length=100)
    mistral = build_family("mistral")  # a sliding window shorter than the sequence changes attention
    assert FusedDecoder.supports(mistral, length=4096) and not FusedDecoder.supports(mistral, length=4097)
