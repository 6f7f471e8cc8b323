"""The native engine's one decode loop, over any decoder of the slot protocol
(llamarl/engines/decoder.py): the static CUDA-graph step (static_decode.py), the fused CPU step
(cpu/fused_decode.py) and HF's modules (hf_decoder.py). Every per-step decision is on the device;
the host looks every few steps.

A step of the loop: the first ``rows`` slots of the decoder's state run one decode step, every slot
of them samples a token from its logits with its request's own uniform (llamarl/engines/sampling.py:
the draw does not depend on the batch), and the bookkeeping is tensor ops: a live slot's token and
log-prob are written at its request's next column, its count grows, EOS / stop ids or its limit
mark it finished, its fed token and position advance. A finished slot keeps feeding its last token
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

Outputs: for every decoder the same tokens in fp32 greedy and for a seeded sample (each row's
numbers do not depend on the other rows of its batch), log-probs equal to rounding.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from llamarl.engines.base import Request, SamplingParams
from llamarl.engines.decoder import Decoder, SlotState
from llamarl.engines.static_shapes import bucket


@dataclass
class LoopHost:
    """What the loop takes from its engine, explicitly."""

    prefill: Callable[[list[tuple[int, ...]]], tuple[torch.Tensor, Any, torch.Tensor]]
    """Contexts -> (next-token logits ``[n, vocab]``, their HF cache, its mask ``[n, T]``), left-padded."""
    sample: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    """``sample(logits, sampling=, uniforms=)`` -> (tokens, log-probs): the engine's sampler."""
    stop_ids: list[int]
    """EOS and the call's stop ids."""
    kept: dict[int, tuple[tuple[int, ...], list[torch.Tensor], list[torch.Tensor]]]
    """The engine's kept carried caches by sample id: ``(context when carried, keys, values)``."""
    keep_carried: bool
    """``carried_cache == "keep"``: a row ended by its budget keeps its cache for its next call."""
    max_num_seqs: int | None
    """At most this many rows at once (None: every request of a call)."""
    eos_check_every: int
    """Steps between two looks, for a bucketed decoder."""
    on_kept_rows: Callable[[int], None]
    """Called with the number of rows resumed from kept caches (the engine's counter)."""


class _Books:
    """The loop's device-side records, one row per request plus a trash row (index ``n``) that
    empty and finished slots write to, so every write is unconditional."""

    def __init__(self, *, num_requests: int, limits: list[int], slots: int, device: torch.device) -> None:
        n, width = num_requests, max(limits) + 1
        self.trash = n
        self.ids = torch.zeros((n + 1, width), dtype=torch.long, device=device)
        self.lps = torch.zeros((n + 1, width), dtype=torch.float32, device=device)
        self.num_new = torch.zeros(n + 1, dtype=torch.long, device=device)
        self.stopped = torch.zeros(n + 1, dtype=torch.bool, device=device)
        self.limit = torch.tensor([*limits, width], dtype=torch.long, device=device)
        self.slot_request = torch.full((slots,), n, dtype=torch.long, device=device)
        self.alive = torch.zeros(slots, dtype=torch.bool, device=device)


def decode(decoder: Decoder, host: LoopHost, reqs: list[Request], *, contexts: list[tuple[int, ...]],
           limits: list[int], sampling: SamplingParams, uniforms: torch.Tensor | None, device: torch.device):
    """Decode ``reqs`` (their ``contexts`` and per-request ``limits``) with ``decoder`` (module
    docstring); return per-request new token ids, log-probs and whether a stop id ended it."""
    n = len(reqs)
    capacity = min(n, host.max_num_seqs or n)
    state = decoder.reserve(capacity=capacity, positions=max(len(c) + lim for c, lim in zip(contexts, limits)))
    books = _Books(num_requests=n, limits=limits, slots=state.capacity, device=device)
    if uniforms is not None:  # the trash row and a column past every limit: padding slots' draws
        uniforms = torch.nn.functional.pad(uniforms, (0, books.ids.shape[1] - uniforms.shape[1], 0, 1))
    eos = torch.tensor(host.stop_ids, dtype=torch.long, device=device)
    carries = [host.keep_carried and decoder.keeps_caches and limit < sampling.max_new_tokens - len(r.completion_ids)
               for limit, r in zip(limits, reqs)]
    # Host view: the request in each slot. Only the first max_num_seqs slots take requests; the
    # state's rounding up to a bucket leaves the others empty.
    slot_of: list[int | None] = [None] * capacity
    slot_ids = torch.arange(state.capacity, device=device)
    # A decoder that samples inside its step (static_decode.py, static_sampling.py) keeps per-slot
    # records, drained into the books at each look; the slots' liveness is its records' own.
    in_step = getattr(decoder, "samples_in_step", False)
    if in_step:
        state.records.begin(host.stop_ids)
        books.alive = state.records.alive

    def record(slots: torch.Tensor, logits: torch.Tensor, live: torch.Tensor) -> None:
        """Sample every slot of ``slots`` from its ``logits``; book the tokens of the ``live`` ones."""
        request = books.slot_request[slots]
        column = books.num_new[request]
        tokens, lps = host.sample(logits, sampling=sampling,
                                  uniforms=None if uniforms is None else uniforms[request, column])
        if in_step:  # the step's own books, eagerly (a look's ops)
            state.records.book(slots, tokens, lps, None, fed=state.tokens, positions=state.positions)
            return
        target = torch.where(live, request, books.trash)
        books.ids[target, column] = tokens
        books.lps[target, column] = lps
        # Live slots hold distinct requests; the others all write the trash row, whose count nothing
        # reads: a plain indexed write (an accumulating one may check its indices on the host).
        books.num_new[target] = books.num_new[target] + live.long()
        hit = (tokens.unsqueeze(1) == eos).any(dim=1) & live  # torch.isin syncs for long id lists
        books.stopped[target] = hit
        still = live & ~hit & (books.num_new[request] < books.limit[request])
        books.alive[slots] = still
        state.tokens[slots] = torch.where(still, tokens, state.tokens[slots])
        state.positions[slots] += still.long()

    def admit(slots: list[int], indices: list[int]) -> None:
        """Put requests ``indices`` into the free ``slots``: a carried sample with a kept cache from
        it (its last token fed at the next step), the others prefilled and their first token drawn."""
        entries = {}
        for i in indices:
            entry = host.kept.pop(reqs[i].sample_id, None) if decoder.keeps_caches else None
            entries[i] = entry if entry is not None and entry[0] == contexts[i] else None  # else dropped
        # Fresh rows take the first slots, kept ones the next (a state that appends rows loads in order).
        indices = [i for i in indices if entries[i] is None] + [i for i in indices if entries[i] is not None]
        kept, fresh = [], []
        for slot, i in zip(slots, indices):
            (kept if entries[i] is not None else fresh).append((slot, i, entries[i]))
            slot_of[slot] = i
        # Every admitted slot feeds its last context token at its position next: for a kept row,
        # the token its cache lacks; for a fresh one (its first token drawn below), what its
        # prefill cached there, rewritten alike if it ends at once and is stepped before the next look.
        where = torch.tensor(slots, dtype=torch.long, device=device)
        books.slot_request[where] = torch.tensor(indices, dtype=torch.long, device=device)
        state.tokens[where] = torch.tensor([contexts[i][-1] for i in indices], dtype=torch.long, device=device)
        state.positions[where] = torch.tensor([len(contexts[i]) - 1 for i in indices], device=device)
        if in_step:
            state.records.admit(where, bases=[len(contexts[i]) - 1 for i in indices],
                                limits=[limits[i] for i in indices],
                                uniforms=None if uniforms is None else uniforms[books.slot_request[where]])
        if fresh:
            logits, cache, mask = host.prefill([contexts[i] for _, i, _ in fresh])
            targets = [slot for slot, _, _ in fresh]
            state.load_prefill(targets, cache=cache, mask=mask, lengths=[len(contexts[i]) for _, i, _ in fresh])
            record(torch.tensor(targets, dtype=torch.long, device=device), logits,
                   torch.ones(len(fresh), dtype=torch.bool, device=device))
        if kept:
            host.on_kept_rows(len(kept))
            for slot, i, entry in kept:  # kept caches of different lengths: one row at a time
                state.load([slot], keys=[k.unsqueeze(0) for k in entry[1]], values=[v.unsqueeze(0) for v in entry[2]],
                           lengths=[len(contexts[i]) - 1], left_padded=False)
            books.alive[torch.tensor([slot for slot, _, _ in kept], dtype=torch.long, device=device)] = True

    def drain() -> None:
        """Gather the step's per-slot records into the books (a look's few ops, any number of steps
        since the last); grow the top-p candidates if a row stalled on them (static_sampling.py)."""
        nonlocal key
        records, request = state.records, books.slot_request
        columns = (records.base.unsqueeze(1) + torch.arange(books.ids.shape[1], device=device)).clamp_(
            max=records.ids.shape[1] - 1)
        books.ids[request] = records.ids.gather(1, columns)
        books.lps[request] = records.lps.gather(1, columns)
        books.num_new[request] = records.counts(state.positions)
        books.stopped[request] = records.stopped
        if key[3] and bool(records.overflow.any()):
            decoder.grow_candidates(key)
            key = decoder.sampling_key(sampling)
            records.overflow.zero_()

    key = decoder.sampling_key(sampling) if in_step else None
    pending = list(range(n))
    check_every = host.eos_check_every if decoder.bucketed else 1
    steps_since_check = check_every  # check (and admit) before the first step
    rows = 0
    spans = getattr(decoder, "attention_span", None)
    while True:
        if steps_since_check >= check_every:
            steps_since_check = 0
            rows = _check(decoder=decoder, books=books, state=state, slot_of=slot_of, pending=pending, admit=admit,
                          reqs=reqs, contexts=contexts, carries=carries, kept=host.kept, drain=drain if in_step else None)
            if not rows:
                break
            # The attention's columns until the next look (static_shapes.span_rung): the live KV, not the width.
            span = {"span": spans(state, rows, steps=check_every)} if spans is not None else {}
        if in_step:  # one replay: the draw and the books are in the step
            decoder.step(state, rows, sampling=key, **span)
        else:
            record(slot_ids[:rows], decoder.step(state, rows, **span), books.alive[:rows])
        steps_since_check += 1
    decoder.num_calls += 1
    # One host transfer for the whole batch, then plain slicing.
    ids_rows, lps_rows, counts = books.ids[:n].tolist(), books.lps[:n].tolist(), books.num_new[:n].tolist()
    return ([row[:c] for row, c in zip(ids_rows, counts)], [row[:c] for row, c in zip(lps_rows, counts)],
            books.stopped[:n].tolist())


def _compact(*, books: _Books, state: SlotState, slot_of: list[int | None], live: list[int], drop: bool) -> None:
    """Bring the ``live`` slots (ascending) into slots ``0 .. len(live) - 1``, their books with them.
    ``drop`` (a decoder whose rows are exactly the live ones, in order): every live slot moves to
    its rank, and the state lets the other rows go even where nothing moves. Otherwise (a bucketed
    state) only the live slots past ``len(live)`` move, into the free slots before it: a finer
    bucket ladder compacts more often, and a move copies every column of a row."""
    device = books.alive.device
    if drop:
        sources, targets = live, list(range(len(live)))
    else:
        sources = [s for s in live if s >= len(live)]
        targets = sorted(set(range(len(live))) - set(live))
    if sources != targets or drop:
        state.move(sources, targets, num_columns=state.width)
        src, dst = (torch.tensor(s, dtype=torch.long, device=device) for s in (sources, targets))
        books.slot_request[dst] = books.slot_request[src].clone()
        books.alive[dst] = books.alive[src].clone()
    held = {s: slot_of[s] for s in live}
    for source, target in zip(sources, targets):
        held[target] = held.pop(source)
    slot_of[:] = [None] * len(slot_of)
    for slot, i in held.items():
        slot_of[slot] = i
    free_after = torch.arange(len(live), len(books.alive), device=device)
    books.slot_request[free_after] = books.trash
    books.alive[free_after] = False


def _check(*, decoder: Decoder, books: _Books, state: SlotState, slot_of: list[int | None], pending: list[int],
           admit, reqs, contexts, carries, kept, drain=None) -> int:
    """The host's look at the loop (module docstring): retire finished rows, admit pending ones,
    compact; return the rows the next steps run (0: nothing left). ``drain``: brings the books up
    to date first (a decoder that samples inside its step)."""
    while True:
        if drain is not None:
            drain()
        alive = books.alive.tolist()
        finished = [slot for slot, i in enumerate(slot_of) if i is not None and not alive[slot]]
        if finished:
            counts, stopped = books.num_new.tolist(), books.stopped.tolist()
            for slot in finished:
                i = slot_of[slot]
                slot_of[slot] = None
                if carries[i] and not stopped[i]:  # ended by its budget: carried
                    # Its cache holds all but its last sampled token (fed on resume).
                    length = len(contexts[i]) + counts[i] - 1
                    keys, values = state.row_cache(slot, length)
                    new = tuple(books.ids[i, : counts[i]].tolist())
                    kept[reqs[i].sample_id] = (contexts[i] + new, keys, values)
            books.slot_request[torch.tensor(finished, dtype=torch.long, device=books.alive.device)] = books.trash
            if not decoder.bucketed:  # its rows are exactly the live ones, from slot 0
                _compact(books=books, state=state, slot_of=slot_of,
                         live=[slot for slot, i in enumerate(slot_of) if i is not None], drop=True)
        free = [slot for slot, i in enumerate(slot_of) if i is None]
        if not decoder.admits_mid_decode and len(free) < len(slot_of):
            break  # the next batch when this one is done
        if not pending or not free:
            break
        taken = min(len(free), len(pending))
        admit(free[:taken], pending[:taken])
        del pending[:taken]
    live = [slot for slot, i in enumerate(slot_of) if i is not None]
    if not live:
        return 0
    if not decoder.bucketed:
        return len(live)
    rows = bucket(live[-1] + 1)
    if not pending and bucket(len(live)) < rows:
        _compact(books=books, state=state, slot_of=slot_of, live=live, drop=False)
        rows = bucket(len(live))
    return rows
