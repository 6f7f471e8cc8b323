"""The decode loop's scheduler (issue 45 item 1): which request runs in which slot of the decoder's
state, an object of its own rather than closures inside the loop (llamarl/engines/decode_loop.py
drives it: ``look``, then ``step`` until the next look, until ``look`` returns 0 rows).

What it owns, per ``decode`` call:

* **Books** (``_Books``): per request its new token ids, log-probs, count and whether a stop id
  ended it, on the device, plus a trash row that empty and finished slots write to, so every
  write is unconditional.
* **Admission**: pending requests take free slots, a carried sample with its kept cache (its last
  token fed at the next step), the others prefilled (packed, straight into the decoder's state
  where it ``prefills_into_state``: llamarl/engines/packed_prefill.py) and their first token drawn
  from the prefill's logits at once; a decoder that cannot admit rows mid-decode takes the next batch when
  its state is empty.
* **Stop strings** (``LoopHost.text_stops``; llamarl/engines/stop_text.py): at a look, before
  retirement, every row with tokens since the last look has the text of its turn searched (the new
  tokens and a short look-back, decoded on the host: a look's read); a row whose text reached a
  stop is cut exactly there (its count set to the kept tokens, the rest of its columns never read),
  marked stopped and retired at that look: it is charged no further step. Between two looks a row
  may run past its stop (at most ``eos_check_every`` - 1 steps, CUDA-graph decoder); those tokens
  are dropped.
* **Retirement**: at a look, the finished slots leave; a row ended by its budget keeps its cache
  for its next call when asked (``carried_cache="keep"``, a decoder that keeps caches).
* **Compaction**: the live rows move into the smallest bucket that holds them when nothing is
  pending (bucketed decoders), to the front of the state at every look (the others).
* **A step**: the decoder's step, then (a decoder that does not sample in its step) every slot
  samples with its request's own uniform and the books advance as tensor ops; a decoder that
  ``samples_in_step`` keeps per-slot records in its state, drained into the books at each look.

Nothing here reads a device value on the host between two looks.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from llamarl.engines.base import Request, SamplingParams, turn_start
from llamarl.engines.decoder import Decoder, SlotState
from llamarl.engines.static_shapes import bucket
from llamarl.engines.stop_text import TextStops


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
    prefill_into: Callable[[Any, list[int], list[tuple[int, ...]]], torch.Tensor] | None = None
    """``(state, slots, contexts)`` -> next-token logits ``[n, vocab]``: a packed prefill that writes
    straight into a decoder's state (llamarl/engines/packed_prefill.py), used for decoders that
    declare ``prefills_into_state``; None (or another decoder): ``prefill``, then ``load_prefill``."""
    text_stops: TextStops | None = None
    """The call's stop strings, searched at each look (module docstring); None: ids only."""


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


class Scheduler:
    """One ``decode`` call's slots, books and requests (module docstring)."""

    def __init__(self, decoder: Decoder, host: LoopHost, reqs: list[Request], *, contexts: list[tuple[int, ...]],
                 limits: list[int], sampling: SamplingParams, uniforms: torch.Tensor | None,
                 device: torch.device) -> None:
        self.decoder, self.host, self.reqs, self.contexts, self.limits = decoder, host, reqs, contexts, limits
        self.sampling, self.device = sampling, device
        n = len(reqs)
        capacity = min(n, host.max_num_seqs or n)
        self.state: SlotState = decoder.reserve(
            capacity=capacity, positions=max(len(c) + lim for c, lim in zip(contexts, limits)))
        self.books = _Books(num_requests=n, limits=limits, slots=self.state.capacity, device=device)
        if uniforms is not None:  # the trash row and a column past every limit: padding slots' draws
            uniforms = torch.nn.functional.pad(uniforms, (0, self.books.ids.shape[1] - uniforms.shape[1], 0, 1))
        self.uniforms = uniforms
        self.stop_ids = torch.tensor(host.stop_ids, dtype=torch.long, device=device)
        self.carries = [host.keep_carried and decoder.keeps_caches
                        and limit < sampling.max_new_tokens - len(r.completion_ids) for limit, r in zip(limits, reqs)]
        # Host view: the request in each slot. Only the first max_num_seqs slots take requests; the
        # state's rounding up to a bucket leaves the others empty.
        self.slot_of: list[int | None] = [None] * capacity
        self.slot_ids = torch.arange(self.state.capacity, device=device)
        self.pending = list(range(n))
        # A decoder that samples inside its step (static_decode.py, static_sampling.py) keeps per-slot
        # records, drained into the books at each look; the slots' liveness is its records' own.
        self.in_step = getattr(decoder, "samples_in_step", False)
        if self.in_step:
            self.state.records.begin(host.stop_ids)
            self.books.alive = self.state.records.alive
        self.key = decoder.sampling_key(sampling) if self.in_step else None
        self.steps_per_look = host.eos_check_every if decoder.bucketed else 1
        """Steps between two looks: every step for a decoder whose rows must be exactly the live
        ones (or whose host reads are free)."""
        self.span: dict[str, int] = {}
        """The step's ``span`` keyword until the next look, for a decoder with ``attention_span``."""
        stops = host.text_stops
        # Per request: its turn's carried-in sampled ids (the look-back's worth), new tokens searched.
        self.heads = [list(r.completion_ids[turn_start(r):])[-stops.back:] if stops else [] for r in reqs]
        self.checked = [0] * n
        self.stop_texts: list[str | None] = [None] * n
        """Per request, the stop string that ended it (None: none did)."""

    # -- the loop's two moves --------------------------------------------------------------------

    def look(self) -> int:
        """The host's look: bring the books up to date, retire finished rows, admit pending ones,
        compact; choose the attention's span until the next look. Returns the rows the next steps
        run (0: nothing left)."""
        decoder = self.decoder
        while True:
            if self.in_step:
                self._drain()
            if self.host.text_stops is not None:
                self._cut_at_stops()
            self._retire()
            free = [slot for slot, i in enumerate(self.slot_of) if i is None]
            if not decoder.admits_mid_decode and len(free) < len(self.slot_of):
                break  # the next batch when this one is done
            if not self.pending or not free:
                break
            taken = min(len(free), len(self.pending))
            self._admit(free[:taken], self.pending[:taken])
            del self.pending[:taken]
        live = [slot for slot, i in enumerate(self.slot_of) if i is not None]
        if not live:
            return 0
        if not decoder.bucketed:
            rows = len(live)
        else:
            rows = bucket(live[-1] + 1)
            if not self.pending and bucket(len(live)) < rows:
                self._compact(live, drop=False)
                rows = bucket(len(live))
        spans = getattr(decoder, "attention_span", None)
        if spans is not None:  # the live KV until the next look (static_shapes.span_rung), not the width
            self.span = {"span": spans(self.state, rows, steps=self.steps_per_look)}
        return rows

    def step(self, rows: int) -> None:
        """One step of the first ``rows`` slots: the decoder's, and the draw and the books (in the
        decoder's own step when it samples there: one replay, no eager op)."""
        if self.in_step:
            self.decoder.step(self.state, rows, sampling=self.key, **self.span)
        else:
            self._record(self.slot_ids[:rows], self.decoder.step(self.state, rows, **self.span),
                         self.books.alive[:rows])

    def results(self) -> tuple[list[list[int]], list[list[float]], list[bool], list[str | None]]:
        """Per request its new token ids, log-probs, whether a stop id or string ended it, and the
        stop string that did: one host transfer for the whole batch, then plain slicing."""
        books, n = self.books, len(self.reqs)
        ids_rows, lps_rows, counts = books.ids[:n].tolist(), books.lps[:n].tolist(), books.num_new[:n].tolist()
        return ([row[:c] for row, c in zip(ids_rows, counts)], [row[:c] for row, c in zip(lps_rows, counts)],
                books.stopped[:n].tolist(), list(self.stop_texts))

    # -- what a look and a step do -----------------------------------------------------------------

    def _record(self, slots: torch.Tensor, logits: torch.Tensor, live: torch.Tensor) -> None:
        """Sample every slot of ``slots`` from its ``logits``; book the tokens of the ``live`` ones."""
        books, state = self.books, self.state
        request = books.slot_request[slots]
        column = books.num_new[request]
        tokens, lps = self.host.sample(logits, sampling=self.sampling,
                                       uniforms=None if self.uniforms is None else self.uniforms[request, column])
        if self.in_step:  # the step's own books, eagerly (a look's ops)
            state.records.book(slots, tokens, lps, None, fed=state.tokens, positions=state.positions)
            return
        target = torch.where(live, request, books.trash)
        books.ids[target, column] = tokens
        books.lps[target, column] = lps
        # Live slots hold distinct requests; the others all write the trash row, whose count nothing
        # reads: a plain indexed write (an accumulating one may check its indices on the host).
        books.num_new[target] = books.num_new[target] + live.long()
        hit = (tokens.unsqueeze(1) == self.stop_ids).any(dim=1) & live  # torch.isin syncs for long id lists
        books.stopped[target] = hit
        still = live & ~hit & (books.num_new[request] < books.limit[request])
        books.alive[slots] = still
        state.tokens[slots] = torch.where(still, tokens, state.tokens[slots])
        state.positions[slots] += still.long()

    def _admit(self, slots: list[int], indices: list[int]) -> None:
        """Put requests ``indices`` into the free ``slots``: a carried sample with a kept cache from
        it (its last token fed at the next step), the others prefilled and their first token drawn."""
        decoder, host, books, state, contexts, device = (self.decoder, self.host, self.books, self.state,
                                                         self.contexts, self.device)
        entries = {}
        for i in indices:
            entry = host.kept.pop(self.reqs[i].sample_id, None) if decoder.keeps_caches else None
            entries[i] = entry if entry is not None and entry[0] == contexts[i] else None  # else dropped
        # Fresh rows take the first slots, kept ones the next (a state that appends rows loads in order).
        indices = [i for i in indices if entries[i] is None] + [i for i in indices if entries[i] is not None]
        kept, fresh = [], []
        for slot, i in zip(slots, indices):
            (kept if entries[i] is not None else fresh).append((slot, i, entries[i]))
            self.slot_of[slot] = i
        # Every admitted slot feeds its last context token at its position next: for a kept row,
        # the token its cache lacks; for a fresh one (its first token drawn below), what its
        # prefill cached there, rewritten alike if it ends at once and is stepped before the next look.
        where = torch.tensor(slots, dtype=torch.long, device=device)
        books.slot_request[where] = torch.tensor(indices, dtype=torch.long, device=device)
        state.tokens[where] = torch.tensor([contexts[i][-1] for i in indices], dtype=torch.long, device=device)
        state.positions[where] = torch.tensor([len(contexts[i]) - 1 for i in indices], device=device)
        if self.in_step:
            state.records.admit(where, bases=[len(contexts[i]) - 1 for i in indices],
                                limits=[self.limits[i] for i in indices],
                                uniforms=None if self.uniforms is None else self.uniforms[books.slot_request[where]])
        if fresh:
            targets, fresh_contexts = [slot for slot, _, _ in fresh], [contexts[i] for _, i, _ in fresh]
            if host.prefill_into is not None and getattr(decoder, "prefills_into_state", False):
                logits = host.prefill_into(state, targets, fresh_contexts)  # packed, into the slots
            else:
                logits, cache, mask = host.prefill(fresh_contexts)
                state.load_prefill(targets, cache=cache, mask=mask, lengths=[len(c) for c in fresh_contexts])
            self._record(torch.tensor(targets, dtype=torch.long, device=device), logits,
                         torch.ones(len(fresh), dtype=torch.bool, device=device))
        if kept:
            host.on_kept_rows(len(kept))
            for slot, i, entry in kept:  # kept caches of different lengths: one row at a time
                state.load([slot], keys=[k.unsqueeze(0) for k in entry[1]], values=[v.unsqueeze(0) for v in entry[2]],
                           lengths=[len(contexts[i]) - 1], left_padded=False)
            books.alive[torch.tensor([slot for slot, _, _ in kept], dtype=torch.long, device=device)] = True

    def _drain(self) -> None:
        """Gather the step's per-slot records into the books (a look's few ops, any number of steps
        since the last); grow the top-p candidates if a row stalled on them (static_sampling.py)."""
        books, state = self.books, self.state
        records, request = state.records, books.slot_request
        columns = (records.base.unsqueeze(1) + torch.arange(books.ids.shape[1], device=self.device)).clamp_(
            max=records.ids.shape[1] - 1)
        books.ids[request] = records.ids.gather(1, columns)
        books.lps[request] = records.lps.gather(1, columns)
        books.num_new[request] = records.counts(state.positions)
        books.stopped[request] = records.stopped
        if self.key[3] and bool(records.overflow.any()):
            self.decoder.grow_candidates(self.key)
            self.key = self.decoder.sampling_key(self.sampling)
            records.overflow.zero_()

    def _cut_at_stops(self) -> None:
        """Search the turns of the rows with new tokens for a stop string (module docstring); cut
        each one found exactly (its count: the kept tokens), mark it stopped and not alive, so the
        retirement that follows frees its slot. Host reads: the counts, then those rows' tokens."""
        books, stops = self.books, self.host.text_stops
        occupied = [(slot, i) for slot, i in enumerate(self.slot_of) if i is not None]
        if not occupied:
            return
        counts = books.num_new.tolist()
        due = [(slot, i) for slot, i in occupied if counts[i] > self.checked[i] and self.stop_texts[i] is None]
        if not due:
            return
        # Only the columns a search decodes: the unchecked tokens and the look-back before them.
        start = min(max(0, self.checked[i] - stops.back) for _, i in due)
        width = max(counts[i] for _, i in due)
        rows = books.ids[torch.tensor([i for _, i in due], dtype=torch.long, device=self.device),
                         start:width].tolist()
        hits: list[tuple[int, int, int]] = []  # (slot, request, new tokens kept)
        for (slot, i), row in zip(due, rows):
            head = self.heads[i] if start == 0 else []  # the turn's carried-in part, when in reach
            offset = len(head) - start  # a turn index minus a new token's index
            found = stops.search(head + row[: counts[i] - start], checked=len(head) + self.checked[i] - start)
            self.checked[i] = counts[i]
            if found is not None:
                self.stop_texts[i] = found[1]
                hits.append((slot, i, max(0, found[0] - offset)))
        if hits:
            slots, requests, kept = (torch.tensor(v, dtype=torch.long, device=self.device) for v in zip(*hits))
            books.num_new[requests] = kept
            books.stopped[requests] = True
            books.alive[slots] = False  # the records' own liveness for a decoder that samples in its step

    def _retire(self) -> None:
        """The finished slots leave (a row ended by its budget keeps its cache when it carries);
        a decoder whose rows are exactly the live ones compacts them to the front."""
        books, slot_of, contexts = self.books, self.slot_of, self.contexts
        alive = books.alive.tolist()
        finished = [slot for slot, i in enumerate(slot_of) if i is not None and not alive[slot]]
        if not finished:
            return
        counts, stopped = books.num_new.tolist(), books.stopped.tolist()
        for slot in finished:
            i = slot_of[slot]
            slot_of[slot] = None
            if self.carries[i] and not stopped[i]:  # ended by its budget: carried
                # Its cache holds all but its last sampled token (fed on resume).
                length = len(contexts[i]) + counts[i] - 1
                keys, values = self.state.row_cache(slot, length)
                new = tuple(books.ids[i, : counts[i]].tolist())
                self.host.kept[self.reqs[i].sample_id] = (contexts[i] + new, keys, values)
        books.slot_request[torch.tensor(finished, dtype=torch.long, device=self.device)] = books.trash
        if not self.decoder.bucketed:  # its rows are exactly the live ones, from slot 0
            self._compact([slot for slot, i in enumerate(slot_of) if i is not None], drop=True)

    def _compact(self, live: list[int], *, drop: bool) -> None:
        """Bring the ``live`` slots (ascending) into slots ``0 .. len(live) - 1``, their books with
        them. ``drop`` (a decoder whose rows are exactly the live ones, in order): every live slot
        moves to its rank, and the state lets the other rows go even where nothing moves. Otherwise
        (a bucketed state) only the live slots past ``len(live)`` move, into the free slots before
        it: a finer bucket ladder compacts more often, and a move copies a row's live columns."""
        books, slot_of, device = self.books, self.slot_of, self.device
        if drop:
            sources, targets = live, list(range(len(live)))
        else:
            sources = [s for s in live if s >= len(live)]
            targets = sorted(set(range(len(live))) - set(live))
        if sources != targets or drop:
            self.state.move(sources, targets, num_columns=self.state.width)
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
