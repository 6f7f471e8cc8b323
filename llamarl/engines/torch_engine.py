"""Native batched generation for any HF causal LM, with exact behaviour log-probs and partial rollouts
(the ``torch`` engine of llamarl/engines/base.py's contract).

The decode loop is written here (not ``model.generate``) so that the engine controls exactly which
distribution each token is drawn from, reports its log-prob, and can stop a request after a per-call
token budget (LlamaRL §4.2 / AReaL interruptible generation): such a request comes back "carried" and
is later re-submitted, possibly after a weight update, with its partial completion. Every token is
tagged with the weight ``version`` that produced it, so the trainer can correct for off-policyness.

Batching: prompts are left-padded into one batch, with an explicit attention mask and position ids,
and prefilled with the HF model into a transformers ``DynamicCache``. The decode steps run through
``FusedDecoder`` (llamarl/engines/fused_decode.py: fused, pre-packed projections over a
preallocated KV cache) for the Llama-family layouts it supports, else through the HF modules.
Finished rows are dropped from the batch and the KV cache, so long stragglers do not drag dead rows
through every forward pass.

Behaviour log-prob (what ``Completion.logprobs`` holds), computed in fp32:

* ``temperature > 0``: log-prob of the sampled token under the distribution actually sampled from,
  i.e. ``softmax(logits / T)`` restricted to the top-k / top-p set and renormalised (vLLM's
  "processed logprobs"). With ``top_p == 1`` and ``top_k == 0`` this is ``log_softmax(logits / T)``.
* ``temperature == 0`` (greedy, argmax): ``log_softmax(logits)`` at the argmax, i.e. T = 1 and no
  filtering (top-k / top-p are ignored; they cannot change the argmax).
"""

from __future__ import annotations

import torch
from transformers import DynamicCache

from llamarl.engines.fused_decode import FusedDecoder
from llamarl.engines.base import (
    FINISH_CARRIED,
    FINISH_LENGTH,
    FINISH_STOP,
    Completion,
    EngineSetup,
    Request,
    SamplingParams,
    check_request,
    finish_completion,
    register_engine,
    stop_ids,
)


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
    x = logits.float() / temperature
    if 0 < top_k < x.shape[-1]:
        kth = torch.topk(x, top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    if top_p < 1.0:
        x = x.masked_fill(~_nucleus(x.softmax(dim=-1), top_p), float("-inf"))
    return torch.log_softmax(x, dim=-1)


def _nucleus(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Boolean mask of the top-p set: a token is kept while the mass strictly before it is < top_p."""
    vocab = probs.shape[-1]
    # A full-vocab sort costs ~200 ms for 64 x 49k on 2 threads; the nucleus is almost always inside
    # the top few hundred tokens, and once a top-k prefix holds >= top_p of the mass every token past
    # it is dropped anyway, so a growing top-k gives the exact same set far cheaper.
    k = min(vocab, 256)
    while True:
        vals, order = torch.topk(probs, k, dim=-1, sorted=True)
        cum = vals.cumsum(dim=-1)
        if k == vocab or bool((cum[..., -1] >= top_p).all()):
            break
        k = min(vocab, k * 8)
    keep_sorted = (cum - vals) < top_p
    return torch.zeros_like(probs, dtype=torch.bool).scatter_(-1, order, keep_sorted)


def _draw(logp: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """Sample one index per row from ``exp(logp)`` by inverse CDF (one uniform per row).

    Why not ``torch.multinomial``: it draws one exponential per vocab entry (~145 ms for 64 x 49k on
    2 threads, more than a decode step's matmuls); this costs ~20 ms. The CDF is accumulated in fp64 so
    even tokens with tiny probability keep an interval of the right width; zero-probability (filtered)
    tokens have empty intervals and can never be drawn.
    """
    cdf = logp.exp().cumsum(dim=-1, dtype=torch.float64)
    total = cdf[..., -1:]
    u = torch.rand(total.shape, generator=generator, dtype=torch.float64, device=logp.device)
    # Keep the target strictly below the total so rounding can never run off the end.
    target = torch.minimum(u * total, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cdf, target, right=True).squeeze(-1)


def sample_tokens(
    logits: torch.Tensor, *, sampling: SamplingParams, generator: torch.Generator | None = None
):
    """Pick one token per row of ``logits`` ``(batch, vocab)``; return ``(tokens, logprobs)``.

    Contract: tokens are int64 ``(batch,)``; logprobs are fp32 ``(batch,)`` behaviour log-probs as
    documented in the module docstring (greedy when ``temperature == 0``). Sampling draws from
    ``generator`` only, so a seeded generator makes the draw reproducible.
    """
    if sampling.temperature == 0:
        logp = torch.log_softmax(logits.float(), dim=-1)
        tokens = logp.argmax(dim=-1)
    else:
        logp = filtered_logprobs(
            logits, temperature=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k
        )
        tokens = _draw(logp, generator)
    return tokens, logp.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


class TorchEngine:
    """Batched KV-cached sampler over a live HF causal LM (weights may change in place between calls)."""

    def __init__(self, model: torch.nn.Module, *, eos_token_ids: list[int], pad_token_id: int,
                 fused_decode: bool = True):
        """Wrap ``model`` (any HF causal LM accepting ``past_key_values`` and ``logits_to_keep``).

        Contract: the engine keeps only a reference to ``model`` and caches nothing derived from its
        weights, so in-place weight updates between ``generate`` calls take effect at once. Generation
        stops at any id in ``eos_token_ids`` or in the call's ``sampling.stop_token_ids`` (none: only
        at the length limits).
        ``pad_token_id`` fills left padding; it is always masked, so any valid id works.
        ``fused_decode``: decode steps through ``FusedDecoder`` where it supports the model
        (llamarl/engines/fused_decode.py: the same tokens, ~1.8x faster steps on CPU); False: the
        HF modules for every step.
        """
        self.model = model
        self.eos_token_ids = [int(t) for t in eos_token_ids]
        self.pad_token_id = int(pad_token_id)
        self.fused_decode = fused_decode
        self._fused: FusedDecoder | None = None

    def weights_updated(self, model: torch.nn.Module) -> None:
        """Nothing to do: the engine samples from the live model, whose weights changed in place."""
        if model is not self.model:
            raise ValueError("TorchEngine samples from the model it was built with; new weights must be "
                             "written into that model")

    def close(self) -> None:
        """Nothing to release (the model belongs to the caller)."""

    @torch.no_grad()
    def generate(
        self,
        requests: list[Request],
        *,
        sampling: SamplingParams,
        version: int,
        generator: torch.Generator | None = None,
        token_budget: int | None = None,
    ) -> list[Completion]:
        """Generate (or continue) every request; return one ``Completion`` per request, in input order.

        Contract (``llamarl.engines.base.GenerationEngine``): each request ends when it samples an EOS
        or stop id ("stop"; the id is kept in ``completion_ids``), when its completion reaches ``sampling.max_new_tokens`` tokens counting
        carried ones ("length"), or, if ``token_budget`` is set, after ``token_budget`` new tokens in
        this call ("carried", resumable with ``Completion.to_request``). Carried-in tokens, log-probs and
        versions are returned unchanged; new tokens are tagged ``version``. A resumed request is
        re-prefilled from prompt + partial completion, so with unchanged weights and greedy decoding a
        carried-then-resumed sample equals the uninterrupted one. The model is run in eval mode and its
        previous train/eval mode is restored afterwards.
        """
        if token_budget is not None and token_budget < 1:
            raise ValueError(f"token_budget must be >= 1 (or None), got {token_budget}")
        vocab = self.model.get_input_embeddings().num_embeddings
        device = self.model.get_input_embeddings().weight.device
        if generator is not None and sampling.temperature > 0 and generator.device.type != device.type:
            # torch.rand(generator=...) must draw on the logits' device; say so before any work.
            raise ValueError(f"the sampling generator is on {generator.device} but the model is on {device}; "
                             f"create it with torch.Generator(device=ctx.device)")
        results: list[Completion | None] = [None] * len(requests)
        rows, limits = [], []
        for i, req in enumerate(requests):
            check_request(req, sampling=sampling, eos_token_ids=self.eos_token_ids, vocab=vocab)
            remaining = sampling.max_new_tokens - len(req.completion_ids)
            if remaining == 0:
                results[i] = finish_completion(req, [], [], version, FINISH_LENGTH)
                continue
            rows.append(i)
            limits.append(remaining if token_budget is None else min(remaining, token_budget))
        if rows:
            was_training = self.model.training
            self.model.eval()
            try:
                new_ids, new_lps, stopped = self._decode(
                    [requests[i] for i in rows], limits=limits, sampling=sampling, generator=generator
                )
            finally:
                self.model.train(was_training)
            for i, ids, lps, stop in zip(rows, new_ids, new_lps, stopped):
                req = requests[i]
                if stop:
                    reason = FINISH_STOP
                elif len(req.completion_ids) + len(ids) >= sampling.max_new_tokens:
                    reason = FINISH_LENGTH
                else:
                    reason = FINISH_CARRIED
                results[i] = finish_completion(req, ids, lps, version, reason)
        return results

    def _forward(self, input_ids, *, attention_mask, position_ids, cache) -> torch.Tensor:
        # logits_to_keep=1: prefill computes the vocab projection for the last position only.
        out = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=1,
        )
        return out.logits[:, -1]

    def _decode(self, reqs: list[Request], *, limits: list[int], sampling: SamplingParams, generator):
        """Run prefill + decode; return per-request new token ids, log-probs and whether EOS stopped it."""
        device = self.model.get_input_embeddings().weight.device
        all_contexts = [tuple(r.prompt_ids) + tuple(r.completion_ids) for r in reqs]
        # GRPO submits each prompt once per sample of its group: prefill each distinct context once and
        # copy its KV cache and logits to every row that shares it. On CPU prefill is most of a short
        # rollout's time (16 prompts x 4 samples, 45 prompt + 12 new tokens: ~5 s of ~8 s on 1 thread),
        # and the copies are the very values the duplicated rows would have computed.
        first_row: dict[tuple[int, ...], int] = {}
        source = [first_row.setdefault(c, len(first_row)) for c in all_contexts]
        contexts = list(first_row)
        batch, width = len(all_contexts), max(len(c) for c in contexts)
        # Assembled on the host from Python lists (one copy to the model's device below).
        input_ids = torch.full((len(contexts), width), self.pad_token_id, dtype=torch.long, device="cpu")
        mask = torch.zeros((len(contexts), width), dtype=torch.long, device="cpu")
        for b, ctx in enumerate(contexts):
            input_ids[b, width - len(ctx) :] = torch.tensor(ctx, dtype=torch.long, device="cpu")
            mask[b, width - len(ctx) :] = 1
        input_ids, mask = input_ids.to(device), mask.to(device)
        # Left padding: real tokens get positions 0..len-1 whatever their column.
        positions = (mask.cumsum(dim=-1) - 1).clamp_min(0)
        next_pos = torch.tensor([len(c) for c in all_contexts], dtype=torch.long, device=device)

        # Checked per call: tensor parallelism may have been applied after the engine was built.
        fused = None
        if self.fused_decode and FusedDecoder.supports(self.model, length=width + max(limits)):
            fused = self._fused = self._fused or FusedDecoder(self.model)
        # Sliding-window layers (Gemma2, Mistral configs with a window) build a tensor in the
        # cache's constructor without a device; build it on the inputs' device on purpose (under
        # --run.device-guard the default device is meta, and the cache would hold a meta tensor).
        with torch.device(device):
            cache = DynamicCache(config=self.model.config)
        logits = self._forward(input_ids, attention_mask=mask, position_ids=positions, cache=cache)
        if len(contexts) < batch:
            rows_from = torch.tensor(source, dtype=torch.long, device=device)
            logits, mask = logits[rows_from], mask[rows_from]
            cache.batch_select_indices(rows_from)

        max_steps = max(limits)
        state = fused.start(cache, mask, num_steps=max_steps) if fused is not None else None
        out_ids = torch.zeros((batch, max_steps), dtype=torch.long, device=device)
        out_lps = torch.zeros((batch, max_steps), dtype=torch.float32, device=device)
        n_new = torch.zeros(batch, dtype=torch.long, device=device)
        stopped = torch.zeros(batch, dtype=torch.bool, device=device)
        limit = torch.tensor(limits, dtype=torch.long, device=device)
        eos = torch.tensor(stop_ids(self.eos_token_ids, sampling), dtype=torch.long, device=device)
        active = torch.arange(batch, device=device)  # original row of each live batch row
        for step in range(max_steps):
            tokens, lps = sample_tokens(logits, sampling=sampling, generator=generator)
            out_ids[active, step] = tokens
            out_lps[active, step] = lps
            hit_eos = torch.isin(tokens, eos)
            done = hit_eos | (limit[active] <= step + 1)
            if bool(done.any()):
                n_new[active[done]] = step + 1
                stopped[active[done]] = hit_eos[done]
                keep = (~done).nonzero().squeeze(1)
                if keep.numel() == 0:
                    break
                # Shrink the batch so finished rows cost nothing in later steps.
                active, tokens, mask, next_pos = active[keep], tokens[keep], mask[keep], next_pos[keep]
                if state is not None:
                    state.keep(keep)
                else:
                    cache.batch_select_indices(keep)
            if state is not None:
                logits = fused.step(state, tokens, next_pos)
            else:
                mask = torch.cat([mask, mask.new_ones((mask.shape[0], 1))], dim=1)
                logits = self._forward(
                    tokens.unsqueeze(1), attention_mask=mask, position_ids=next_pos.unsqueeze(1), cache=cache
                )
            next_pos = next_pos + 1

        # One host transfer for the whole batch, then plain slicing.
        ids_rows, lps_rows, counts = out_ids.tolist(), out_lps.tolist(), n_new.tolist()
        new_ids = [row[:n] for row, n in zip(ids_rows, counts)]
        new_lps = [row[:n] for row, n in zip(lps_rows, counts)]
        return new_ids, new_lps, stopped.tolist()


@register_engine("torch")
def _build_torch_engine(setup: EngineSetup) -> TorchEngine:
    return TorchEngine(setup.model, eos_token_ids=setup.eos_token_ids, pad_token_id=setup.pad_token_id,
                       fused_decode=setup.fused_decode)
