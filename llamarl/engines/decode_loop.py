"""The native engine's one decode loop, over any decoder of the slot protocol
(llamarl/engines/decoder.py): the static CUDA-graph step (static_decode.py), the fused CPU step
(cpu/fused_decode.py) and HF's modules (hf_decoder.py). Every per-step decision is on the device;
the host looks every few steps.

A step of the loop: the first ``rows`` slots of the decoder's state run one decode step, every slot
of them samples a token from its logits with its request's own uniform (llamarl/engines/sampling.py:
the draw does not depend on the batch), and the bookkeeping is tensor ops: a live slot's token and
log-prob are written at its request's next column, its count grows, EOS / stop ids or its limit
mark it finished, its fed token and position advance. Stop strings are searched at the looks
(scheduler.py): a row whose text reached one is cut exactly there and retired at that look. A finished slot keeps feeding its last token
at its last position: the step rewrites keys and values it already wrote, from the same inputs, so
its cache stays that of its tokens (what a kept carried cache needs). Nothing here reads a device
value on the host between two looks.

A decoder that ``samples_in_step`` (the static decoder: static_sampling.py) does all of that inside
its step (one CUDA graph replay, no eager op between two looks) over per-slot records indexed by
position; the loop copies a row's uniforms into its slot at admission and, at each look, drains the
records into the books below (``drain``) before reading them. Its steps also take an attention
``span`` (the live columns until the next look: static_shapes.span_rung), asked at each look.

At a look (every ``eos_check_every`` steps for a bucketed decoder, every step for the others,
whose host reads are free or whose rows must be exactly the live ones) the host reads which slots
are still live: finished rows leave (a carried row's cache is kept when ``carried_cache="keep"``
and the decoder keeps caches), pending requests take the free slots (continuous batching:
prefilled, their first token drawn from the prefill's logits at once; a decoder that cannot admit
rows mid-decode takes the next batch when its state is empty), and the live rows are compacted:
into the smallest bucket that holds them when nothing is pending (bucketed decoders), to the front
of the state at every look (the others).

The host side (books, admission, retirement, compaction, carried caches) is one object,
``Scheduler`` (llamarl/engines/scheduler.py); the loop below is its two moves.

Outputs: for every decoder the same tokens in fp32 greedy and for a seeded sample (each row's
numbers do not depend on the other rows of its batch), log-probs equal to rounding.
"""

from __future__ import annotations

import torch

from llamarl.engines.base import Request, SamplingParams
from llamarl.engines.decoder import Decoder
from llamarl.engines.scheduler import LoopHost, Scheduler

__all__ = ["LoopHost", "decode"]


def decode(decoder: Decoder, host: LoopHost, reqs: list[Request], *, contexts: list[tuple[int, ...]],
           limits: list[int], sampling: SamplingParams, uniforms: torch.Tensor | None, device: torch.device):
    """Decode ``reqs`` (their ``contexts`` and per-request ``limits``) with ``decoder`` (module
    docstring); return per-request new token ids, log-probs, whether a stop id or string ended it
    and the stop string that did (None: none; ``host.text_stops``, scheduler.py)."""
    scheduler = Scheduler(decoder, host, reqs, contexts=contexts, limits=limits, sampling=sampling,
                          uniforms=uniforms, device=device)
    while rows := scheduler.look():  # retire, admit, compact: the only host reads
        for _ in range(scheduler.steps_per_look):
            scheduler.step(rows)
    decoder.num_calls += 1
    return scheduler.results()
