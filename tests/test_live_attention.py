"""Issue 45 item 3: the static decode step's attention reads the live KV, not the state's width
(llamarl/engines/static_shapes.py: ``span_rung``; static_decode.py: ``StaticDecoder.attention_span``, the decode
loop's span at each look). The work is counted on the CPU: every attention op's (query rows x key
columns), from the shapes the step hands the kernel; on a GPU the kernel's time follows them."""

from __future__ import annotations

import pytest
import torch
from model_families import build_family, chat_tokenizer
from test_fused_decode import requests, staggered
from torch.utils._python_dispatch import TorchDispatchMode

from llamarl.engines.base import SamplingParams
from llamarl.engines.static_decode import StaticDecoder, span_rung
from llamarl.engines.torch_engine import TorchEngine


class AttentionWork(TorchDispatchMode):
    """Sums, over the aten attention ops dispatched, 4 x queries x key columns x head dim: the
    multiply-adds of the scores and of the weighted values, whatever kernel CPU SDPA picks."""

    def __init__(self) -> None:
        super().__init__()
        self.flops = 0
        self.calls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if "attention" in func.__name__:
            q, k = args[0], args[1]
            self.flops += 4 * q.shape[:-1].numel() * k.shape[-2] * q.shape[-1]
            self.calls += 1
        return func(*args, **(kwargs or {}))


def static_engine(model) -> TorchEngine:
    built = TorchEngine(model, eos_token_ids=[], pad_token_id=chat_tokenizer().pad_token_id, fused_decode=False,
                        static_decode="eager", eos_check_every=4)
    built._static = StaticDecoder(model, compiled=False)
    return built


def work_of_a_call(model, *, width: int, sampling: SamplingParams) -> tuple[int, list]:
    """Attention work of one ``generate`` on a static engine whose state is ``width`` columns
    wide (reserved before the call, which fits in it), and the completions."""
    built = static_engine(model)
    built.static_decoder.reserve(capacity=4, positions=width)
    assert built.static_decoder.state.width == width
    counter = AttentionWork()
    with counter:
        out = built.generate(requests(), sampling=sampling, version=1, generator=torch.Generator().manual_seed(0))
    assert built.static_decoder.state.width == width and counter.calls > 0
    return counter.flops, out


@pytest.mark.parametrize("sampling", [SamplingParams(temperature=0.0, max_new_tokens=12),
                                      SamplingParams(temperature=1.0, max_new_tokens=12)])
def test_doubling_the_width_at_the_same_live_lengths_leaves_the_attention_work(sampling):
    """Issue 45: the attention scored every column of the state's power-of-two width behind a
    mask, so a wider state (a longer call before, a larger ``positions``) doubled its work at the
    same live tokens; it now reads the bucket's live span, the tokens unchanged."""
    model = build_family("llama-untied")
    work, outputs = {}, {}
    for width in (256, 512, 1024):
        work[width], outputs[width] = work_of_a_call(model, width=width, sampling=sampling)
    assert abs(work[512] / work[256] - 1) < 0.05 and abs(work[1024] / work[256] - 1) < 0.05, work
    for width in (512, 1024):
        assert [c.completion_ids for c in outputs[width]] == [c.completion_ids for c in outputs[256]]
        for a, b in zip(outputs[width], outputs[256]):
            torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), rtol=0, atol=1e-5)


@pytest.mark.parametrize("family", ["llama-tied", "qwen2", "qwen3"])
def test_a_step_over_its_span_gives_the_whole_widths_logits(family):
    """CPU reference: attending only the span gives what attending the whole width behind the
    position mask gave (the step as it was), fp32 within 1e-5, with rows at very different positions."""
    model = build_family(family)
    decoder = StaticDecoder(model, compiled=False)
    state = decoder.new_state(capacity=8, positions=512)
    generator = torch.Generator().manual_seed(0)
    for cache in state.caches:
        cache.copy_(torch.randn(cache.shape, generator=generator))
    state.tokens.copy_(torch.randint(0, model.config.vocab_size, (8,), generator=generator))
    state.positions.copy_(torch.tensor([0, 3, 63, 64, 100, 17, 129, 5]))
    columns = decoder.attention_span(state, 8, steps=1)
    assert columns == 192 < state.width
    caches = [c.clone() for c in state.caches]
    full = decoder.step(state, 8).clone()
    written = [c.clone() for c in state.caches]
    for cache, before in zip(state.caches, caches):
        cache.copy_(before)
    spanned = decoder.step(state, 8, span=columns)
    torch.testing.assert_close(spanned, full, rtol=0, atol=1e-5)
    for cache, expected in zip(state.caches, written):  # the same keys and values written
        torch.testing.assert_close(cache, expected, rtol=0, atol=0)


def test_span_rungs():
    assert [span_rung(n, 4096) for n in (1, 64, 65, 130, 512, 513, 600, 1025, 3000)] == \
        [64, 64, 128, 192, 512, 576, 640, 1152, 3072]
    assert span_rung(700, 512) == 512  # never past the width
    waste = max((span_rung(n, 1 << 20) - n) / n for n in range(513, 8193))
    assert waste <= 0.125
    with pytest.raises(ValueError, match="at least one column"):
        span_rung(0, 64)
    decoder = StaticDecoder(build_family("llama-tied"), compiled=False)
    state = decoder.new_state(capacity=2, positions=256)
    with pytest.raises(ValueError, match="span_rung"):
        decoder.step(state, 2, span=100)


def test_the_loop_steps_over_live_spans_only():
    """The loop asks a span at each look; the spans follow the rows' positions."""
    model = build_family("llama-tied")
    built = static_engine(model)
    built.static_decoder.reserve(capacity=4, positions=1024)
    seen = []
    step = StaticDecoder.step

    def recording(self, state, rows, **kw):
        seen.append(kw.get("span"))
        return step(self, state, rows, **kw)

    StaticDecoder.step = recording
    try:
        built.generate(staggered(), sampling=SamplingParams(temperature=0.0, max_new_tokens=12), version=1)
    finally:
        StaticDecoder.step = step
    assert seen and set(seen) == {64}, seen


def test_the_fused_kernels_attention_needs_no_span():
    """The fused set's attention reads each row's own live columns (llamarl/engines/step_kernels.py,
    ``reads_live_columns``; the kernel's visits: tests/test_triton_kernels.py): the loop steps at
    the state's width, one graph per bucket instead of one per (bucket, span), with no host read
    for a span, and the tokens are the aten set's."""
    model = build_family("llama-tied")
    outs, seen = {}, {}
    step = StaticDecoder.step

    for kernels in ("fused", "torch"):
        built = static_engine(model)
        built._static = StaticDecoder(model, compiled=False, kernels=kernels)
        built.static_decoder.reserve(capacity=4, positions=1024)
        spans = seen[kernels] = []

        def recording(self, state, rows, _spans=spans, **kw):
            _spans.append(kw.get("span"))
            return step(self, state, rows, **kw)

        StaticDecoder.step = recording
        try:
            outs[kernels] = built.generate(staggered(), sampling=SamplingParams(temperature=0.0, max_new_tokens=12),
                                           version=1)
        finally:
            StaticDecoder.step = step
    assert set(seen["fused"]) == {1024} and set(seen["torch"]) == {64}, seen
    assert [c.completion_ids for c in outs["fused"]] == [c.completion_ids for c in outs["torch"]]
    for a, b in zip(outs["fused"], outs["torch"]):
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), rtol=0, atol=1e-5)
