"""Log-probs in token chunks (``--trainer.logprob-chunk-tokens``, default on; llamarl/models/logprob_chunks.py
and the fused head of llamarl/models/fused_logprobs.py): the same values and gradients as the whole
micro-batch's logits, per row and with shared prompts, on untied and tied (SmolLM2-like) heads, with
grad and without, fp32 and bf16, soft-capped (Gemma 2) heads; no tensor of more than one chunk of
logits is built; the issue-46 proxy: the log-prob path's peak memory at [8192, 49152] is <= 1/4 of the
whole logits' (fake tensors, torch's MemTracker). The FSDP2 path is checked against the
single-process reference in tests/test_trainer.py and tests/test_minibatches.py."""

import types

import pytest
import torch
from test_shared_prefix import TEMPERATURE, _batch
from tiny_model import build_tiny_llama
from torch.utils._python_dispatch import TorchDispatchMode

from llamarl.executors.config import TrainerConfig
from llamarl.models.fused_logprobs import HeadLogprobs
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


class _LargestVocabTensor(TorchDispatchMode):
    """The most rows of any op output whose last dimension is the vocabulary."""

    def __init__(self, vocab: int) -> None:
        super().__init__()
        self.vocab, self.rows = vocab, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.is_view:
            return out
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.dim() >= 1 and t.shape[-1] == self.vocab:
                self.rows = max(self.rows, t.numel() // self.vocab)
        return out


@pytest.mark.parametrize("shared", [False, True])
def test_no_more_than_one_chunk_of_logits_is_built(shared):
    """No op, forward or backward, makes a tensor of more than ``chunk_tokens`` rows of logits."""
    model = build_tiny_llama(seed=0, intermediate_size=80)  # no other dimension of the model is the vocab (128)
    batch = _batch()
    with _LargestVocabTensor(128) as probe:
        logp = _logprobs(model, batch, shared=shared, chunk_tokens=4)
        (logp * torch.linspace(-1, 1, logp.numel()).view(logp.shape)).sum().backward()
    num_tokens = int(microbatch_inputs(batch, list(range(len(batch))), device="cpu")[2].sum())
    assert num_tokens > 4
    assert probe.rows <= 4, probe.rows
    with _LargestVocabTensor(128) as probe:
        _logprobs(model, batch, shared=shared, chunk_tokens=0).sum().backward()
    assert probe.rows >= num_tokens  # the whole-logits path, for contrast


def test_the_fused_head_is_the_default_and_equals_the_whole_logits_in_fp32_and_bf16():
    """``TrainerConfig().logprob_chunk_tokens`` > 0 (default on); fp32: the same log-probs bit for bit
    at the default (every token in one chunk here; on this CPU's GEMM), within 1e-6 in chunks of 3, and gradients within 1e-5 of the
    largest; bf16 (weights and compute): log-probs within the stated 0.02 absolute (bf16 rounds each
    logit to ~0.4 %; measured equal here too)."""
    chunk = TrainerConfig().logprob_chunk_tokens
    assert chunk > 0
    for tied in (False, True):
        model = build_tiny_llama(seed=1, tie_word_embeddings=tied)
        batch = _batch(seed=1)
        whole = _logprobs(model, batch, shared=False, chunk_tokens=0)
        expected = _grads(model, whole)
        for chunk_tokens in (chunk, 3):
            fused = _logprobs(model, batch, shared=False, chunk_tokens=chunk_tokens)
            exact = chunk_tokens == chunk  # one chunk: the head's GEMM over the same rows (3: 1 ulp here)
            torch.testing.assert_close(fused, whole, rtol=0 if exact else 1e-6, atol=0 if exact else 1e-6)
            got = _grads(model, fused)
            largest = max(g.abs().max().item() for g in expected.values())
            for name in expected:
                torch.testing.assert_close(got[name], expected[name], rtol=1e-5, atol=1e-5 * largest, msg=name)
        model = model.to(torch.bfloat16)
        whole = _logprobs(model, batch, shared=True, chunk_tokens=0)
        for chunk_tokens in (chunk, 3):
            fused = _logprobs(model, batch, shared=True, chunk_tokens=chunk_tokens)
            assert fused.dtype == torch.float32
            torch.testing.assert_close(fused, whole, rtol=0, atol=0.02)


def test_the_fused_function_matches_autograd_on_its_formula():
    """``HeadLogprobs`` against the formula by autograd, with a bias, a temperature, several chunks,
    one chunk (probabilities kept, no recompute) and the entropy ``-sum p log p``."""
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(11, 8, generator=gen, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(13, 8, generator=gen, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(13, generator=gen, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, 13, (11,), generator=gen)
    upstream = torch.randn(11, generator=gen, dtype=torch.float64)
    log_probs = torch.log_softmax((hidden @ weight.t() + bias) / 0.7, dim=-1)
    want = log_probs.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    want_entropy = -(log_probs.exp() * log_probs).sum(-1)
    want_grads = torch.autograd.grad((want * upstream).sum(), (hidden, weight, bias))
    for chunk in (1, 4, 11, 64):
        logp, entropy = HeadLogprobs.apply(hidden.float(), weight.float(), bias.float(), targets, 0.7, chunk, True)
        torch.testing.assert_close(logp.double(), want, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(entropy.double(), want_entropy.detach(), rtol=1e-5, atol=1e-5)
        h, w, b = (t.detach().float().requires_grad_() for t in (hidden, weight, bias))
        logp, _ = HeadLogprobs.apply(h, w, b, targets, 0.7, chunk, False)
        got = torch.autograd.grad((logp * upstream.float()).sum(), (h, w, b))
        for g, expected in zip(got, want_grads):
            torch.testing.assert_close(g.double(), expected, rtol=1e-4, atol=1e-5)


def test_the_entropy_bonus_gradient_matches_autograd_on_its_formula():
    """``entropy_grad`` (``--algo.entropy-coef``): the gradient of ``sum_n g_n logp_n + k_n H_n`` through
    ``HeadLogprobs`` (chunks of 1, 4 and all 11 rows: the kept log-probabilities) equals autograd's on
    ``H = -sum_v p_v log p_v`` written out; without ``entropy_grad`` the entropy has no gradient."""
    gen = torch.Generator().manual_seed(1)
    hidden = torch.randn(11, 8, generator=gen, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(13, 8, generator=gen, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(13, generator=gen, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, 13, (11,), generator=gen)
    g, k = torch.randn(11, generator=gen, dtype=torch.float64), torch.randn(11, generator=gen, dtype=torch.float64)
    log_probs = torch.log_softmax((hidden @ weight.t() + bias) / 0.7, dim=-1)
    logp = log_probs.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    entropy = -(log_probs.exp() * log_probs).sum(-1)
    want = torch.autograd.grad((logp * g + entropy * k).sum(), (hidden, weight, bias), retain_graph=True)
    without_bonus = torch.autograd.grad((logp * g).sum(), (hidden, weight, bias))
    assert max((a - b).abs().max().item() for a, b in zip(want, without_bonus)) > 1e-2  # the bonus matters
    for chunk in (1, 4, 11):
        h, w, b = (t.detach().float().requires_grad_() for t in (hidden, weight, bias))
        got_logp, got_entropy = HeadLogprobs.apply(h, w, b, targets, 0.7, chunk, True, True)
        assert got_entropy.requires_grad
        got = torch.autograd.grad((got_logp * g.float() + got_entropy * k.float()).sum(), (h, w, b))
        for name, value, expected in zip("hwb", got, want):
            torch.testing.assert_close(value.double(), expected, rtol=1e-4, atol=1e-5, msg=f"{name}, chunk {chunk}")
    _, plain = HeadLogprobs.apply(h, w, b, targets, 0.7, 4, True, False)
    assert not plain.requires_grad


@pytest.mark.parametrize(("shared", "chunk_tokens", "family"),
                         [(False, 0, "llama"), (False, 3, "llama"), (True, 10_000, "llama"), (True, 0, "llama"),
                          (False, 3, "gemma2")])
def test_a_differentiable_entropy_has_the_whole_logits_gradient_on_every_path(shared, chunk_tokens, family):
    """The entropy each log-prob path appends to ``entropy_out`` with ``entropy_grad``: the whole
    logits' (by autograd) through the fused head, the soft-capped chunks (Gemma 2) and shared prompts."""
    if family == "gemma2":
        from model_families import build_family

        model = build_family("gemma2")
        model.config.final_logit_softcapping = 0.5
    else:
        model = build_tiny_llama(seed=0)
    batch = _batch()
    ids, attention, mask, start, _ = microbatch_inputs(batch, list(range(len(batch))), device="cpu")

    def entropy_grads(chunk: int, grad: bool):
        out: list = []
        if shared:
            shared_prefix_logprobs(model, ids, attention, mask, temperature=TEMPERATURE, chunk_tokens=chunk,
                                   entropy_out=out, entropy_grad=grad)
        else:
            completion_logprobs(model, ids, attention, start=start, temperature=TEMPERATURE, chunk_tokens=chunk,
                                entropy_out=out, entropy_grad=grad)
        entropy = out[0] * mask
        if not grad:
            return entropy, None
        model.zero_grad()
        (entropy * torch.linspace(-1.0, 1.0, entropy.numel()).reshape(entropy.shape)).sum().backward()
        return entropy, {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}

    # The reference: the whole logits' entropy, written out (no chunking, no sharing).
    out: list = []
    completion_logprobs(model, ids, attention, start=start, temperature=TEMPERATURE, chunk_tokens=0,
                        entropy_out=out, entropy_grad=True)
    reference = out[0] * mask
    model.zero_grad()
    (reference * torch.linspace(-1.0, 1.0, reference.numel()).reshape(reference.shape)).sum().backward()
    expected = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    values, got = entropy_grads(chunk_tokens, True)
    torch.testing.assert_close(values, reference, rtol=1e-5, atol=1e-5)
    largest = max(g.abs().max().item() for g in expected.values())
    assert largest > 1e-3 and sorted(got) == sorted(expected)
    for name, value in expected.items():
        torch.testing.assert_close(got[name], value, rtol=1e-4, atol=1e-5 * largest, msg=name)
    assert not entropy_grads(chunk_tokens, False)[0].requires_grad


def test_soft_capped_heads_are_capped_inside_the_chunks():
    """Gemma 2's ``final_logit_softcapping``: the chunked path applies ``c tanh(z / c)`` itself (the
    model's own cap off for the call, back after) and gives the whole logits' values and gradients."""
    from model_families import build_family

    model = build_family("gemma2")
    model.config.final_logit_softcapping = 0.5  # small, so that the cap changes the values
    batch = _batch()
    whole = _logprobs(model, batch, shared=False, chunk_tokens=0)
    expected = _grads(model, whole)
    model.config.final_logit_softcapping = None
    uncapped = _logprobs(model, batch, shared=False, chunk_tokens=0)
    assert (uncapped - whole).abs().max() > 1e-2
    model.config.final_logit_softcapping = 0.5
    chunked = _logprobs(model, batch, shared=False, chunk_tokens=3)
    assert model.config.final_logit_softcapping == 0.5
    torch.testing.assert_close(chunked, whole, rtol=1e-5, atol=1e-5)
    got = _grads(model, chunked)
    largest = max(g.abs().max().item() for g in expected.values())
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], rtol=1e-4, atol=1e-5 * largest, msg=name)


class _HeadOnlyLM(torch.nn.Module):
    """The log-prob path with a body of one embedding: ``hidden = embed(ids)``, ``logits = lm_head``.
    The vocabulary terms are all that is left, which is what the memory proxy measures."""

    def __init__(self, vocab: int, hidden: int) -> None:
        super().__init__()
        self.config = types.SimpleNamespace()
        self.embed = torch.nn.Embedding(vocab, hidden)
        self.lm_head = torch.nn.Linear(hidden, vocab, bias=False)

    def get_output_embeddings(self):
        return self.lm_head

    def forward(self, input_ids, attention_mask=None, use_cache=False, logits_to_keep=0):
        hidden = self.embed(input_ids)
        return types.SimpleNamespace(logits=self.lm_head(hidden[:, -logits_to_keep:]))


def _logprob_path_peak_bytes(chunk_tokens: int, *, tokens: int = 8192, vocab: int = 49152, hidden: int = 64) -> int:
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.mem_tracker import MemTracker

    with FakeTensorMode():
        model = _HeadOnlyLM(vocab, hidden)
        ids = torch.randint(0, vocab, (1, tokens + 1))
        tracker = MemTracker()
        tracker.track_external(model)
        with tracker:
            logp = completion_logprobs(model, ids, torch.ones_like(ids), start=1, temperature=0.7,
                                       chunk_tokens=chunk_tokens)
            (logp * 0.5).sum().backward()
        peak = tracker.get_tracker_snapshot("peak")
    return sum(v for device in peak.values() for k, v in device.items() if "Total" in str(k))


def test_log_prob_path_peak_memory_is_a_quarter_of_the_whole_logits():
    """Issue 46's proxy: forward + backward of the default log-prob path for 8,192 tokens x 49,152 ids
    (SmolLM2's vocabulary; hidden 64 so that the tokens x vocab term is everything) peaks at <= 1/4
    of the whole-logits path's (fake tensors: sizes without the memory). Fails with the old default
    (``--trainer.logprob-chunk-tokens 0``: the whole logits)."""
    whole = _logprob_path_peak_bytes(0)
    default = _logprob_path_peak_bytes(TrainerConfig().logprob_chunk_tokens)
    assert whole > 3 * 8192 * 49152 * 4  # several fp32 copies of the logits
    assert default <= whole / 4, (default, whole)


def test_bad_chunk_sizes_are_refused():
    model = build_tiny_llama(seed=0)
    ids = torch.tensor([[5, 6, 7]])
    select = {"rows": torch.tensor([0]), "positions": torch.tensor([0]), "targets": torch.tensor([7])}
    with pytest.raises(ValueError, match="chunk_tokens must be >= 1"):
        selected_logprobs(model, **select, temperature=1.0, chunk_tokens=0, input_ids=ids)
    assert isinstance(model.lm_head, torch.nn.Linear)
    with pytest.raises(ValueError, match="--trainer.logprob-chunk-tokens must be >= 0"):
        TrainerConfig(logprob_chunk_tokens=-1)
