"""Native batched generation for any HF causal LM, with exact behaviour log-probs and partial rollouts
(the ``torch`` engine of llamarl/engines/base.py's contract).

The decode loop is written here (not ``model.generate``) so that the engine controls exactly which
distribution each token is drawn from, reports its log-prob, and can stop a request after a per-call
token budget (LlamaRL §4.2 / AReaL interruptible generation): such a request comes back "carried" and
is later re-submitted, possibly after a weight update, with its partial completion. Every token is
tagged with the weight ``version`` that produced it, so the trainer can correct for off-policyness.

Batching: the static and fused decoders' rows are prefilled packed, straight into their KV state
(packed_prefill.py: the distinct contexts back to back, no padding, no ``DynamicCache``); HF's
modules (and ``packed_prefill=False``) take the contexts left-padded into one batch, with an
explicit attention mask and position ids, into a transformers ``DynamicCache``. The decode steps
run in one loop (llamarl/engines/decode_loop.py) over a decoder of the slot protocol (decoder.py):
``StaticDecoder`` on CUDA (static_decode.py: static shapes, captured once per bucket as CUDA graphs
for the engine's life), the fused CPU step (cpu/fused_decode.py, the CPU
plugin, imported only there: fused, pre-packed projections over a preallocated KV cache, C kernels
in bf16) for the Llama-family layouts they support, else HF's modules (hf_decoder.py). Finished
rows leave the batch at the loop's looks, so long stragglers do not drag dead rows through every
forward pass.

Behaviour log-prob (what ``Completion.logprobs`` holds), computed in fp32:

* ``temperature > 0``: log-prob of the sampled token under the distribution actually sampled from,
  i.e. ``softmax(logits / T)`` restricted to the top-k / top-p set and renormalised (vLLM's
  "processed logprobs"). With ``top_p == 1`` and ``top_k == 0`` this is ``log_softmax(logits / T)``.
* ``temperature == 0`` (greedy, argmax): ``log_softmax(logits)`` at the argmax, i.e. T = 1 and no
  filtering (top-k / top-p are ignored; they cannot change the argmax), computed as the logit minus
  the row's logsumexp.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch
from transformers import DynamicCache

from llamarl.engines import packed_prefill
from llamarl.engines.base import (
    FINISH_CARRIED,
    FINISH_LENGTH,
    FINISH_STOP,
    Completion,
    Request,
    SamplingParams,
    check_request,
    finish_completion,
    stop_ids,
    turn_start,
)
from llamarl.engines.decode_loop import LoopHost, decode
from llamarl.engines.decoder import Decoder
from llamarl.engines.hf_decoder import HFDecoder
from llamarl.engines.sampling import draw_uniforms, filtered_logprobs, sample_tokens
from llamarl.engines.static_decode import StaticDecoder, poisons_device
from llamarl.engines.static_shapes import STATIC_DECODE_MODES
from llamarl.engines.stop_text import TextStops

if TYPE_CHECKING:
    from llamarl.engines.cpu.fused_decode import FusedDecoder

log = logging.getLogger("llamarl.engines.torch_engine")

__all__ = ["TorchEngine", "filtered_logprobs", "sample_tokens"]


def _sampler(device: torch.device):
    """``sample_tokens`` for logits on ``device``; on the CPU the plugin's (``sample_tokens_cpu``:
    the same draws, bf16 in C), imported here so that a CUDA run never loads llamarl/engines/cpu/."""
    if device.type != "cpu":
        return sample_tokens
    from llamarl.engines.cpu.sampling import sample_tokens_cpu

    return sample_tokens_cpu


def _fused_decoder() -> type[FusedDecoder]:
    """``FusedDecoder`` (the CPU plugin's fused decode step), imported only for a model on the CPU."""
    from llamarl.engines.cpu.fused_decode import FusedDecoder

    return FusedDecoder


class TorchEngine:
    """Batched KV-cached sampler over a live HF causal LM (weights may change in place between calls)."""

    def __init__(self, model: torch.nn.Module, *, eos_token_ids: list[int], pad_token_id: int,
                 fused_decode: bool = True, max_num_seqs: int | None = None, carried_cache: str = "recompute",
                 static_decode: str = "auto", eos_check_every: int = 8, tp_group=None, tp_src: int = 0,
                 packed_prefill: bool = True, sleep_mode: bool = False, tokenizer=None):
        """Wrap ``model`` (any HF causal LM accepting ``past_key_values`` and ``logits_to_keep``).

        Contract: the engine keeps only a reference to ``model`` and caches nothing derived from its
        weights, so in-place weight updates between ``generate`` calls take effect at once (the
        one exception is ``carried_cache="keep"``, below). Generation stops at any id in
        ``eos_token_ids`` or in the call's ``sampling.stop_token_ids`` (none: only at the length limits),
        and where its text reaches one of ``sampling.stop``, decoded with ``tokenizer`` at the decode
        loop's looks (llamarl/engines/stop_text.py; None: a call with stop strings is a ValueError).
        ``pad_token_id`` fills left padding; it is always masked, so any valid id works.
        ``fused_decode``: decode steps through ``FusedDecoder`` where it supports the model
        (llamarl/engines/cpu/fused_decode.py: the same tokens, ~1.8x faster steps on CPU); False: the
        HF modules for every step.
        ``max_num_seqs``: at most this many rows decode at once (None: every request of a call).
        On the fused path the batch stays full: when a row finishes, the next pending request is
        prefilled and takes its slot at that step (continuous batching); on the HF path the
        requests run in consecutive batches of this size.
        ``carried_cache``: what a carried sample's next call starts from. ``"recompute"``
        (default): its prompt + partial completion is prefilled again with the weights of that call
        (exact: every token's keys and values come from the current weights). ``"keep"``: the KV
        cache the sample had when it was carried is kept (fused path only) and decoding goes on from
        it, its last token fed with the new weights: no re-prefill, but the kept keys and values are
        those of the older weights (PipelineRL's in-flight weight update). Tokens keep their own
        ``versions`` either way. A kept cache lasts until its ``sample_id`` is next submitted: used
        if the request continues exactly where it was carried, dropped otherwise.
        ``static_decode``: the static-shape decode loop (llamarl/engines/static_decode.py and
        decode_loop.py: one cache for the engine's life, each batch bucket captured once as a CUDA
        graph on CUDA, finished rows seen every ``eos_check_every`` steps) for the models it
        supports (Llama, Qwen2, Mistral, Qwen3, unsharded). ``"auto"`` (default): on CUDA, the
        eager step captured as graphs (a failure in any call: one warning, HF's modules from then
        on; an error that poisons the CUDA context is raised), not on CPU (the fused step with its
        C kernels is faster there); ``"compiled"``: ``torch.compile`` first, wherever supported;
        ``"eager"``: uncompiled, wherever supported (graphs on CUDA); with either a failure is
        raised; ``"off"``: never. It takes precedence over ``fused_decode``.
        ``tp_group`` (a tensor-parallel model's group; None without TP) and ``tp_src`` (its first
        rank, global): every step's sampled tokens and their log-probs are the first rank's,
        broadcast over the group. TP peers compute the same logits up to the all-reduce's
        summation order; a peer that drew another token (a near-tie, a different RNG state) would
        otherwise decide "done" on its own and leave the others waiting in the next collective. One
        small broadcast per step; every rank of the group must call ``generate`` with the same requests.
        ``packed_prefill``: the fused and static paths prefill packed, straight into their state
        (llamarl/engines/packed_prefill.py) where the model supports it; False: left-padded into a
        ``DynamicCache``, then copied.
        ``sleep_mode``: the engine shares its device with a trainer (colocated): the generator calls
        ``sleep()`` after each step, which releases the static decoder's state (``close``).
        """
        if max_num_seqs is not None and max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1 (or None), got {max_num_seqs}")
        if carried_cache not in ("recompute", "keep"):
            raise ValueError(f"carried_cache must be 'recompute' or 'keep', got {carried_cache!r}")
        if static_decode not in STATIC_DECODE_MODES:
            raise ValueError(f"static_decode must be one of {STATIC_DECODE_MODES}, got {static_decode!r}")
        if eos_check_every < 1:
            raise ValueError(f"eos_check_every must be >= 1, got {eos_check_every}")
        self.model, self.tokenizer = model, tokenizer
        self.eos_token_ids = [int(t) for t in eos_token_ids]
        self.pad_token_id = int(pad_token_id)
        self.fused_decode, self.packed_prefill = fused_decode, packed_prefill
        self.max_num_seqs = max_num_seqs
        self.carried_cache = carried_cache
        self._fused: FusedDecoder | None = None
        self.static_decode, self.eos_check_every = static_decode, int(eos_check_every)
        self._static: StaticDecoder | None = None
        self._hf: HFDecoder | None = None
        # sample_id -> (its context when carried, per-layer keys, per-layer values) for "keep".
        self._kept: dict[int, tuple[tuple[int, ...], list[torch.Tensor], list[torch.Tensor]]] = {}
        self.tp_group, self.tp_src = tp_group, int(tp_src)
        self.sleep_mode = sleep_mode
        self.prefill_tokens = 0
        """Context tokens prefilled so far (cumulative; a kept cache saves its sample's)."""
        self.kept_cache_rows = 0
        """Carried samples resumed from a kept KV cache so far (cumulative)."""

    def _sample(self, logits: torch.Tensor, *, sampling: SamplingParams, uniforms: torch.Tensor | None):
        """``sample_tokens`` with the rows' ``uniforms``; under TP, the group's first rank's tokens and
        log-probs on every rank."""
        tokens, lps = _sampler(logits.device)(logits, sampling=sampling, uniforms=uniforms)
        if self.tp_group is None:
            return tokens, lps
        # One broadcast: token ids are exact in float64 (vocabularies are far below 2**53).
        packed = torch.stack([tokens.to(torch.float64), lps.to(torch.float64)])
        torch.distributed.broadcast(packed, src=self.tp_src, group=self.tp_group)
        return packed[0].to(torch.long), packed[1].to(torch.float32)

    def weights_updated(self, model: torch.nn.Module) -> None:
        """Nothing to do: the engine samples from the live model, whose weights changed in place."""
        if model is not self.model:
            raise ValueError("TorchEngine samples from the model it was built with; new weights must be "
                             "written into that model")

    @property
    def static_decoder(self) -> StaticDecoder | None:
        """The static decoder (its counters: ``num_steps``, ``num_captures``, ``capture_seconds``),
        None until the first static call and after a fallback to HF's modules."""
        return self._static

    def close(self) -> None:
        """Release the static decoder's state (its graphs, their pool, its KV cache); the model
        belongs to the caller."""
        if self._static is not None:
            self._static.release()

    def sleep(self) -> None:
        """Between generations, colocated (``Sleeps``; ``sleep_mode``): release the static decoder's
        state, its KV cache, logits and CUDA graphs with their pool, so the trainer gets the memory;
        the next ``generate`` reserves a new one and captures again. Kept carried caches
        (``carried_cache="keep"``) are the samples' own copies and stay. The same tokens either way."""
        self.close()

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
        or stop id ("stop"; the id is kept in ``completion_ids``) or its text reaches a stop string
        ("stop", cut as llamarl/engines/stop_text.py says; ``stop_text`` and ``text`` set), when its completion reaches ``sampling.max_new_tokens`` tokens counting
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
        stops = TextStops(self.tokenizer, sampling.stop, include=sampling.include_stop_text) if sampling.stop else None
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
                new_ids, new_lps, stopped, stop_texts = self._decode(
                    [requests[i] for i in rows], limits=limits, sampling=sampling, generator=generator, stops=stops
                )
            finally:
                self.model.train(was_training)
            for i, ids, lps, stop, stop_text in zip(rows, new_ids, new_lps, stopped, stop_texts):
                req = requests[i]
                if stop:
                    reason = FINISH_STOP
                elif len(req.completion_ids) + len(ids) >= sampling.max_new_tokens:
                    reason = FINISH_LENGTH
                else:
                    reason = FINISH_CARRIED
                results[i] = out = finish_completion(req, ids, lps, version, reason)
                if stop_text is not None:
                    out.stop_text = stop_text
                    out.text = stops.turn_text(out.completion_ids[turn_start(out):])
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

    def _decode(self, reqs: list[Request], *, limits: list[int], sampling: SamplingParams, generator,
                stops: TextStops | None = None):
        """Run prefill + decode; return per-request new token ids, log-probs, whether a stop id or
        string stopped it and the stop string that did."""
        contexts = [tuple(r.prompt_ids) + tuple(r.completion_ids) for r in reqs]
        width = max(len(c) + limit for c, limit in zip(contexts, limits))
        device = self.model.get_input_embeddings().weight.device
        uniforms = draw_uniforms(num_requests=len(reqs), num_tokens=max(limits), sampling=sampling,
                                 generator=generator, device=device)
        packed = self.packed_prefill and packed_prefill.supports(self.model, width=width)
        host = LoopHost(prefill=self._prefill, sample=self._sample, stop_ids=stop_ids(self.eos_token_ids, sampling),
                        kept=self._kept, keep_carried=self.carried_cache == "keep", max_num_seqs=self.max_num_seqs,
                        eos_check_every=self.eos_check_every, on_kept_rows=self._count_kept_rows,
                        prefill_into=self._prefill_into if packed else None, text_stops=stops)
        decoder = self._decoder(device, width=width)
        try:
            return decode(decoder, host, reqs, contexts=contexts, limits=limits, sampling=sampling, uniforms=uniforms,
                          device=device)
        except Exception as error:
            if decoder is not self._static or self.static_decode != "auto" or poisons_device(error):
                raise
            # The default path failed, in any call (a capture the driver refuses, memory for a
            # larger state, a missing compiler): the rest of the run decodes on HF's modules,
            # this call from its start, with the same draws, and says so once; asked for explicitly
            # (--generator.torch.static-decode eager / compiled), the failure is the caller's error.
            # Errors that leave the CUDA context unusable are never swallowed (poisons_device).
            log.warning("static decode loop failed (%s: %s); decoding with HF's modules from now on",
                        type(error).__name__, error)
            self.static_decode = "off"
            self._static.release()
            self._static = None
            self._kept.clear()  # kept caches are the static loop's; HF's modules recompute
            return decode(self._decoder(device, width=width), host, reqs, contexts=contexts, limits=limits,
                          sampling=sampling, uniforms=uniforms, device=device)

    def _decoder(self, device: torch.device, *, width: int) -> Decoder:
        """The decoder of this call (checked per call: tensor parallelism may have been applied after
        the engine was built): the static step where ``static_decode`` asks for it and it supports
        the model, else the fused CPU step where it does, else HF's modules."""
        if self._static_wanted(device) and StaticDecoder.supports(self.model, length=width):
            if self._static is None:
                self._static = StaticDecoder(self.model, compiled=self.static_decode == "compiled")
            return self._static
        if self.fused_decode and device.type == "cpu" and _fused_decoder().supports(self.model, length=width):
            self._fused = self._fused or _fused_decoder()(self.model)
            return self._fused
        if self._hf is None:
            self._hf = HFDecoder(self._forward, device=device)
        return self._hf

    def _count_kept_rows(self, rows: int) -> None:
        self.kept_cache_rows += rows

    def _static_wanted(self, device: torch.device) -> bool:
        """Whether ``static_decode`` asks for the static step on ``device`` (``__init__``)."""
        if self.static_decode == "auto":
            return device.type == "cuda"
        return self.static_decode in ("compiled", "eager")

    def _prefill_into(self, state, slots: list[int], contexts: list[tuple[int, ...]]) -> torch.Tensor:
        """``packed_prefill.prefill_into`` with this engine's model, its tokens counted."""
        self.prefill_tokens += sum(len(c) for c in set(contexts))
        return packed_prefill.prefill_into(self.model, state, slots, contexts)

    def _prefill(self, contexts: list[tuple[int, ...]]):
        """Prefill ``contexts`` with the HF model; return ``(logits [n, vocab], cache, mask [n, width])``
        for every context, left-padded. GRPO submits each prompt once per sample of its group: each
        distinct context is prefilled once and its KV cache and logits copied to every row that
        shares it (on CPU prefill is most of a short rollout's time: 16 prompts x 4 samples, 45
        prompt + 12 new tokens, ~5 s of ~8 s on 1 thread; the copies are the very values the
        duplicated rows would have computed)."""
        device = self.model.get_input_embeddings().weight.device
        first_row: dict[tuple[int, ...], int] = {}
        source = [first_row.setdefault(c, len(first_row)) for c in contexts]
        distinct = list(first_row)
        width = max(len(c) for c in distinct)
        self.prefill_tokens += sum(len(c) for c in distinct)
        # Assembled on the host from Python lists (one copy to the model's device below).
        input_ids = torch.full((len(distinct), width), self.pad_token_id, dtype=torch.long, device="cpu")
        mask = torch.zeros((len(distinct), width), dtype=torch.long, device="cpu")
        for b, ctx in enumerate(distinct):
            input_ids[b, width - len(ctx) :] = torch.tensor(ctx, dtype=torch.long, device="cpu")
            mask[b, width - len(ctx) :] = 1
        input_ids, mask = input_ids.to(device), mask.to(device)
        # Left padding: real tokens get positions 0..len-1 whatever their column.
        positions = (mask.cumsum(dim=-1) - 1).clamp_min(0)
        # Sliding-window layers (Gemma2, Mistral configs with a window) build a tensor in the
        # cache's constructor without a device; build it on the inputs' device on purpose (under
        # --run.device-guard the default device is meta, and the cache would hold a meta tensor).
        with torch.device(device):
            cache = DynamicCache(config=self.model.config)
        logits = self._forward(input_ids, attention_mask=mask, position_ids=positions, cache=cache)
        if len(distinct) < len(contexts):
            rows_from = torch.tensor(source, dtype=torch.long, device=device)
            logits, mask = logits[rows_from], mask[rows_from]
            cache.batch_select_indices(rows_from)
        return logits, cache, mask
