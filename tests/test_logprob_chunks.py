"""Log-probs in token chunks (``--trainer.logprob-chunk-tokens``, llamarl/models/logprob_chunks.py):
the same values and gradients as the whole micro-batch's logits, per row and with shared prompts,
on untied and tied (SmolLM2-like) heads, with grad and without; the logits of one chunk at most are
built; models that soft-cap their logits are refused in one line. The FSDP2 path is checked against
the single-process reference in tests/test_trainer.py."""

import pytest
import torch
from test_shared_prefix import TEMPERATURE, _batch
from tiny_model import build_tiny_llama

from llamarl.config import TrainerConfig
from llamarl.models.logprob_chunks import selected_logprobs
from llamarl.models.logprobs import completion_logprobs
from llamarl.models.microbatch import microbatch_inputs
from llamarl.models.shared_prefix import shared_prefix_logprobs


def _logprobs(model, batch, *, shared: bool, chunk_tokens: int):
    ids, attention, mask, start, _ = microbatch_inputs(batch, list(range(len(batch))), device="cpu")
    if shared:
        return shared_prefix_logprobs(model, ids, attention, mask, temperature=TEMPERATURE,
                                      chunk_tokens=chunk_tokens) * mask
    return completion_logprobs(model, ids, attention, start=start, temperature=TEMPERATURE,
                               chunk_tokens=chunk_tokens) * mask


def _grads(model, logp):
    weights = torch.linspace(-1.0, 1.0, logp.numel()).reshape(logp.shape)
    model.zero_grad()
    (logp * weights).sum().backward()
    return {name: p.grad.clone() for name, p in model.named_parameters()}


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("shared", [False, True])
@pytest.mark.parametrize("chunk_tokens", [1, 5, 10_000])
def test_chunked_log_probs_and_gradients_equal_the_whole_logits(tied, shared, chunk_tokens):
    model = build_tiny_llama(seed=0, tie_word_embeddings=tied)
    batch = _batch()
    whole = _logprobs(model, batch, shared=shared, chunk_tokens=0)
    assert whole.abs().sum() > 1.0
    expected = _grads(model, whole)
    chunked = _logprobs(model, batch, shared=shared, chunk_tokens=chunk_tokens)
    torch.testing.assert_close(chunked, whole, rtol=1e-5, atol=1e-5)
    got = _grads(model, chunked)
    largest = max(g.abs().max().item() for g in expected.values())
    assert largest > 1e-3
    assert sorted(got) == sorted(expected)
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], rtol=1e-4, atol=1e-5 * largest, msg=name)
    # The model is given back with its own head (the stand-in lived for one forward only).
    assert model.lm_head is model.get_output_embeddings() and isinstance(model.lm_head, torch.nn.Linear)
    with torch.no_grad():
        torch.testing.assert_close(_logprobs(model, batch, shared=shared, chunk_tokens=chunk_tokens), whole,
                                   rtol=1e-5, atol=1e-5)


def test_no_more_than_one_chunk_of_logits_is_built():
    """The LM head sees at most ``chunk_tokens`` rows per call, forward and backward (recompute)."""
    model = build_tiny_llama(seed=0)
    seen = []
    hook = model.lm_head.register_forward_hook(lambda module, args, out: seen.append(out.shape))
    batch = _batch()
    logp = _logprobs(model, batch, shared=False, chunk_tokens=4)
    forward_calls = len(seen)
    logp.sum().backward()
    hook.remove()
    num_tokens = int(microbatch_inputs(batch, list(range(len(batch))), device="cpu")[0].shape[1])
    assert forward_calls > 1 and len(seen) == 2 * forward_calls  # each chunk recomputed once in backward
    assert all(shape[0] <= 4 and len(shape) == 2 for shape in seen), seen
    assert num_tokens > 4


def test_bad_chunk_sizes_and_soft_capped_models_are_refused():
    model = build_tiny_llama(seed=0)
    ids = torch.tensor([[5, 6, 7]])
    select = {"rows": torch.tensor([0]), "positions": torch.tensor([0]), "targets": torch.tensor([7])}
    with pytest.raises(ValueError, match="chunk_tokens must be >= 1"):
        selected_logprobs(model, **select, temperature=1.0, chunk_tokens=0, input_ids=ids)
    model.config.final_logit_softcapping = 30.0
    with pytest.raises(ValueError, match="soft-caps its logits.*--trainer.logprob-chunk-tokens 0"):
        selected_logprobs(model, **select, temperature=1.0, chunk_tokens=2, input_ids=ids)
    assert isinstance(model.lm_head, torch.nn.Linear)
    with pytest.raises(ValueError, match="--trainer.logprob-chunk-tokens must be >= 0"):
        TrainerConfig(logprob_chunk_tokens=-1)
