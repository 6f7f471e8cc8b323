"""Sampling and bookkeeping inside the static decode step's CUDA graph (issue 45 item 4): a step of
the static loop is one graph replay, with no eager op outside it between two looks of the decode
loop (llamarl/engines/decode_loop.py), where the host drains what the graph recorded.

Why: outside the graph the sampler and the loop's books ran ~44 eager ops a step (one launch
each, and a full-vocabulary sort under top-p on an accelerator), as many launches as a layer's
kernels several times over.

Per-slot records for the engine's life (``SlotRecords``, in the state next to the KV cache; their
addresses are what the graphs read), indexed by **position**, so the graph needs no per-request
index or counter: stepping slot s at position p draws with ``uniforms[s, p]`` (the request's
uniforms copied into the slot's row once, at admission: ``admit``) and records its token and
log-prob at ``ids[s, p]`` / ``lps[s, p]``; ``end[s]`` is the position at which the row's budget
ends it, ``is_stop`` marks the call's stop ids over the vocabulary (any number of them, one
gather a step). A row's ``k``-th new token is then at column ``base + k`` (``base`` its context
length - 1); the loop's drain (``drain``) gathers every slot's columns into its request's books
at each look: a few ops whatever the number of steps since the last.

The draws are those of llamarl/engines/sampling.py (``sample_tokens``) for the same uniforms:
greedy, temperature, top-k then top-p, the same inverse-CDF draw (``draw``: its two levels
without padding the vocabulary, so any vocabulary size runs without a per-step copy). Top-p
without a full-vocabulary sort: the nucleus is searched in the top ``candidates`` probabilities
(256 at first); a row whose candidates hold less than ``top_p`` of the mass **stalls** (it
records nothing, keeps its token and position, stays alive: its next step recomputes the same
logits) and raises ``overflow``, which the drain reads; the decoder then samples with 8x the
candidates (another graph) and the stalled row draws from the exact nucleus, with the same
uniform. The set equals ``sampling._nucleus``'s, up to the order of tied probabilities.
"""

from __future__ import annotations

import torch

from llamarl.engines.base import SamplingParams
from llamarl.engines.sampling import _DRAW_BLOCK, _greedy, pick_block, pick_in_block, unfiltered

FIRST_CANDIDATES = 256
"""Top-p candidates a sampling setting starts with (``SamplingKey``); x8 at each overflow."""


def sampling_key(sampling: SamplingParams, *, vocab: int, candidates: int) -> tuple:
    """What a captured graph's sampler depends on: ``(temperature, top_p, top_k, candidates)``
    (python numbers baked into the graph; ``candidates`` only under top-p, else 0)."""
    top_p = float(sampling.top_p) if sampling.temperature > 0 else 1.0
    top_k = int(sampling.top_k) if sampling.temperature > 0 and 0 < sampling.top_k < vocab else 0
    return (float(sampling.temperature), top_p, top_k, min(candidates, vocab) if top_p < 1.0 else 0)


def draw(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """``sampling._draw`` (the same blocks of 256, the same fp64 sums and searches) without padding
    ``probs`` ``(rows, vocab)`` to a multiple of the block: the last, partial block is summed on
    its own and its missing entries read as zeros in the inner search. Equal to ``_draw`` up to the
    rounding of that block's sum (a draw at an interval's edge)."""
    rows, vocab = probs.shape
    full = vocab // _DRAW_BLOCK * _DRAW_BLOCK
    sums = probs[:, :full].view(rows, -1, _DRAW_BLOCK).sum(dim=-1)
    if full < vocab:
        sums = torch.cat((sums, probs[:, full:].sum(dim=-1, keepdim=True)), dim=1)
    block, target, before = pick_block(sums.double().cumsum(dim=-1), uniforms)
    index = block * _DRAW_BLOCK + torch.arange(_DRAW_BLOCK, device=probs.device)
    inner = probs.gather(1, index.clamp(max=vocab - 1)).masked_fill_(index >= vocab, 0.0)
    return pick_in_block(inner.cumsum(dim=-1, dtype=torch.float64), block, target=target, before=before, vocab=vocab)


def sample(logits: torch.Tensor, uniforms: torch.Tensor | None, key: tuple):
    """``(tokens, log-probs, ok)`` of ``logits`` ``[rows, vocab]`` under ``key`` (``sampling_key``),
    row r drawn with ``uniforms[r]``: ``sampling.sample_tokens``'s numbers, in ops of static shape
    with no host read. ``ok`` (None unless top-p searches fewer candidates than the vocabulary):
    False for a row whose candidates hold less than ``top_p``; its token is not to be used."""
    temperature, top_p, top_k, candidates = key
    if temperature == 0:
        return (*_greedy(logits), None)
    if unfiltered(SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k), vocab=logits.shape[-1]):
        x = logits if temperature == 1.0 else logits.float() / temperature
        probs = torch.softmax(x, dim=-1, dtype=torch.float32)
        tokens = draw(probs, uniforms)
        return tokens, probs.gather(-1, tokens.unsqueeze(-1)).squeeze(-1).log(), None
    x = logits.float() / temperature if temperature != 1.0 else logits.float()  # sampling.filtered_logprobs
    if top_k:
        kth = torch.topk(x, top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    ok = None
    if top_p < 1.0:
        probs = x.softmax(dim=-1)
        vals, order = torch.topk(probs, candidates, dim=-1, sorted=True)
        cum = vals.cumsum(dim=-1)
        keep = torch.zeros_like(probs, dtype=torch.bool).scatter_(-1, order, (cum - vals) < top_p)
        x = x.masked_fill(~keep, float("-inf"))
        if candidates < probs.shape[-1]:
            ok = cum[:, -1] >= top_p
    logp = torch.log_softmax(x, dim=-1)
    tokens = draw(logp.exp(), uniforms)
    return tokens, logp.gather(-1, tokens.unsqueeze(-1)).squeeze(-1), ok


class SlotRecords:
    """The per-slot records of a static state (module docstring), for the engine's life:
    ``uniforms`` fp64 / ``ids`` int64 / ``lps`` fp32 ``[slots, width]`` by position, ``alive`` /
    ``stopped`` / ``overflow`` bool and ``base`` / ``end`` int64 ``[slots]``, ``is_stop`` bool
    ``[vocab]``. Column ``width - 1`` is the trash column: no row steps there (a row of the state
    ends by ``width - 2``), so the writes of rows that take no token go there unconditionally."""

    def __init__(self, *, slots: int, width: int, vocab: int, device: torch.device) -> None:
        self.uniforms = torch.zeros((slots, width), dtype=torch.float64, device=device)
        self.ids = torch.zeros((slots, width), dtype=torch.long, device=device)
        self.lps = torch.zeros((slots, width), dtype=torch.float32, device=device)
        self.alive = torch.zeros(slots, dtype=torch.bool, device=device)
        self.stopped = torch.zeros(slots, dtype=torch.bool, device=device)
        self.overflow = torch.zeros(slots, dtype=torch.bool, device=device)
        self.base = torch.zeros(slots, dtype=torch.long, device=device)
        self.end = torch.zeros(slots, dtype=torch.long, device=device)
        self.is_stop = torch.zeros(vocab, dtype=torch.bool, device=device)

    def begin(self, stop_ids: list[int]) -> None:
        """A call starts: no slot alive, its stop ids marked (ids past the vocabulary never drawn)."""
        for flags in (self.alive, self.stopped, self.overflow, self.is_stop):
            flags.zero_()
        ids = [i for i in stop_ids if 0 <= i < self.is_stop.shape[0]]
        if ids:
            self.is_stop[torch.tensor(ids, dtype=torch.long, device=self.is_stop.device)] = True

    def admit(self, where: torch.Tensor, *, bases: list[int], limits: list[int], uniforms: torch.Tensor | None) -> None:
        """Rows enter slots ``where``: row j's context is ``bases[j] + 1`` tokens, its budget
        ``limits[j]`` new ones, its k-th draw ``uniforms[j, k]`` (None: greedy). They are alive."""
        device = where.device
        base = torch.tensor(bases, dtype=torch.long, device=device)
        self.base[where] = base
        self.end[where] = base + torch.tensor(limits, dtype=torch.long, device=device)
        self.alive[where] = True
        self.stopped[where] = False
        self.overflow[where] = False
        if uniforms is not None:
            width = self.uniforms.shape[1]
            columns = (base.unsqueeze(1) + torch.arange(uniforms.shape[1], device=device)).clamp_(max=width - 1)
            rows = torch.zeros((len(bases), width), dtype=torch.float64, device=device)
            self.uniforms[where] = rows.scatter_(1, columns, uniforms.to(torch.float64))

    def book(self, index, tokens: torch.Tensor, lps: torch.Tensor, ok: torch.Tensor | None, *,
             fed: torch.Tensor, positions: torch.Tensor) -> None:
        """Record the draws of slots ``index`` (a slice of the first rows in the graph, a tensor of
        slots at admission): what ``decode_loop.record`` did per request, per slot. A live row
        (and ``ok``) records its token at its position; a stop id or its budget ends it (its
        position and fed token stay: its later steps rewrite what it wrote); else it feeds the
        token at the next position. A row not ``ok`` stalls (module docstring)."""
        if isinstance(index, slice):  # the first rows, in the captured step: their views, written in place
            if index.start not in (0, None) or index.step not in (1, None):
                raise ValueError(f"book takes the first rows as a slice (0, rows), got {index}")
            rows = index.stop
            book_first_rows(tokens, lps, ok, ids=self.ids[:rows], rec_lps=self.lps[:rows], alive=self.alive[:rows],
                            stopped=self.stopped[:rows], overflow=self.overflow[:rows], end=self.end[:rows],
                            is_stop=self.is_stop, fed=fed[:rows], positions=positions[:rows])
            return
        # A tensor of slots (admission, eager): their rows gathered, booked as first rows, written back.
        buffers = [self.ids, self.lps, self.alive, self.stopped, self.overflow, fed, positions]
        rows = [buffer[index] for buffer in buffers]
        ids, rec_lps, alive, stopped, overflow, fed_rows, position_rows = rows
        book_first_rows(tokens, lps, ok, ids=ids, rec_lps=rec_lps, alive=alive, stopped=stopped, overflow=overflow,
                        end=self.end[index], is_stop=self.is_stop, fed=fed_rows, positions=position_rows)
        for buffer, row in zip(buffers, rows):
            buffer[index] = row

    def move(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy slots ``src`` to ``dst`` (the loop's compaction)."""
        for buffer in (self.uniforms, self.ids, self.lps, self.alive, self.stopped, self.overflow, self.base,
                       self.end):
            buffer[dst] = buffer[src]

    def snapshot(self, fed: torch.Tensor, positions: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """What a step changes but its columns: restored after a capture's warm-up runs."""
        return [(t, t.clone()) for t in (fed, positions, self.alive, self.stopped, self.overflow)]

    def counts(self, positions: torch.Tensor) -> torch.Tensor:
        """New tokens recorded per slot: up to its position, its own when it ended there."""
        return positions - self.base + (~self.alive).long()


def book_first_rows(tokens: torch.Tensor, lps: torch.Tensor, ok: torch.Tensor | None, *, ids: torch.Tensor,
                    rec_lps: torch.Tensor, alive: torch.Tensor, stopped: torch.Tensor, overflow: torch.Tensor,
                    end: torch.Tensor, is_stop: torch.Tensor, fed: torch.Tensor, positions: torch.Tensor) -> None:
    """``SlotRecords.book`` for the first ``len(tokens)`` slots, every argument but ``is_stop``
    those slots' views: the ops the captured step runs (the fused kernel set's ``llamarl::book``
    is this in one kernel: llamarl/engines/step_kernels.py)."""
    # Views: ``live`` reads the updated ``alive`` in the overflow line, the same value there (a row
    # not ``ok`` takes nothing, so its liveness is unchanged).
    position, live = positions, alive
    take = live if ok is None else live & ok
    column = torch.where(take, position, ids.shape[1] - 1)
    ids.scatter_(1, column.unsqueeze(1), tokens.unsqueeze(1))
    rec_lps.scatter_(1, column.unsqueeze(1), lps.unsqueeze(1))
    hit = is_stop[tokens] & take
    still = take & ~hit & (position + 1 < end)
    stopped.copy_(stopped | hit)
    alive.copy_(live & (still | ~take))
    fed.copy_(torch.where(still, tokens, fed))
    positions.copy_(position + still.long())
    if ok is not None:
        overflow.copy_(overflow | (live & ~ok))


def restore(snapshot: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    for tensor, saved in snapshot:
        tensor.copy_(saved)
