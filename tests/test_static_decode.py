"""The static-shape decode loop (llamarl/engines/static_decode.py, decode_loop.py) against the HF
modules' loop: fp32 greedy and seeded sampling give the same tokens, log-probs agree to rounding,
for every family it supports (tied and untied Llama, Qwen2, Qwen3, Mistral), with left padding,
shared prompts and carried-in tokens; the step traces as one graph per batch bucket with no graph
break and no recompile across steps or calls; EOS seen every k steps changes nothing but the steps
run; continuous batching and kept carried caches give what the fused loop gives. Most tests trace
with dynamo's ``eager`` backend (the graph, without generating code: seconds); one compiles with
inductor, as a user's ``--generator.torch.static-decode compiled`` does."""

from __future__ import annotations

import pytest
import torch
from model_families import build_family, chat_tokenizer
from test_fused_decode import _greedy_with_stale_prefix, requests, staggered

from llamarl.engines.base import SamplingParams
from llamarl.engines.static_decode import StaticDecoder, bucket, ladder
from llamarl.engines.torch_engine import TorchEngine

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=12)
SAMPLED = SamplingParams(temperature=1.0, max_new_tokens=12)


def engine(model, *, static: bool, backend: str = "eager", eos=(), kernels: str | None = None, **kw) -> TorchEngine:
    built = TorchEngine(model, eos_token_ids=list(eos), pad_token_id=chat_tokenizer().pad_token_id,
                        static_decode="compiled" if static else "off", fused_decode=False, **kw)
    if static:
        built._static = StaticDecoder(model, compiled=True, backend=backend, kernels=kernels)
    return built


def generate(built: TorchEngine, reqs, sampling, *, seed: int = 0, **kw):
    return built.generate(reqs, sampling=sampling, version=1, generator=torch.Generator().manual_seed(seed), **kw)


def assert_same(got, expected) -> None:
    assert [c.completion_ids for c in got] == [c.completion_ids for c in expected]
    assert [c.finish_reason for c in got] == [c.finish_reason for c in expected]
    for a, b in zip(got, expected):
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), rtol=0, atol=1e-5)


def graphs() -> int:
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


# The fused set on the families whose layers differ where its kernels do (Qwen3's head norms inside
# RoPE + store, Gemma2's sandwich norms, GELU and capped attention); Qwen2's biases and the fused
# projections are checked with it in tests/test_cuda_graph_proxies.py.
@pytest.mark.parametrize(("family", "kernels"), [
    *[(family, "torch") for family in ("llama-tied", "llama-untied", "qwen2", "qwen3", "mistral", "gemma2",
                                       "gemma2-eager")],
    *[(family, "fused") for family in ("llama-tied", "qwen3", "gemma2", "gemma2-eager")]])
def test_static_steps_give_the_hf_loops_tokens(family, kernels):
    """The shared step reproduces HF's loop for each family, with either kernel set
    (llamarl/engines/step_kernels.py; the fused set's ops run their CPU references here, traced by
    dynamo through their fake implementations); Gemma2 under ``sdpa`` (HF ignores the attention's
    soft cap there) and under ``eager`` (HF caps the scores: so does the step)."""
    model = build_family(family.removesuffix("-eager"))
    if family.endswith("-eager"):
        model.config._attn_implementation = "eager"
    assert StaticDecoder.supports(model, length=100)
    static = engine(model, static=True, kernels=kernels)
    for sampling in (GREEDY, SAMPLED):
        hf = generate(engine(model, static=False), requests(), sampling)
        got = generate(static, requests(), sampling)
        assert_same(got, hf)
        assert [len(c.completion_ids) for c in got] == [12, 12, 12, 12]
    assert static._static.num_steps > 0


def test_one_graph_per_bucket_and_no_recompile_across_steps_or_calls():
    model = build_family("llama-tied")
    static = engine(model, static=True, eos_check_every=2)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    # Rows with 12, 5, 12 and 8 tokens to go: bucket 4, then compacted to 2 when one has ended.
    first = generate(static, staggered(), SAMPLED)
    assert graphs() == 2, torch._dynamo.utils.counters["stats"]
    steps = static._static.num_steps
    assert steps >= 11
    again = generate(static, staggered(), SAMPLED)
    assert graphs() == 2 and static._static.num_steps == 2 * steps  # the same graphs, nothing retraced
    assert_same(again, first)
    assert_same(first, generate(engine(model, static=False), staggered(), SAMPLED))


def test_an_inductor_compiled_step_gives_the_same_tokens():
    model = build_family("llama-untied")
    reqs = requests()[:2]
    hf = generate(engine(model, static=False), reqs, SAMPLED)
    compiled = engine(model, static=True, backend="inductor")
    assert_same(generate(compiled, reqs, SAMPLED), hf)


def test_finished_rows_seen_every_k_steps_change_only_the_steps_run():
    model = build_family("llama-untied")
    sampling = SamplingParams(temperature=1.0, max_new_tokens=12)
    free = generate(engine(model, static=False), staggered(), sampling, seed=3)
    # Stop ids sampled early by two rows (a row's 2nd token, another's 5th): rows stop at different steps.
    stops = [free[0].completion_ids[1], free[2].completion_ids[4]]
    hf = generate(engine(model, static=False, eos=stops), staggered(), sampling, seed=3)
    assert {c.finish_reason for c in hf} == {"stop", "length"}, [c.finish_reason for c in hf]
    steps = {}
    for every in (1, 4, 64):
        static = engine(model, static=True, eos=stops, eos_check_every=every)
        assert_same(generate(static, staggered(), sampling, seed=3), hf)
        steps[every] = static._static.num_steps
    # Looking every step stops at the longest row; looking every 64 runs to the next look's step
    # bound (here every row's limit) in the full bucket.
    assert steps[1] < steps[4] <= steps[64]


def test_continuous_batching_refills_free_slots_with_the_same_tokens(monkeypatch):
    model = build_family("llama-tied")
    whole = generate(engine(model, static=False), staggered(), SAMPLED)
    prefilled = []
    prefill = TorchEngine._prefill_into  # packed, straight into the state (packed_prefill.py)
    monkeypatch.setattr(TorchEngine, "_prefill_into", lambda self, state, slots, contexts: prefilled.append(
        len(contexts)) or prefill(self, state, slots, contexts))
    for every, cap in ((1, 2), (3, 2), (2, 3)):
        prefilled.clear()
        capped = engine(model, static=True, max_num_seqs=cap, eos_check_every=every)
        before = capped.prefill_tokens
        assert_same(generate(capped, staggered(), SAMPLED), whole)
        assert capped.prefill_tokens - before == sum(len(r.prompt_ids) + len(r.completion_ids) for r in staggered())
        # At most max_num_seqs rows at once, though a state of 3 rows has 4 slots (a bucket).
        assert prefilled[0] == cap and sum(prefilled) == 4, (cap, prefilled)


def test_a_kept_carried_cache_resumes_without_prefill_and_from_the_older_keys():
    model = build_family("llama-untied")
    uninterrupted = generate(engine(model, static=False), staggered(), GREEDY)
    # Rows end at their 3rd token, between two looks: their slots step twice more, as finished rows.
    keep = engine(model, static=True, carried_cache="keep", max_num_seqs=3, eos_check_every=4)
    carried = generate(keep, staggered(), GREEDY, token_budget=3)
    assert [c.finish_reason for c in carried] == ["carried"] * 4
    before = keep.prefill_tokens
    resumed = generate(keep, [c.to_request() for c in carried], GREEDY)
    assert keep.prefill_tokens == before and keep.kept_cache_rows == 4
    assert_same(resumed, uninterrupted)

    carried = generate(keep, staggered(), GREEDY, token_budget=3)
    old_state = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.k_proj.weight.mul_(1.5)
            layer.self_attn.v_proj.weight.mul_(-1.0)
    resumed = generate(keep, [c.to_request() for c in carried], GREEDY)
    expected = _greedy_with_stale_prefix(model, old_state=old_state, request=carried[0].to_request(), num_tokens=9)
    assert resumed[0].completion_ids[3:] == expected


def test_auto_takes_the_static_loop_on_cuda_only_and_other_layouts_fall_back():
    model = build_family("llama-tied")
    auto = TorchEngine(model, eos_token_ids=[], pad_token_id=0)
    generate(auto, requests(), GREEDY)
    assert auto._static is None  # CPU: the fused step
    assert auto._static_wanted(torch.device("cuda")) and not auto._static_wanted(torch.device("cpu"))
    gemma2 = build_family("gemma2")  # alternating 4,096-token windows: full attention up to 4,096 positions
    assert StaticDecoder.supports(gemma2, length=4096) and not StaticDecoder.supports(gemma2, length=4097)
    scaled = build_family("llama-tied")  # frequencies that depend on the longest position: HF's modules
    scaled.config.rope_parameters = {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}
    assert not StaticDecoder.supports(scaled, length=100)
    mistral = build_family("mistral")
    assert StaticDecoder.supports(mistral, length=4096) and not StaticDecoder.supports(mistral, length=4097)
    with pytest.raises(ValueError, match="static_decode"):
        TorchEngine(model, eos_token_ids=[], pad_token_id=0, static_decode="graphs")
    with pytest.raises(ValueError, match="eos_check_every"):
        TorchEngine(model, eos_token_ids=[], pad_token_id=0, eos_check_every=0)


def test_the_bucket_ladder_pads_at_most_an_eighth_above_64_rows():
    """Issue 45: a step's cost grows with its bucket; powers of two ran 65 rows as 128 (49 % padding)
    and 257 as 512. From 65 to 512 live rows the padded rows are at most 12.5 % of the live ones."""
    waste = {rows: (bucket(rows) - rows) / rows for rows in range(65, 513)}
    worst = max(waste, key=waste.get)
    assert waste[worst] <= 0.125, (worst, bucket(worst), waste[worst])
    assert all(bucket(rows) >= rows and bucket(bucket(rows)) == bucket(rows) for rows in range(1, 1025))
    assert ladder(512)[:8] == [1, 2, 4, 8, 16, 32, 48, 64] and ladder(512)[-2:] == [496, 512]
    assert ladder(300)[-1] == bucket(300) == 304 and ladder(3) == [1, 2, 4] and len(ladder(512)) == 40


def test_buckets_and_refused_shapes():
    assert [bucket(n) for n in (1, 2, 3, 4, 5, 16, 17, 65, 129, 512)] == [1, 2, 4, 4, 8, 16, 32, 72, 144, 512]
    with pytest.raises(ValueError, match="at least one row"):
        bucket(0)
    decoder = StaticDecoder(build_family("llama-tied"), compiled=False)
    state = decoder.new_state(capacity=3, positions=70)
    assert state.capacity == 4 and state.width == 128
    with pytest.raises(ValueError, match="bucket of at most 4 rows"):
        decoder.step(state, 3)
    with pytest.raises(ValueError, match="does not fit"):
        state.load([0], keys=[torch.zeros(1, 1, 200, 1)] * 2, values=[torch.zeros(1, 1, 200, 1)] * 2,
                   lengths=[200], left_padded=True)
    with pytest.raises(ValueError, match="CUDA"):
        StaticDecoder(build_family("llama-tied"), cuda_graphs=True)


def test_auto_falls_back_to_the_hf_modules_when_the_first_call_fails(monkeypatch, caplog):
    """Under ``auto`` a static loop that cannot compile or capture in its first call (no Triton, an
    op the capture refuses) leaves the run on HF's modules with one warning; asked for explicitly,
    the failure is the caller's error."""
    model = build_family("llama-tied")
    monkeypatch.setattr(TorchEngine, "_static_wanted", lambda self, device: self.static_decode != "off")

    def broken(self, state, rows, **kw):
        raise RuntimeError("no Triton")

    monkeypatch.setattr(StaticDecoder, "step", broken)
    reference = generate(engine(model, static=False), requests(), SAMPLED)
    auto = TorchEngine(model, eos_token_ids=[], pad_token_id=chat_tokenizer().pad_token_id, fused_decode=False)
    with caplog.at_level("WARNING", logger="llamarl.engines.torch_engine"):
        assert_same(generate(auto, requests(), SAMPLED), reference)
    assert auto.static_decode == "off" and "no Triton" in caplog.text
    explicit = TorchEngine(model, eos_token_ids=[], pad_token_id=0, static_decode="compiled")
    with pytest.raises(RuntimeError, match="no Triton"):
        generate(explicit, requests(), SAMPLED)
