"""TorchEngine: exact behaviour log-probs, greedy parity with HF generate, seeding, filtering, carry-over."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import math

import pytest
import torch
from tiny_model import build_tiny_llama

from llamarl.engines.base import Completion, Request, SamplingParams
from llamarl.engines.torch_engine import TorchEngine, filtered_logprobs, sample_tokens

PROMPT_LENS = [3, 9, 1, 14, 6]


@pytest.fixture(scope="module")
def model():
    return build_tiny_llama(seed=0)


def _prompts(lens=PROMPT_LENS, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 128, (n,), generator=g).tolist() for n in lens]


def _requests(prompts):
    return [Request(sample_id=10 + i, prompt_ids=p) for i, p in enumerate(prompts)]


def _reference_logprobs(model, comp: Completion, temperature: float) -> torch.Tensor:
    """Log-probs of the completion from one fresh full forward pass (no cache, no padding)."""
    ids = torch.tensor([comp.prompt_ids + comp.completion_ids])
    with torch.no_grad():
        logits = model(ids).logits[0, len(comp.prompt_ids) - 1 : -1].float()
    logp = torch.log_softmax(logits / temperature, dim=-1)
    return logp.gather(-1, torch.tensor(comp.completion_ids).unsqueeze(-1)).squeeze(-1)


def test_sampled_logprobs_match_full_forward(model):
    # Several EOS ids so that rows finish at different steps and the batch shrinks mid-decode.
    engine = TorchEngine(model, eos_token_ids=[5, 17, 40, 77, 99], pad_token_id=0)
    sampling = SamplingParams(temperature=0.7, max_new_tokens=16)
    out = engine.generate(
        _requests(_prompts()), sampling=sampling, version=0, generator=torch.Generator().manual_seed(3)
    )
    assert [c.sample_id for c in out] == [10 + i for i in range(len(PROMPT_LENS))]
    assert {c.finish_reason for c in out} == {"stop", "length"}, "want both early stops and full rows"
    for comp in out:
        assert len(comp.logprobs) == len(comp.completion_ids) == len(comp.versions)
        ref = _reference_logprobs(model, comp, 0.7)
        assert (ref - torch.tensor(comp.logprobs)).abs().max().item() < 1e-4
        if comp.finish_reason == "stop":
            assert comp.completion_ids[-1] in engine.eos_token_ids
            assert not set(comp.completion_ids[:-1]) & set(engine.eos_token_ids)
        else:
            assert len(comp.completion_ids) == 16


def test_greedy_matches_hf_generate(model):
    engine = TorchEngine(model, eos_token_ids=[2], pad_token_id=0)
    prompts = _prompts()
    out = engine.generate(
        _requests(prompts), sampling=SamplingParams(temperature=0, max_new_tokens=12), version=0
    )
    for prompt, comp in zip(prompts, out):
        ref = model.generate(
            torch.tensor([prompt]), do_sample=False, max_new_tokens=12, eos_token_id=2, pad_token_id=0
        )[0, len(prompt) :].tolist()
        if 2 in ref:  # HF pads after EOS; the engine stops there.
            ref = ref[: ref.index(2) + 1]
        assert comp.completion_ids == ref
        assert comp.finish_reason == ("stop" if ref[-1] == 2 else "length")
        # Greedy log-probs are log_softmax(logits) at T = 1.
        assert (_reference_logprobs(model, comp, 1.0) - torch.tensor(comp.logprobs)).abs().max() < 1e-4


def test_eos_stops_and_length(model):
    prompts = _prompts()
    sampling = SamplingParams(temperature=0, max_new_tokens=8)
    free = TorchEngine(model, eos_token_ids=[], pad_token_id=0).generate(
        _requests(prompts), sampling=sampling, version=0
    )
    assert all(c.finish_reason == "length" and len(c.completion_ids) == 8 for c in free)
    # Make the 4th greedy token of prompt 0 the EOS: that row must stop there, EOS included.
    eos = free[0].completion_ids[3]
    stop_at = free[0].completion_ids.index(eos) + 1
    out = TorchEngine(model, eos_token_ids=[eos], pad_token_id=0).generate(
        _requests(prompts), sampling=sampling, version=0
    )
    assert out[0].finish_reason == "stop"
    assert out[0].completion_ids == free[0].completion_ids[:stop_at]
    for ref, comp in zip(free[1:], out[1:]):
        expected = (
            ref.completion_ids[: ref.completion_ids.index(eos) + 1]
            if eos in ref.completion_ids
            else ref.completion_ids
        )
        assert comp.completion_ids == expected
        assert comp.finish_reason == ("stop" if eos in ref.completion_ids else "length")


def test_seeding(model):
    engine = TorchEngine(model, eos_token_ids=[], pad_token_id=0)
    sampling = SamplingParams(temperature=1.0, max_new_tokens=10)

    def run(seed):
        out = engine.generate(
            _requests(_prompts()), sampling=sampling, version=0, generator=torch.Generator().manual_seed(seed)
        )
        return [c.completion_ids for c in out]

    assert run(7) == run(7)
    assert run(7) != run(8)


def test_top_k_one_is_greedy(model):
    engine = TorchEngine(model, eos_token_ids=[2], pad_token_id=0)
    reqs = _requests(_prompts())
    greedy = engine.generate(reqs, sampling=SamplingParams(temperature=0, max_new_tokens=8), version=0)
    topk = engine.generate(
        reqs,
        sampling=SamplingParams(temperature=0.9, top_k=1, max_new_tokens=8),
        version=0,
        generator=torch.Generator().manual_seed(0),
    )
    assert [c.completion_ids for c in topk] == [c.completion_ids for c in greedy]
    # The sampled distribution is a point mass, so its behaviour log-prob is 0.
    assert all(lp == 0.0 for c in topk for lp in c.logprobs)


def test_top_p_constructed_case():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs.log().repeat(4000, 1)
    # Mass before token 2 is 0.8 >= 0.7: the nucleus is {0, 1}, renormalised over 0.8.
    sampling = SamplingParams(temperature=1.0, top_p=0.7)
    tokens, lps = sample_tokens(logits, sampling=sampling, generator=torch.Generator().manual_seed(0))
    assert set(tokens.tolist()) == {0, 1}
    expected = torch.tensor([math.log(0.5 / 0.8), math.log(0.3 / 0.8)])
    assert torch.allclose(lps, expected[tokens], atol=1e-6)
    assert abs((tokens == 0).float().mean().item() - 0.625) < 0.03
    # A nucleus of exactly the top token's mass keeps only that token.
    only_top = filtered_logprobs(probs.log(), temperature=1.0, top_p=0.5)
    assert torch.isinf(only_top[1:]).all() and only_top[0].item() == 0.0
    # No filtering reduces to log_softmax(logits / T).
    plain = filtered_logprobs(logits[0], temperature=0.5)
    assert torch.allclose(plain, torch.log_softmax(logits[0] / 0.5, -1))


def test_sampling_frequencies_and_zero_probability_tokens():
    probs = torch.tensor([0.4, 0.0, 0.3, 0.2, 0.0, 0.1])
    logits = probs.log().repeat(20000, 1)  # -inf logits: filtered tokens
    tokens, _ = sample_tokens(logits, sampling=SamplingParams(), generator=torch.Generator().manual_seed(0))
    freq = torch.bincount(tokens, minlength=6).float() / len(tokens)
    assert freq[1] == 0 and freq[4] == 0
    assert torch.allclose(freq, probs, atol=0.015)


def test_nucleus_matches_full_sort_reference():
    g = torch.Generator().manual_seed(0)
    # Rows from nearly flat (nucleus of thousands of tokens: the growing top-k path) to peaked.
    scales = torch.tensor([0.05, 0.5, 1.0, 2.0, 4.0, 8.0]).unsqueeze(1)
    logits = torch.randn(6, 5000, generator=g) * scales
    for top_p in (0.05, 0.5, 0.9, 0.999):
        got = filtered_logprobs(logits, temperature=1.0, top_p=top_p)
        sorted_x, order = torch.sort(logits, dim=-1, descending=True)
        p = sorted_x.softmax(-1)
        before = torch.empty_like(p).scatter_(-1, order, p.cumsum(-1) - p)  # mass ahead of each token
        ref_keep = before < top_p
        # fp32 cumsums in a different order may disagree only for a token sitting right at the boundary.
        disagree = torch.isfinite(got) != ref_keep
        assert ((before[disagree] - top_p).abs() < 1e-5).all()
        assert disagree.sum() <= 1
        both = torch.isfinite(got) & ref_keep
        ref = torch.log_softmax(logits.masked_fill(~ref_keep, float("-inf")), dim=-1)
        if not disagree.any():
            assert torch.allclose(got[both], ref[both], atol=1e-5)


def test_top_p_engine_samples_inside_nucleus(model):
    engine = TorchEngine(model, eos_token_ids=[], pad_token_id=0)
    out = engine.generate(
        _requests(_prompts()),
        sampling=SamplingParams(temperature=1.0, top_p=0.3, max_new_tokens=6),
        version=0,
        generator=torch.Generator().manual_seed(0),
    )
    for comp in out:
        ids = torch.tensor([comp.prompt_ids + comp.completion_ids])
        with torch.no_grad():
            logits = model(ids).logits[0, len(comp.prompt_ids) - 1 : -1]
        ref = filtered_logprobs(logits, temperature=1.0, top_p=0.3)
        picked = ref.gather(-1, torch.tensor(comp.completion_ids).unsqueeze(-1)).squeeze(-1)
        assert torch.isfinite(picked).all()
        assert (picked - torch.tensor(comp.logprobs)).abs().max() < 1e-4


def test_carry_over_and_version_tags():
    model = build_tiny_llama(seed=0)
    engine = TorchEngine(model, eos_token_ids=[], pad_token_id=0)
    prompts = _prompts()
    greedy = SamplingParams(temperature=0, max_new_tokens=8)
    full = engine.generate(_requests(prompts), sampling=greedy, version=0)

    part = engine.generate(_requests(prompts), sampling=greedy, version=0, token_budget=3)
    assert all(c.finish_reason == "carried" and c.versions == [0, 0, 0] for c in part)
    # Unchanged weights: resuming reproduces the uninterrupted greedy output exactly.
    resumed = engine.generate([c.to_request() for c in part], sampling=greedy, version=0)
    assert [c.completion_ids for c in resumed] == [c.completion_ids for c in full]
    assert all(c.finish_reason == "length" for c in resumed)

    # In-place weight update between calls: new tokens are tagged with the new version.
    with torch.no_grad():
        model.lm_head.weight.add_(0.5 * torch.randn_like(model.lm_head.weight))
    resumed = engine.generate([c.to_request() for c in part], sampling=greedy, version=1)
    for before, after in zip(part, resumed):
        assert after.completion_ids[:3] == before.completion_ids
        assert after.logprobs[:3] == before.logprobs
        assert after.versions == [0, 0, 0] + [1] * 5
        fresh = _reference_logprobs(model, after, 1.0)[3:]
        assert (fresh - torch.tensor(after.logprobs[3:])).abs().max() < 1e-4
    assert [c.completion_ids for c in resumed] != [c.completion_ids for c in full]

    # A request already at max_new_tokens comes back at once as "length".
    done = engine.generate([resumed[0].to_request()], sampling=greedy, version=2)
    assert done[0].finish_reason == "length" and done[0].versions == resumed[0].versions


def test_bf16_model_runs(model):
    bf16 = build_tiny_llama(seed=0).to(torch.bfloat16)
    out = TorchEngine(bf16, eos_token_ids=[], pad_token_id=0).generate(
        _requests(_prompts()), sampling=SamplingParams(temperature=1.0, max_new_tokens=4), version=0
    )
    assert all(len(c.completion_ids) == 4 and all(math.isfinite(x) for x in c.logprobs) for c in out)


def test_validation_errors(model):
    engine = TorchEngine(model, eos_token_ids=[2], pad_token_id=0)
    for bad in ({"temperature": -1}, {"top_p": 0}, {"top_k": -1}, {"max_new_tokens": 0}):
        with pytest.raises(ValueError):
            SamplingParams(**bad)
    sampling = SamplingParams(max_new_tokens=4)
    bad_requests = [
        Request(0, []),
        Request(0, [3], completion_ids=[4], logprobs=[]),
        Request(0, [3], completion_ids=[4] * 5, logprobs=[0.0] * 5, versions=[0] * 5),
        Request(0, [3], completion_ids=[2], logprobs=[0.0], versions=[0]),
        Request(0, [500]),
    ]
    for req in bad_requests:
        with pytest.raises(ValueError):
            engine.generate([req], sampling=sampling, version=0)
    with pytest.raises(ValueError):
        engine.generate([Request(0, [3])], sampling=sampling, version=0, token_budget=0)


@pytest.mark.parametrize("fused", [True, False], ids=["fused-steps", "hf-steps"])
def test_shared_prompts_are_prefilled_once_and_sample_independently(model, fused):
    """A GRPO group submits its prompt once per sample: the engine prefills each distinct context once
    (the first forward's batch is the distinct contexts) yet every row samples on its own, with
    behaviour log-probs equal to a fresh full forward, and greedy rows equal a lone generation; the
    decode steps run over every row (through the fused step, or the model's forward)."""
    prompts = _prompts([7, 4, 11], seed=5)
    carried = Completion(sample_id=99, prompt_ids=prompts[0], completion_ids=[9, 8], logprobs=[-1.0, -2.0],
                         versions=[0, 0], finish_reason="carried").to_request()
    reqs = [Request(sample_id=g * 4 + j, prompt_ids=p) for g, p in enumerate(prompts) for j in range(4)]
    reqs.append(carried)  # same prompt as group 0 but a different context: prefilled on its own row
    forward_shapes = []  # the decoder stack's inputs: the packed prefill calls it, not the whole model
    handle = model.model.register_forward_pre_hook(
        lambda _module, _args, kwargs: forward_shapes.append(tuple(kwargs["input_ids"].shape)), with_kwargs=True)
    try:
        engine = TorchEngine(model, eos_token_ids=[], pad_token_id=0, fused_decode=fused)
        sampled = engine.generate(reqs, sampling=SamplingParams(temperature=1.0, max_new_tokens=6), version=1,
                                  generator=torch.Generator().manual_seed(0))
    finally:
        handle.remove()
    # The prefill: the distinct contexts, packed into one row without padding on the fused path
    # (straight into its state: packed_prefill.py), left-padded rows on HF's; then 5 decode steps
    # over all rows (the carried row stops 2 tokens earlier), through the model's forward unless fused.
    distinct = [len(p) for p in prompts] + [len(prompts[0]) + 2]
    assert forward_shapes[0] == ((1, sum(distinct)) if fused else (len(distinct), max(distinct)))
    assert [rows for rows, _ in forward_shapes[1:]] == ([] if fused else [len(reqs)] * 3 + [len(reqs) - 1] * 2)
    assert [c.sample_id for c in sampled] == [r.sample_id for r in reqs]
    for comp in sampled:
        num_new = len(comp.completion_ids) - (2 if comp.sample_id == 99 else 0)
        ref = _reference_logprobs(model, comp, 1.0)
        assert (ref[-num_new:] - torch.tensor(comp.logprobs[-num_new:])).abs().max().item() < 1e-4
    group0 = {tuple(c.completion_ids) for c in sampled[:4]}
    assert len(group0) > 1, "the rows of one group must not share their draws"
    greedy = SamplingParams(temperature=0.0, max_new_tokens=6)
    together = engine.generate(reqs[:4], sampling=greedy, version=0)
    alone = engine.generate([Request(sample_id=0, prompt_ids=prompts[0])], sampling=greedy, version=0)
    assert all(c.completion_ids == alone[0].completion_ids for c in together)


def test_the_two_level_draw_is_the_inverse_cdf_of_the_same_uniform():
    """``_draw`` (block sums, then one block's cumulative sum) picks the token a full fp64 inverse CDF
    picks for the same uniform (up to rounding at an interval's edge), over a vocabulary of many
    blocks that is not a multiple of the block, with filtered tokens at block edges never drawn."""
    from llamarl.engines.sampling import _DRAW_BLOCK, _draw

    g = torch.Generator().manual_seed(0)
    vocab = 5 * _DRAW_BLOCK + 37
    logits = torch.randn(4000, vocab, generator=g) * 2.0
    filtered = [0, _DRAW_BLOCK - 1, _DRAW_BLOCK, 3 * _DRAW_BLOCK + 5, vocab - 1]
    logits[:, filtered] = float("-inf")
    logp = torch.log_softmax(logits, dim=-1)
    u = torch.rand((4000, 1), generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    tokens = _draw(logp.exp(), u.squeeze(1))
    cdf = logp.exp().cumsum(dim=-1, dtype=torch.float64)
    reference = torch.searchsorted(cdf, u * cdf[:, -1:], right=True).squeeze(-1)
    assert (tokens == reference).float().mean() >= 0.999
    assert not torch.isin(tokens, torch.tensor(filtered)).any()
    assert len(set(tokens.tolist())) > 1000  # it really spread over the blocks
