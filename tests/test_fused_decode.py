"""The fused decode step (llamarl/engines/cpu/fused_decode.py) against the HF modules' loop it replaces:
fp32 greedy and seeded sampling give the same tokens, log-probs agree to rounding, for every
family it supports, with left padding, shared prompts, carried-in tokens (rows finishing at
different steps) and an in-place weight update between calls; the others fall back. Continuous
batching (``max_num_seqs``) keeps the batch full with the same tokens; a kept carried cache
(``carried_cache="keep"``) resumes without prefill from the older keys, as HF's modules do."""

from __future__ import annotations

import pytest
import torch
from model_families import build_family, chat_tokenizer

from llamarl.engines.base import Request, SamplingParams
from llamarl.engines.cpu.fused_decode import FusedDecoder
from llamarl.engines.kv_slots import KVSlots
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


@pytest.mark.parametrize("family", ["llama-tied", "llama-untied", "qwen2", "qwen3", "mistral"])
def test_fused_steps_give_the_hf_loops_tokens(family, monkeypatch):
    model = build_family(family)
    assert FusedDecoder.supports(model, length=100)
    steps, shared = [], []
    step = FusedDecoder.step
    monkeypatch.setattr(FusedDecoder, "step", lambda self, *a, **k: steps.append(1) or step(self, *a, **k))
    # fp32: the CPU step is the CUDA graphs' own step (static_step.static_forward), run eagerly.
    from llamarl.engines.cpu import fused_decode

    forward = fused_decode.static_forward
    monkeypatch.setattr(fused_decode, "static_forward", lambda *a: shared.append(1) or forward(*a))
    for sampling in (SamplingParams(temperature=0.0, max_new_tokens=12),
                     SamplingParams(temperature=1.0, max_new_tokens=12)):
        steps.clear()
        hf = run(model, fused=False, sampling=sampling)
        assert not steps
        fused = run(model, fused=True, sampling=sampling)
        assert len(steps) == 11 == len(shared)  # every decode step after the prefill's token: fused, shared
        shared.clear()
        assert [c.completion_ids for c in fused] == [c.completion_ids for c in hf], sampling
        assert [len(c.completion_ids) for c in fused] == [12, 12, 12, 12]
        for f, h in zip(fused, hf):
            torch.testing.assert_close(torch.tensor(f.logprobs), torch.tensor(h.logprobs), rtol=0, atol=1e-5)


@pytest.mark.parametrize("family", ["llama-untied", "qwen3"])
def test_an_in_place_weight_update_reaches_the_next_call(family):
    model = build_family(family)
    engine = TorchEngine(model, eos_token_ids=[], pad_token_id=chat_tokenizer().pad_token_id)
    greedy = SamplingParams(temperature=0.0, max_new_tokens=8)
    before = engine.generate(requests(), sampling=greedy, version=0)
    with torch.no_grad():
        for layer in model.model.layers:  # what a weight channel does: copy_ into the live tensors
            if family == "qwen3":  # the per-head norms alone: written in place, and one module replaced
                layer.self_attn.k_norm.weight.copy_(torch.randn_like(layer.self_attn.k_norm.weight))
                q_norm = type(layer.self_attn.q_norm)(model.config.head_dim, eps=model.config.rms_norm_eps)
                layer.self_attn.q_norm = q_norm.requires_grad_(False)
                q_norm.weight.copy_(torch.randn_like(q_norm.weight))
            else:
                layer.mlp.up_proj.weight.copy_(torch.randn_like(layer.mlp.up_proj.weight))
                layer.self_attn.v_proj.weight.mul_(-1.0)
    after = engine.generate(requests(), sampling=greedy, version=1)
    reference = run(model, fused=False, sampling=greedy)
    assert [c.completion_ids for c in after] == [c.completion_ids for c in reference]
    assert [c.completion_ids for c in after] != [c.completion_ids for c in before]


def test_other_layouts_use_the_hf_modules():
    assert not FusedDecoder.supports(build_family("gemma2"), length=100)  # soft-capping, alternating windows
    qwen3 = build_family("qwen3")  # its q / k norms run in the step, but only as the RMSNorms it knows
    assert FusedDecoder.supports(qwen3, length=100)
    k_norm = qwen3.model.layers[1].self_attn.k_norm
    k_norm.variance_epsilon *= 2  # the C attention takes one epsilon for a layer's two norms
    assert not FusedDecoder.supports(qwen3, length=100)
    k_norm.variance_epsilon /= 2
    qwen3.model.layers[1].self_attn.k_norm = torch.nn.LayerNorm(32)
    assert not FusedDecoder.supports(qwen3, length=100)
    mistral = build_family("mistral")  # a sliding window shorter than the sequence changes attention
    assert FusedDecoder.supports(mistral, length=4096) and not FusedDecoder.supports(mistral, length=4097)


def staggered() -> list[Request]:
    """Four requests that finish at different steps (carried-in tokens of different lengths)."""
    tok = chat_tokenizer()
    short, long = tok("2 + 2 =")["input_ids"], tok("Write the product of 347 and 23, then stop.")["input_ids"]
    return [Request(sample_id=i, prompt_ids=prompt, completion_ids=[11] * carried, logprobs=[-1.0] * carried,
                    versions=[0] * carried)
            for i, (prompt, carried) in enumerate([(short, 0), (long, 7), (long, 0), (short, 4)])]


def test_continuous_batching_refills_finished_rows_with_the_same_tokens(monkeypatch):
    model = build_family("llama-tied")
    greedy = SamplingParams(temperature=0.0, max_new_tokens=12)
    pad = chat_tokenizer().pad_token_id
    rows_per_step = []
    step = FusedDecoder.step
    monkeypatch.setattr(FusedDecoder, "step", lambda self, state, rows, **k: rows_per_step.append(
        rows) or step(self, state, rows, **k))
    whole = TorchEngine(model, eos_token_ids=[], pad_token_id=pad).generate(staggered(), sampling=greedy, version=1)
    assert max(rows_per_step) == 4
    rows_per_step.clear()
    capped = TorchEngine(model, eos_token_ids=[], pad_token_id=pad, max_num_seqs=2)
    refilled = capped.generate(staggered(), sampling=greedy, version=1)
    # Requests 0 and 1 start (12 and 5 tokens to go, each first token from its prefill); request 1
    # ends at its 5th token (step 4) and request 2 takes its slot, its first token drawn from its
    # prefill and fed with request 0's next at step 5; request 0 ends at step 11 and request 3 (8 to
    # go) takes its slot; request 2 ends at step 15, then request 3 alone: 18 steps of 2 rows but 3,
    # where two batches of 2 take 11 + 11.
    assert rows_per_step == [2] * 15 + [1] * 3, rows_per_step
    assert [c.completion_ids for c in refilled] == [c.completion_ids for c in whole]
    for a, b in zip(refilled, whole):
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), rtol=0, atol=1e-5)
    hf_waves = TorchEngine(model, eos_token_ids=[], pad_token_id=pad, max_num_seqs=2, fused_decode=False)
    assert [c.completion_ids for c in hf_waves.generate(staggered(), sampling=greedy, version=1)] == \
        [c.completion_ids for c in whole]


def _greedy_with_stale_prefix(model, *, old_state, request, num_tokens: int) -> list[int]:
    """Reference for a kept cache, from HF's modules alone: the context but its last token cached
    under ``old_state``'s weights, then greedy decoding with the model's current weights."""
    from transformers import DynamicCache

    new_state = {k: v.clone() for k, v in model.state_dict().items()}
    context = list(request.prompt_ids) + list(request.completion_ids)
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model.load_state_dict(old_state)
        model(input_ids=torch.tensor([context[:-1]]), past_key_values=cache, use_cache=True)
        model.load_state_dict(new_state)
        tokens, last = [], context[-1]
        for position in range(len(context) - 1, len(context) - 1 + num_tokens):
            logits = model(input_ids=torch.tensor([[last]]), position_ids=torch.tensor([[position]]),
                           past_key_values=cache, use_cache=True).logits[0, -1]
            last = int(logits.argmax())
            tokens.append(last)
    return tokens


def test_a_kept_carried_cache_resumes_without_prefill_and_from_the_older_keys():
    model = build_family("llama-untied")
    greedy = SamplingParams(temperature=0.0, max_new_tokens=12)
    pad = chat_tokenizer().pad_token_id
    uninterrupted = TorchEngine(model, eos_token_ids=[], pad_token_id=pad).generate(
        staggered(), sampling=greedy, version=0)
    engines = {mode: TorchEngine(model, eos_token_ids=[], pad_token_id=pad, carried_cache=mode, max_num_seqs=3)
               for mode in ("recompute", "keep")}
    carried = {mode: e.generate(staggered(), sampling=greedy, version=0, token_budget=3) for mode, e in engines.items()}
    assert [c.finish_reason for c in carried["keep"]] == ["carried"] * 4

    # Same weights: resuming from the kept cache gives the uninterrupted tokens, with no prefill.
    engine = engines["keep"]
    before = engine.prefill_tokens
    resumed = engine.generate([c.to_request() for c in carried["keep"]], sampling=greedy, version=0)
    assert engine.prefill_tokens == before and engine.kept_cache_rows == 4
    assert [c.completion_ids for c in resumed] == [c.completion_ids for c in uninterrupted]

    # New weights: "keep" continues from the older keys and values (HF's own modules agree),
    # "recompute" from a fresh prefill; each token keeps the version that sampled it.
    carried = {mode: e.generate(staggered(), sampling=greedy, version=0, token_budget=3) for mode, e in engines.items()}
    old_state = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.k_proj.weight.mul_(1.5)
            layer.self_attn.v_proj.weight.mul_(-1.0)
    resumed = {mode: engines[mode].generate([c.to_request() for c in carried[mode]], sampling=greedy, version=1)
               for mode in engines}
    first = carried["keep"][0]
    expected = _greedy_with_stale_prefix(model, old_state=old_state, request=first.to_request(), num_tokens=9)
    assert resumed["keep"][0].completion_ids[3:] == expected
    assert resumed["keep"][0].completion_ids != resumed["recompute"][0].completion_ids
    for mode, outs in resumed.items():
        for out, request in zip(outs, staggered()):
            num_old = len(request.completion_ids) + 3  # carried in, then 3 sampled at version 0
            assert out.versions == [0] * num_old + [1] * (len(out.completion_ids) - num_old), mode


def test_a_kept_cache_that_no_longer_matches_is_dropped_and_recomputed():
    model = build_family("llama-tied")
    greedy = SamplingParams(temperature=0.0, max_new_tokens=12)
    engine = TorchEngine(model, eos_token_ids=[], pad_token_id=chat_tokenizer().pad_token_id, carried_cache="keep")
    carried = engine.generate(staggered()[:1], sampling=greedy, version=0, token_budget=3)
    restarted = staggered()[:1]  # the same sample restarted from its prompt (a stale group)
    before = engine.prefill_tokens
    again = engine.generate(restarted, sampling=greedy, version=0, token_budget=3)
    assert engine.prefill_tokens == before + len(restarted[0].prompt_ids) and engine.kept_cache_rows == 0
    assert again[0].completion_ids == carried[0].completion_ids
    with pytest.raises(ValueError, match="carried_cache"):
        TorchEngine(model, eos_token_ids=[], pad_token_id=0, carried_cache="stale")


def test_kept_caches_admitted_mid_loop_leave_the_live_rows_logits_alone(monkeypatch):
    """bf16 on the C kernels, whose step writes its logits into a buffer kept for the next step: a
    kept cache admitted while rows are live runs a step of its own, which must not overwrite the
    live rows' logits before they are sampled (the same tokens as with a new tensor every step)."""
    from llamarl.engines.cpu import cpu_kernels, fused_decode

    if not cpu_kernels.available():
        pytest.skip("the C decode kernels could not be built here")
    model = build_family("llama-untied").to(torch.bfloat16)
    with torch.no_grad():  # peaked, context-dependent next-token distributions: a mix-up shows
        model.lm_head.weight.mul_(40.0)
    # Sampled, not greedy: a tiny random model's argmax is often the same token whatever the row.
    sampling = SamplingParams(temperature=1.0, max_new_tokens=12)
    pad = chat_tokenizer().pad_token_id
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the native step at any row count
    try:
        resumed, default = {}, fused_decode._LOGITS_KEPT
        for kept_logits in (default, 0):
            monkeypatch.setattr(fused_decode, "_LOGITS_KEPT", kept_logits)
            engine = TorchEngine(model, eos_token_ids=[], pad_token_id=pad, carried_cache="keep", max_num_seqs=3)
            carried = engine.generate(staggered(), sampling=sampling, version=0, token_budget=3,
                                      generator=torch.Generator().manual_seed(1))
            resumed[kept_logits] = engine.generate([c.to_request() for c in carried], sampling=sampling, version=0,
                                                   generator=torch.Generator().manual_seed(2))
            assert engine.kept_cache_rows == 4  # the fourth admitted once a row finished, the others live
    finally:
        torch.set_num_threads(threads)
    assert [c.completion_ids for c in resumed[default]] == [c.completion_ids for c in resumed[0]]


def test_the_c_step_reserves_the_cache_once_and_gives_the_same_tokens(monkeypatch):
    """bf16 on the C kernels (whose attention reads each row's own positions only): the decode's
    cache is sized once, for the longest context a row can reach, instead of widened mid-way (a copy
    of every layer's cache), with the same tokens and log-probs as when it grows step by step; the
    PyTorch step (fp32), which attends over every allocated column, still grows it as rows need."""
    from llamarl.engines.cpu import cpu_kernels

    if not cpu_kernels.available():
        pytest.skip("the C decode kernels could not be built here")
    widths = []
    reserve = KVSlots.grow

    def spy(self, width):
        before = self.width
        reserve(self, width)
        if self.width != before:
            widths.append(self.width)

    monkeypatch.setattr(KVSlots, "grow", spy)
    model = build_family("llama-tied").to(torch.bfloat16)
    sampling = SamplingParams(temperature=1.0, max_new_tokens=80)  # past 64 columns: one widening at least
    pad = chat_tokenizer().pad_token_id
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the native step at any row count
    try:
        results = {}
        new_state = FusedDecoder.new_state

        def stepwise(self, *, capacity, like=None, positions=0):  # told nothing of the positions to come
            return new_state(self, capacity=capacity, like=like)

        for upfront in (True, False):
            if not upfront:
                monkeypatch.setattr(FusedDecoder, "new_state", stepwise)
            widths.clear()
            engine = TorchEngine(model, eos_token_ids=[], pad_token_id=pad)
            results[upfront] = engine.generate(requests(), sampling=sampling, version=0,
                                               generator=torch.Generator().manual_seed(3))
            longest = max(len(r.prompt_ids) + len(r.completion_ids) for r in requests()) + 80
            if upfront:
                assert widths == [-(-longest // 64) * 64], widths  # once, before the prefill is appended
            else:
                assert len(widths) >= 2 and widths[-1] >= longest, widths
    finally:
        torch.set_num_threads(threads)
    assert [c.completion_ids for c in results[True]] == [c.completion_ids for c in results[False]]
    assert [c.logprobs for c in results[True]] == [c.logprobs for c in results[False]]
    monkeypatch.undo()
    monkeypatch.setattr(KVSlots, "grow", spy)
    widths.clear()
    TorchEngine(build_family("llama-tied"), eos_token_ids=[], pad_token_id=pad).generate(
        requests(), sampling=sampling, version=0, generator=torch.Generator().manual_seed(3))
    assert len(widths) >= 2, widths  # fp32: the PyTorch step, whose cost grows with the width


def test_the_reservation_stops_at_its_byte_budget(monkeypatch):
    """A decode that could reach more than ``_RESERVED_CACHE`` bytes of cache reserves only that
    much at once (rows stopped by EOS never need the rest) and grows from there as before."""
    from llamarl.engines.cpu import cpu_kernels, fused_decode

    if not cpu_kernels.available():
        pytest.skip("the C decode kernels could not be built here")
    model = build_family("llama-tied").to(torch.bfloat16)
    decoder = FusedDecoder(model)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the native step at any row count: the reservation applies
    try:
        like = model.model.embed_tokens.weight
        per_column = 2 * model.config.num_hidden_layers * 4 * decoder.num_kv_heads * decoder.head_dim * 2
        assert decoder.new_state(capacity=4, like=like, positions=1000).width == 1024
        monkeypatch.setattr(fused_decode, "_RESERVED_CACHE", 100 * per_column)  # 100 columns of 4 rows
        state = decoder.new_state(capacity=4, like=like, positions=1000)
        assert state.width == 128  # 100 columns, rounded up to the cache's 64-column steps
        state.grow(500)
        assert state.width >= 500
    finally:
        torch.set_num_threads(threads)
