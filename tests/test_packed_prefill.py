"""The native engine's prefill writes straight into its KV state (issue 45 item 1): the contexts
packed into one row without padding, each layer's keys and values written into the slots, no
``DynamicCache``; the same logits and cached keys / values as the padded prefill copied in."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch
import transformers
from model_families import build_family

from llamarl.engines import packed_prefill
from llamarl.engines.base import Request, SamplingParams
from llamarl.engines.kv_slots import KVSlots
from llamarl.engines.torch_engine import TorchEngine

CONTEXTS = [(5, 9, 14, 3, 22, 7), (8, 8, 31), (5, 9, 14, 3, 22, 7), (40, 2, 17, 9, 9, 11, 60, 12, 3), (8, 8, 31)]
"""Different lengths, GRPO-style repeats (rows 0 / 2 and 1 / 4 share a context)."""
SLOTS = [3, 0, 5, 1, 4]


def _state(model, *, growable):
    config = model.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return KVSlots.zeros(layers=config.num_hidden_layers, slots=6, kv_heads=config.num_key_value_heads,
                         width=0 if growable else 16, head_dim=head_dim, like=model.model.embed_tokens.weight,
                         growable=growable)


@pytest.mark.parametrize("family", ["llama-tied", "qwen2", "qwen3", "mistral"])
@pytest.mark.parametrize("growable", [False, True], ids=["fixed", "growable"])
def test_packed_prefill_writes_what_the_padded_prefill_copies(family, growable):
    model = build_family(family)
    engine = TorchEngine(model, eos_token_ids=[], pad_token_id=0)
    reference_state, state = _state(model, growable=growable), _state(model, growable=growable)
    with torch.no_grad():
        logits, cache, mask = engine._prefill(CONTEXTS)
        reference_state.load_prefill(SLOTS, cache=cache, mask=mask, lengths=[len(c) for c in CONTEXTS])
        packed = packed_prefill.prefill_into(model, state, SLOTS, CONTEXTS)
    torch.testing.assert_close(packed, logits, rtol=1e-5, atol=1e-5)
    assert state.width == reference_state.width
    for slot, context in zip(SLOTS, CONTEXTS):
        for ours, theirs in zip(state.caches, reference_state.caches):
            torch.testing.assert_close(ours[:, slot, :, : len(context)], theirs[:, slot, :, : len(context)],
                                       rtol=1e-5, atol=1e-5)


def test_a_context_too_long_for_a_fixed_state_is_refused_before_any_write():
    model = build_family("llama-tied")
    state = _state(model, growable=False)
    with pytest.raises(ValueError, match="does not fit the state's 16 columns"):
        packed_prefill.prefill_into(model, state, [0], [tuple(range(3, 30))])
    assert all(not c.any() for c in state.caches)


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "static"])
def test_the_engine_prefills_packed_without_a_dynamic_cache_and_generates_the_same(fused, monkeypatch):
    """Through the engine (the fused CPU step, and the static step on CPU): no ``DynamicCache`` is
    made, one packed row is forwarded with exactly the distinct contexts' tokens, and the greedy
    tokens and sampled log-probs equal those of the padded prefill (``packed_prefill=False``)."""
    model = build_family("qwen2")
    made, shapes = [], []
    init = transformers.cache_utils.DynamicCache.__init__
    monkeypatch.setattr(transformers.cache_utils.DynamicCache, "__init__",
                        lambda self, *a, **k: made.append(1) or init(self, *a, **k))
    handle = model.model.register_forward_pre_hook(
        lambda _m, _a, kwargs: shapes.append(tuple(kwargs["input_ids"].shape)), with_kwargs=True)
    reqs = [Request(sample_id=i, prompt_ids=list(c)) for i, c in enumerate(CONTEXTS)]
    kw = {"static_decode": "off"} if fused else {"static_decode": "eager"}
    results = {}
    try:
        for packed in (True, False):
            made.clear()
            shapes.clear()
            engine = TorchEngine(model, eos_token_ids=[], pad_token_id=0, packed_prefill=packed, **kw)
            out = engine.generate(reqs, sampling=SamplingParams(temperature=1.0, max_new_tokens=5), version=0,
                                  generator=torch.Generator().manual_seed(2))
            greedy = engine.generate(reqs, sampling=SamplingParams(temperature=0.0, max_new_tokens=5), version=0)
            results[packed] = ([c.completion_ids for c in out], [c.logprobs for c in out],
                               [c.completion_ids for c in greedy])
            if packed:
                assert not made  # no DynamicCache, no copy out of one
                assert shapes[0] == (1, sum(len(c) for c in set(CONTEXTS)))  # packed, no padding
            else:
                assert made and shapes[0] == (len(set(CONTEXTS)), max(len(c) for c in CONTEXTS))
    finally:
        handle.remove()
    assert results[True][0] == results[False][0] and results[True][2] == results[False][2]
    for ours, theirs in zip(results[True][1], results[False][1]):
        torch.testing.assert_close(torch.tensor(ours), torch.tensor(theirs), rtol=1e-4, atol=1e-4)


def test_soft_capped_attention_keeps_the_padded_prefill():
    assert not packed_prefill.supports(build_family("gemma2"), width=64)
    assert packed_prefill.supports(build_family("llama-tied"), width=64)
