"""The static decode step's fused kernels compiled by Triton on CUDA (llamarl/engines/triton_kernels.py):
each equals its op's CPU reference (llamarl/engines/step_kernels.py) on the same inputs, the decoder
takes them on CUDA, and the captured step with them gives the aten step's tokens in fp32 for every
family (the CPU tests run the same kernels by Triton's interpreter: tests/test_triton_kernels.py)."""

import pytest
import torch
from model_families import build_family, chat_tokenizer
from test_fused_decode import requests

from llamarl.engines import step_kernels
from llamarl.engines.base import SamplingParams
from llamarl.engines.static_decode import StaticDecoder
from llamarl.engines.torch_engine import TorchEngine


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_each_kernel_matches_its_reference(dtype):
    triton_kernels = pytest.importorskip("llamarl.engines.triton_kernels", reason="needs triton")
    g = torch.Generator().manual_seed(0)

    def rand(*shape):
        return torch.randn(shape, generator=g).to(dtype)

    tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}
    rows, heads, kv, d = 5, 8, 2, 128
    qkv, cos, sin, weight = rand(rows, heads + 2 * kv, d), rand(64, d), rand(64, d), rand(heads + kv, d)
    cache, positions = rand(2, 8, kv, 64, d), torch.tensor([0, 5, 63, 17, 2])
    for head_weight in (None, weight):
        expected_cache = cache.clone()
        expected = torch.ops.llamarl.rope_store(qkv, positions, cos, sin, expected_cache[:, :rows, :, :48], head_weight,
                                                heads, kv, 1e-6)
        on = cache.cuda()
        got = triton_kernels.rope_store(qkv.cuda(), positions.cuda(), cos.cuda(), sin.cuda(), on[:, :rows, :, :48],
                                        None if head_weight is None else head_weight.cuda(), num_heads=heads,
                                        num_kv_heads=kv, eps=1e-6)
        torch.testing.assert_close(got.cpu(), expected, **tol)
        torch.testing.assert_close(on.cpu(), expected_cache, **tol)
    gate_up = rand(rows, 2 * 4864) * 3
    for gelu in (False, True):
        torch.testing.assert_close(triton_kernels.act_mul(gate_up.cuda(), gelu=gelu).cpu(),
                                   torch.ops.llamarl.act_mul(gate_up, gelu), **tol)
    q = rand(rows, heads, d)
    for softcap in (0.0, 50.0):
        torch.testing.assert_close(
            triton_kernels.decode_attention(q.cuda(), cache.cuda()[:, :rows], positions.cuda(), scaling=d ** -0.5,
                                            softcap=softcap).cpu(),
            torch.ops.llamarl.decode_attention(q, cache[:, :rows], positions, d ** -0.5, softcap), **tol)
    x, y, w, w2 = rand(rows, 1536), rand(rows, 1536), rand(1536), rand(1536)
    torch.testing.assert_close(triton_kernels.rms_norm(x.cuda(), w.cuda(), eps=1e-6, offset=1.0).cpu(),
                               torch.ops.llamarl.rms_norm(x, w, 1e-6, 1.0), **tol)
    hidden, expected_hidden = x.cuda(), x.clone()
    expected = torch.ops.llamarl.sandwich(expected_hidden, y, w, w2, 1e-6, 1.0)
    got = triton_kernels.sandwich(hidden, y.cuda(), w.cuda(), w2.cuda(), eps=1e-6, offset=1.0)
    torch.testing.assert_close(hidden.cpu(), expected_hidden, **tol)
    torch.testing.assert_close(got.cpu(), expected, **tol)


def test_greedy_and_book_match_their_references():
    triton_kernels = pytest.importorskip("llamarl.engines.triton_kernels", reason="needs triton")
    from llamarl.engines.static_sampling import SlotRecords

    logits = torch.randn((7, 151936), generator=torch.Generator().manual_seed(0)) * 3
    tokens, lps = triton_kernels.greedy(logits.cuda())
    expected_tokens, expected_lps = torch.ops.llamarl.greedy(logits)
    assert tokens.cpu().tolist() == expected_tokens.tolist()
    torch.testing.assert_close(lps.cpu(), expected_lps, rtol=0, atol=1e-4)
    states = []
    for device in ("cuda", "cpu"):
        r = SlotRecords(slots=6, width=16, vocab=151936, device=torch.device(device))
        r.begin([int(expected_tokens[0])])
        r.admit(torch.arange(6, device=device), bases=[2, 3, 4, 5, 6, 7], limits=[5, 1, 5, 5, 5, 5], uniforms=None)
        fed = torch.arange(6, device=device)
        positions = torch.tensor([2, 3, 4, 5, 6, 7], device=device)
        args = {"ids": r.ids[:6], "rec_lps": r.lps[:6], "alive": r.alive[:6], "stopped": r.stopped[:6],
                "overflow": r.overflow[:6], "end": r.end[:6], "is_stop": r.is_stop, "fed": fed, "positions": positions}
        toks, lp = expected_tokens[:6].to(device), expected_lps[:6].to(device)
        if device == "cuda":
            triton_kernels.book(toks, lp, None, **args)
        else:
            torch.ops.llamarl.book(toks, lp, None, *args.values())
        states.append([t.cpu() for t in (r.ids, r.lps, r.alive, r.stopped, fed, positions)])
    for got, expected in zip(*states):
        assert torch.equal(got, expected)


@pytest.mark.parametrize("family", ["llama-tied", "qwen2", "qwen3", "mistral", "gemma2"])
def test_the_captured_step_with_fused_kernels_gives_the_aten_steps_tokens(family):
    model = build_family(family).cuda()
    pad = chat_tokenizer().pad_token_id
    assert StaticDecoder(model).kernels is step_kernels.FUSED_KERNELS  # the choice on CUDA, Triton imported
    outs = {}
    for kernels in ("fused", "torch"):
        engine = TorchEngine(model, eos_token_ids=[], pad_token_id=pad, static_decode="eager")
        engine._static = StaticDecoder(model, kernels=kernels)
        outs[kernels] = engine.generate(requests(), sampling=SamplingParams(temperature=0.0, max_new_tokens=12),
                                        version=1)
        assert engine._static.cuda_graphs and engine._static.num_captures > 0
    assert [c.completion_ids for c in outs["fused"]] == [c.completion_ids for c in outs["torch"]]
    for a, b in zip(outs["fused"], outs["torch"]):
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), rtol=0, atol=1e-4)
