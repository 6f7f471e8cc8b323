"""Issue 45 item 4: sampling and bookkeeping inside the static step's CUDA graph
(llamarl/engines/static_sampling.py): between two looks a decode step is one graph replay and no
eager op; the draws and log-probs are those of llamarl/engines/sampling.py for the same uniforms
(greedy, temperature, top-k, top-p, any vocabulary size); top-p sorts no full vocabulary, and a
row whose candidates fall short stalls until the drain gives it more, exactly."""

from __future__ import annotations

import pytest
import torch
from fake_cuda import FakeCudaGraphs, OpCounter
from model_families import build_family, chat_tokenizer
from test_fused_decode import requests
from torch.utils._python_dispatch import TorchDispatchMode

from llamarl.engines import sampling as sampling_module
from llamarl.engines import static_decode
from llamarl.engines.base import SamplingParams
from llamarl.engines.sampling import _draw, sample_tokens
from llamarl.engines.scheduler import Scheduler
from llamarl.engines.static_decode import StaticDecoder
from llamarl.engines.static_sampling import draw, sample, sampling_key
from llamarl.engines.torch_engine import TorchEngine

SETTINGS = [SamplingParams(temperature=0.0, max_new_tokens=12), SamplingParams(temperature=1.0, max_new_tokens=12),
            SamplingParams(temperature=0.7, max_new_tokens=12),
            SamplingParams(temperature=1.0, top_p=0.9, max_new_tokens=12),
            SamplingParams(temperature=0.8, top_k=7, top_p=0.95, max_new_tokens=12),
            SamplingParams(temperature=1.0, top_k=3, max_new_tokens=12)]


def graph_engine(model, kernels: str | None = None, **kw) -> TorchEngine:
    built = TorchEngine(model, eos_token_ids=[], pad_token_id=chat_tokenizer().pad_token_id, fused_decode=False,
                        static_decode="eager", **kw)
    built._static = StaticDecoder(model, compiled=False, kernels=kernels)
    built._static.cuda_graphs = True  # the fakes stand in for the device
    return built


def host_sampled_engine(model, kernels: str | None = None, **kw) -> TorchEngine:
    """The same graphs of the forward, sampled on the host by sample_tokens with decode_loop's
    eager books (the static path before item 4): the same logits, so the same tokens exactly."""
    built = graph_engine(model, kernels, **kw)
    built._static.samples_in_step = False
    return built


def hf_engine(model, **kw) -> TorchEngine:
    return TorchEngine(model, eos_token_ids=[], pad_token_id=chat_tokenizer().pad_token_id, fused_decode=False,
                       static_decode="off", **kw)


def generate(built, reqs, sampling, seed=0):
    return built.generate(reqs, sampling=sampling, version=1, generator=torch.Generator().manual_seed(seed))


def assert_same(got, expected) -> None:
    assert [c.completion_ids for c in got] == [c.completion_ids for c in expected]
    assert [c.finish_reason for c in got] == [c.finish_reason for c in expected]
    for a, b in zip(got, expected):
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), rtol=0, atol=1e-5)


@pytest.mark.parametrize("vocab", [1000, 4096, 151936])
@pytest.mark.parametrize("setting", SETTINGS, ids=lambda s: f"T{s.temperature}-p{s.top_p}-k{s.top_k}")
def test_the_graphs_sampler_draws_what_sample_tokens_draws(vocab, setting):
    generator = torch.Generator().manual_seed(vocab)
    logits = torch.randn((32, vocab), generator=generator) * 3
    uniforms = torch.rand(32, generator=generator, dtype=torch.float64)
    expected = sample_tokens(logits, sampling=setting, uniforms=uniforms)
    tokens, lps, ok = sample(logits, uniforms, sampling_key(setting, vocab=vocab, candidates=vocab))
    assert ok is None
    assert tokens.tolist() == expected[0].tolist()
    torch.testing.assert_close(lps, expected[1], rtol=0, atol=1e-6)
    if setting.top_p < 1.0:  # few candidates: the rows they hold draw the same, the others say so
        logits[:16, 3] += 40.0  # half the rows: one token holds nearly all the mass
        expected = sample_tokens(logits, sampling=setting, uniforms=uniforms)
        tokens, lps, ok = sample(logits, uniforms, sampling_key(setting, vocab=vocab, candidates=16))
        assert ok is not None and bool(ok[:16].all())
        assert setting.top_k or not bool(ok[16:].all())  # top-k = 7 < 16: every row's mass is in its candidates
        assert tokens[ok].tolist() == expected[0][ok].tolist()


@pytest.mark.parametrize("vocab", [1000, 151936, 49157])
def test_the_unpadded_draw_is_the_padded_one(vocab):
    generator = torch.Generator().manual_seed(1)
    probs = torch.rand((64, vocab), generator=generator) ** 8
    probs[:, ::7] = 0.0  # filtered-out tokens: never drawn
    uniforms = torch.rand(64, generator=generator, dtype=torch.float64)
    assert draw(probs, uniforms).tolist() == _draw(probs, uniforms).tolist()


def _phases(monkeypatch, counter: OpCounter) -> None:
    """Label the ops of the decoder's step ("step") and of the loop's looks ("look")."""
    step, look = StaticDecoder.step, Scheduler.look

    def counted_step(self, state, rows, **kw):
        with counter.phase("step"):
            return step(self, state, rows, **kw)

    def counted_look(self):
        with counter.phase("look"):
            return look(self)

    monkeypatch.setattr(StaticDecoder, "step", counted_step)
    monkeypatch.setattr(Scheduler, "look", counted_look)
    span = getattr(StaticDecoder, "attention_span", None)
    if span is not None:
        def counted_span(self, *a, **kw):
            with counter.phase("look"):
                return span(self, *a, **kw)

        monkeypatch.setattr(StaticDecoder, "attention_span", counted_span)


@pytest.mark.parametrize("setting", SETTINGS[:5], ids=lambda s: f"T{s.temperature}-p{s.top_p}-k{s.top_k}")
def test_a_step_runs_no_op_outside_its_graph_but_the_looks(monkeypatch, setting):
    """Issue 45: ~44 eager ops a step ran outside the graph (the sampler and the scheduler's
    books). Now: 0 a step; the looks (every ``eos_check_every`` steps) drain the records."""
    FakeCudaGraphs(monkeypatch)
    monkeypatch.setattr(sampling_module, "host_reads_are_free", lambda device: False)  # as on an accelerator
    model = build_family("llama-tied")
    built = graph_engine(model, eos_check_every=4)
    counter = OpCounter()
    _phases(monkeypatch, counter)
    outside, steps = {}, {}
    generate(built, requests(), setting)  # the state made, the fused buffers, the first captures
    for new_tokens in (8, 16):
        counter.ops.clear()
        counter.reads.clear()
        before = built.static_decoder.num_steps
        with counter:
            generate(built, requests(), SamplingParams(temperature=setting.temperature, top_p=setting.top_p,
                                                       top_k=setting.top_k, max_new_tokens=new_tokens))
        outside[new_tokens] = counter.ops.get("other", 0)
        steps[new_tokens] = built.static_decoder.num_steps - before
        assert counter.reads.get("step", 0) == 0 and counter.reads.get("other", 0) <= 6, counter.reads
    assert steps[16] > steps[8]
    assert (outside[16] - outside[8]) / (steps[16] - steps[8]) == 0, (outside, steps)


@pytest.mark.parametrize("kernels", ["torch", "fused"])
@pytest.mark.parametrize("setting", SETTINGS, ids=lambda s: f"T{s.temperature}-p{s.top_p}-k{s.top_k}")
def test_replayed_steps_give_the_hf_loops_tokens(monkeypatch, setting, kernels):
    """Same uniforms, same tokens: the graphs' draws against the same replayed forward sampled on
    the host by sample_tokens, rows ending at different steps (compaction), a stop id, continuous
    batching; log-probs within 1e-6. With either kernel set (the fused set's greedy draw and books
    are one op each: llamarl/engines/step_kernels.py)."""
    FakeCudaGraphs(monkeypatch)
    model = build_family("qwen2")
    free = generate(host_sampled_engine(model, kernels), requests(), setting, seed=5)
    stops = [next(t for t in free[1].completion_ids[3:] if t not in (11, 12, 13))]
    for kw in ({"eos_check_every": 3}, {"eos_check_every": 2, "max_num_seqs": 2}):
        reference = host_sampled_engine(model, kernels, **kw)
        built = graph_engine(model, kernels, **kw)
        reference.eos_token_ids = built.eos_token_ids = stops
        expected = generate(reference, requests(), setting, seed=5)
        got = generate(built, requests(), setting, seed=5)
        assert_same(got, expected)
        for a, b in zip(got, expected):
            torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), rtol=0, atol=1e-6)
        assert built.static_decoder.num_steps > 0
    assert "stop" in [c.finish_reason for c in got]


def test_top_p_candidates_that_fall_short_stall_the_row_and_grow(monkeypatch):
    """With 2 candidates first, rows whose top-2 hold < top_p stall; the drain grows the candidates
    (2, 16, 128, ...) and the stalled rows draw from the exact nucleus: HF's tokens."""
    fake = FakeCudaGraphs(monkeypatch)
    monkeypatch.setattr(static_decode, "FIRST_CANDIDATES", 2)
    model = build_family("llama-untied")
    setting = SamplingParams(temperature=1.0, top_p=0.95, max_new_tokens=12)
    built = graph_engine(model, eos_check_every=2)
    assert_same(generate(built, requests(), setting), generate(host_sampled_engine(model), requests(), setting))
    key = built.static_decoder.sampling_key(setting)
    assert key[3] > 2  # grown (this random model's distributions are flat: up to the vocabulary)
    # A graph of fewer candidates than the vocabulary sorts none: a top-k of the candidates.
    searched = [graph.kernels for (_, _, graph_key), (graph, _) in built.static_decoder.state.graphs.items()
                if graph_key[3] < model.config.vocab_size]
    assert searched and all("sort.values_stable" not in k and "sort.default" not in k and "topk.default" in k
                            for k in searched)
    assert fake.captures >= len(searched)


class Pads(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func is torch.ops.aten.constant_pad_nd.default
        return func(*args, **(kwargs or {}))


def test_any_vocabulary_size_without_a_per_step_pad(monkeypatch):
    """A vocabulary that is no multiple of the draw's block (Qwen's 151,936) was padded and copied
    every step (sampling._draw); the replayed steps pad nothing (the prefill's draw, at a look,
    still does) and draw sample_tokens' tokens."""
    FakeCudaGraphs(monkeypatch)
    model = build_family("llama-untied")
    with torch.no_grad():
        head = torch.nn.Linear(model.config.hidden_size, 49157, bias=False)
        head.weight.copy_(torch.randn(head.weight.shape, generator=torch.Generator().manual_seed(0)) * 0.05)
    model.lm_head = head
    model.config.vocab_size = 49157
    built, reference = graph_engine(model, eos_check_every=4), host_sampled_engine(model, eos_check_every=4)
    pads = {}
    for new_tokens in (4, 4, 12):
        setting = SamplingParams(temperature=1.0, max_new_tokens=new_tokens)
        counter = Pads()
        with counter:
            got = generate(built, requests(), setting)
        pads[new_tokens] = counter.count
        assert_same(got, generate(reference, requests(), setting))
    assert pads[12] == pads[4], pads
