"""Sampling for the native engine's decode loops: the behaviour log-probs (module docstring of
llamarl/engines/torch_engine.py), top-k / top-p filtering and the inverse-CDF draw.

Randomness: every decode loop (HF modules, fused, static) draws its uniforms up front, one per
(request, new-token index) of a ``generate`` call (``draw_uniforms``), and token j of request i is
drawn with ``uniforms[i, j]``. A seeded sample is then the same whatever batch its row decodes in:
rows that finish, rows admitted later (continuous batching), batch-size buckets, or a loop that
learns about finished rows only every few steps all leave the other rows' draws unchanged.

This module is the general sampler, tensor ops on any device; it imports no C. On the CPU the
native engine samples through ``llamarl/engines/cpu/sampling.py`` (``sample_tokens_cpu``), which
draws bf16 logits with the C kernels where they apply and falls back to ``sample_tokens`` otherwise.
"""

from __future__ import annotations

import torch

from llamarl.engines.base import SamplingParams


def draw_uniforms(*, num_requests: int, num_tokens: int, sampling: SamplingParams,
                  generator: torch.Generator | None, device: torch.device) -> torch.Tensor | None:
    """One fp64 uniform in [0, 1) per (request, new-token index), ``[num_requests, num_tokens]`` on
    ``device``, from ``generator`` (one draw for the whole call); None for greedy decoding (no draw).
    """
    if sampling.temperature == 0:
        return None
    return torch.rand((num_requests, num_tokens), generator=generator, dtype=torch.float64, device=device)


def filtered_logprobs(logits: torch.Tensor, *, temperature: float, top_p: float = 1.0, top_k: int = 0):
    """Return fp32 log-probs of the distribution sampled from: ``softmax(logits / T)`` after top-k then
    top-p filtering, renormalised; filtered-out tokens get ``-inf``.

    Contract: ``logits`` is ``(..., vocab)``; ``temperature > 0``. top-k keeps every token tied with the
    k-th largest logit; top-p keeps the smallest prefix (by descending probability) whose mass reaches
    ``top_p`` (so the most likely token always survives). With ``top_p == 1, top_k == 0`` the result is
    exactly ``log_softmax(logits.float() / temperature)``. The order (temperature, top-k, top-p) matches
    HF and vLLM.
    """
    if temperature <= 0:
        raise ValueError(f"filtered_logprobs needs temperature > 0, got {temperature}")
    # T = 1 divides by nothing (x / 1.0 == x exactly): skip a pass over the vocabulary.
    x = logits.float() / temperature if temperature != 1.0 else logits.float()
    if 0 < top_k < x.shape[-1]:
        kth = torch.topk(x, top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    if top_p < 1.0:
        x = x.masked_fill(~_nucleus(x.softmax(dim=-1), top_p), float("-inf"))
    return torch.log_softmax(x, dim=-1)


def host_reads_are_free(device: torch.device) -> bool:
    """Whether reading a value of ``device`` on the host costs nothing but the read (the CPU), as
    opposed to a synchronisation that stalls the launch queue (an accelerator): samplers may branch
    on a tensor's value only where this holds."""
    return device.type == "cpu"


def _greedy(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Argmax tokens and their ``log_softmax(logits.float())`` values, as ``-log(sum(exp(x - max)))``
    over one fp32 working copy of the logits (exponentiated in place): ``log_softmax`` then argmax
    wrote a second ``[rows, vocab]`` fp32 array and read it back. Ties go to the lowest id."""
    work = logits.to(torch.float32, copy=True)
    tokens = work.argmax(dim=-1)
    top = work.gather(-1, tokens.unsqueeze(-1))  # the row's max
    shift = top.masked_fill(top.isinf(), 0.0)  # a row of -inf / +inf: exp and log say so (NaN, as log_softmax)
    total = work.sub_(shift).exp_().sum(dim=-1)
    return tokens, (top - shift).squeeze(-1) - total.log()


def _nucleus(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Boolean mask of the top-p set: a token is kept while the mass strictly before it is < top_p."""
    vocab = probs.shape[-1]
    # A full-vocab sort costs ~200 ms for 64 x 49k on 2 threads; the nucleus is almost always inside
    # the top few hundred tokens, and once a top-k prefix holds >= top_p of the mass every token past
    # it is dropped anyway, so a growing top-k gives the exact same set far cheaper. Growing it reads
    # a device value, though: on an accelerator (a synchronisation per step) one full sort instead.
    k = min(vocab, 256) if host_reads_are_free(probs.device) else vocab
    while True:
        vals, order = torch.topk(probs, k, dim=-1, sorted=True)
        cum = vals.cumsum(dim=-1)
        if k == vocab or bool((cum[..., -1] >= top_p).all()):
            break
        k = min(vocab, k * 8)
    keep_sorted = (cum - vals) < top_p
    return torch.zeros_like(probs, dtype=torch.bool).scatter_(-1, order, keep_sorted)


_DRAW_BLOCK = 256


def _draw(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Sample one index per row of ``probs`` ``(rows, vocab)`` (fp32, >= 0, any total) in proportion
    to it by inverse CDF, row r with the uniform ``uniforms[r]`` (fp64, ``(rows,)``), without a
    cumulative sum over the vocabulary.

    Why not ``torch.multinomial``: it draws one exponential per vocab entry (~145 ms for 64 x 49k on
    2 threads, more than a decode step's matmuls). Why two levels: the full fp64 cumulative sum of
    the plain inverse CDF cost 8.3 ms (16 rows) / 35.9 ms (64 rows) of a 49k vocabulary on one
    thread; here the probabilities are summed in blocks of 256 (one pass, accumulated in fp64), the
    block is picked on the blocks' cumulative sum and the token within that block's 256 only: 1.0 /
    5.5 ms (the block sums in fp32, their cumulative sum in fp64). It is the same function of the uniform ``u`` as the plain inverse CDF (the token whose
    interval holds ``u x total``), up to rounding at an interval's edge. Zero-probability (filtered)
    tokens have empty intervals and are never drawn: the target is kept strictly below each
    cumulative total it is searched in.
    """
    rows, vocab = probs.shape
    pad = (-vocab) % _DRAW_BLOCK
    if pad:
        probs = torch.nn.functional.pad(probs, (0, pad))
    blocks = probs.view(rows, -1, _DRAW_BLOCK)
    # Block sums in fp32 (a sum with dtype=float64 first converts the whole [rows, vocab] to fp64:
    # 0.7 of 1.0 ms at 16 rows), their cumulative sum in fp64.
    block, target, before = pick_block(blocks.sum(dim=-1).double().cumsum(dim=-1), uniforms)
    inner = blocks.gather(1, block.unsqueeze(-1).expand(rows, 1, _DRAW_BLOCK)).squeeze(1).cumsum(dim=-1,
                                                                                               dtype=torch.float64)
    return pick_in_block(inner, block, target=target, before=before, vocab=vocab)


def pick_block(block_cdf: torch.Tensor, uniforms: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The draw's first level (``_draw``): ``(block, target, before)``, the block whose interval of
    the fp64 cumulative block sums ``block_cdf`` ``(rows, blocks)`` holds ``u x total``, that target
    and the cumulative sum before the block."""
    rows = block_cdf.shape[0]
    total = block_cdf[:, -1:]
    u = uniforms.to(torch.float64).view(rows, 1)
    zero = torch.zeros_like(total)
    target = torch.minimum(u * total, torch.nextafter(total, zero))
    # A NaN total (non-finite logits) searches past the end: kept in range, so the step does not
    # fail with an index error; the row's log-prob is NaN, which the generator reports with its
    # weights version (base.check_finite_logprobs).
    block = torch.searchsorted(block_cdf, target, right=True).clamp_(max=block_cdf.shape[1] - 1)
    before = torch.where(block > 0, block_cdf.gather(1, (block - 1).clamp(min=0)), zero)
    return block, target, before


def pick_in_block(inner: torch.Tensor, block: torch.Tensor, *, target: torch.Tensor, before: torch.Tensor,
                  vocab: int) -> torch.Tensor:
    """The draw's second level (``_draw``): the token, from the chosen block's fp64 cumulative sums
    ``inner`` ``(rows, block size)``."""
    # The block's own sum and its cumulative sum round differently: stay strictly inside the latter.
    offset = torch.minimum(target - before, torch.nextafter(inner[:, -1:], torch.zeros_like(before)))
    # The clamp is a no-op for a finite row (its offset stays strictly inside); a NaN row is kept in range.
    return (block * _DRAW_BLOCK + torch.searchsorted(inner, offset, right=True)).squeeze(-1).clamp_(max=vocab - 1)


def unfiltered(sampling: SamplingParams, *, vocab: int) -> bool:
    """True when ``sampling`` draws from the whole ``softmax(logits / T)`` of a ``vocab``-token
    vocabulary: ``temperature > 0`` without top-k or top-p filtering."""
    return sampling.temperature > 0 and not 0 < sampling.top_k < vocab and sampling.top_p >= 1.0


def draw_with_logprobs(probs: torch.Tensor, uniforms: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``_draw`` over unfiltered probabilities ``probs`` (fp32 ``(rows, vocab)``), and the drawn
    tokens' log-probs as the logs of their probabilities (within ~1e-7 of log_softmax's; a token
    whose probability underflows to 0 is never drawn): log_softmax then exp were two passes over the
    vocabulary, 1.5 vs 0.5 ms at 16 rows of 49k on one thread."""
    tokens = _draw(probs, uniforms)
    return tokens, probs.gather(-1, tokens.unsqueeze(-1)).squeeze(-1).log()


def sample_tokens(
    logits: torch.Tensor, *, sampling: SamplingParams, uniforms: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
):
    """Pick one token per row of ``logits`` ``(batch, vocab)``; return ``(tokens, logprobs)``.

    Contract: tokens are int64 ``(batch,)``; logprobs are fp32 ``(batch,)`` behaviour log-probs as
    documented in llamarl/engines/torch_engine.py (greedy when ``temperature == 0``). Row r is
    drawn with ``uniforms[r]`` (``(batch,)`` in [0, 1): the decode loops pass their rows' entries of
    ``draw_uniforms``) or, without them, with one uniform per row from ``generator``, so a seeded
    generator or the same uniforms make the draw reproducible. Every op is a tensor op on the
    logits' device (no host synchronisation).
    """
    if sampling.temperature > 0 and uniforms is None:
        uniforms = torch.rand(logits.shape[0], generator=generator, dtype=torch.float64, device=logits.device)
    if sampling.temperature == 0:
        return _greedy(logits)
    if unfiltered(sampling, vocab=logits.shape[-1]):
        # No filtering: one softmax pass gives what is drawn from (draw_with_logprobs).
        x = logits if sampling.temperature == 1.0 else logits.float() / sampling.temperature
        return draw_with_logprobs(torch.softmax(x, dim=-1, dtype=torch.float32), uniforms)
    logp = filtered_logprobs(logits, temperature=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k)
    tokens = _draw(logp.exp(), uniforms)
    return tokens, logp.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
