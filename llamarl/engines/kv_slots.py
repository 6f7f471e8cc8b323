"""The native engine's one KV state (issue 45 item 1): the slots every decoder of the one decode
loop (llamarl/engines/decode_loop.py) steps over, the CUDA-graph step (static_decode.py) and the
fused CPU step (cpu/fused_decode.py) alike.

Layout: per layer one cache ``caches[l]`` ``[2, slots, kv_heads, width, head_dim]`` (keys, then
values: a step writes a token's keys and values in one indexed write; ``keys[l]`` / ``values[l]``
are its two halves, each a contiguous ``[slots, kv_heads, width, head_dim]``, which is what the C
kernels take). Each slot's positions are left-aligned (position = column), so rows of any lengths,
admitted at any step, share one batch. ``tokens`` / ``positions`` ``[slots]`` (int64, on the
cache's device) are what each slot feeds at the next step and where: ``positions[s]`` is also how
many positions slot s has cached, and what a row sees is computed from it (``column <=
position``), so the state holds no mask.

Who moves what: the decode loop writes ``tokens`` / ``positions`` (admission, sampling) and calls
``load`` (prefill and kept caches), ``move`` (compaction) and ``row_cache`` (a carried row's
cache); a decoder's step writes its tokens' keys and values at their positions. A **growable**
state (the CPU step's: a step's cost there does not depend on the width, and rows that stop early
never need the longest row's columns) widens when a load or a step needs more columns (``grow``: a
new allocation, copied); a fixed one (the CUDA graphs read its addresses) refuses a row that does
not fit.
"""

from __future__ import annotations

import torch


class KVSlots:
    """One decode state (module docstring)."""

    def __init__(self, *, caches: list[torch.Tensor], growable: bool = False) -> None:
        if not caches or any(c.dim() != 5 or c.shape[0] != 2 or c.shape != caches[0].shape for c in caches):
            raise ValueError("KVSlots takes one [2, slots, kv_heads, width, head_dim] cache per layer, all alike")
        self.growable = growable
        self._set_caches(caches)
        slots, device = caches[0].shape[1], caches[0].device
        self.tokens = torch.zeros(slots, dtype=torch.long, device=device)
        self.positions = torch.zeros(slots, dtype=torch.long, device=device)
        self.native_tables: tuple | None = None
        """The C step's address table of these caches (cpu/fused_decode.py ``_layer_tables``):
        rebuilt when the caches are other tensors (``grow``)."""

    @classmethod
    def zeros(cls, *, layers: int, slots: int, kv_heads: int, width: int, head_dim: int, like: torch.Tensor,
              growable: bool = False) -> KVSlots:
        """A zeroed state in ``like``'s dtype and on its device."""
        return cls(caches=[like.new_zeros((2, slots, kv_heads, width, head_dim)) for _ in range(layers)],
                   growable=growable)

    def _set_caches(self, caches: list[torch.Tensor]) -> None:
        self.caches = caches
        self.keys, self.values = [c[0] for c in caches], [c[1] for c in caches]

    @property
    def capacity(self) -> int:
        return self.caches[0].shape[1] if self.caches else 0

    @property
    def width(self) -> int:
        return self.caches[0].shape[3] if self.caches else 0

    def grow(self, width: int) -> None:
        """Make room for ``width`` positions per slot (a growable state): the caches grow by at
        least a quarter, rounded up to 64 columns, so a long decode reallocates a few times, not
        every step. New columns are zeros (a masked column's value meets a zero weight, and 0 * NaN
        would not be 0)."""
        if width <= self.width:
            return
        if not self.growable:
            raise ValueError(f"a row of {width} positions does not fit the state's {self.width} columns")
        grown = -(-max(width, self.width + self.width // 4) // 64) * 64
        wider = []
        for cache in self.caches:
            new = cache.new_zeros((*cache.shape[:3], grown, cache.shape[4]))
            new[:, :, :, : cache.shape[3]] = cache
            wider.append(new)
        self._set_caches(wider)

    def load(self, slots: list[int], *, keys: list[torch.Tensor], values: list[torch.Tensor],
             lengths: list[int], left_padded: bool) -> None:
        """Write rows into ``slots``: per layer ``keys[l]`` / ``values[l]`` ``[n, kv, T, d]`` hold row
        j's ``lengths[j]`` cached positions, right-aligned in ``T`` (a left-padded prefill) when
        ``left_padded``, else from column 0; they go to columns ``0 .. lengths[j] - 1``. Two ops
        per layer and tensor whatever ``n`` (a gather of each row's columns, one indexed write):
        the columns past a row's length get copies of its last one, which its position masks
        until its own tokens overwrite them. Sets nothing else (the loop sets the slots' tokens
        and positions)."""
        longest = max(lengths)
        if self.growable:
            self.grow(longest + 1)
        if longest > self.width - 1:
            raise ValueError(f"a row of {longest} cached positions does not fit the state's {self.width} columns")
        source_width = keys[0].shape[2]
        if longest > source_width:
            raise ValueError(f"a row of {longest} cached positions was given {source_width} columns")
        device = self.tokens.device
        where = torch.tensor(slots, dtype=torch.long, device=device)
        if left_padded:  # row j's column c is the source's column T - lengths[j] + c (clamped past its end)
            start = torch.tensor([source_width - n for n in lengths], dtype=torch.long, device=device)
            columns = (start.unsqueeze(1) + torch.arange(longest, device=device)).clamp_(max=source_width - 1)
        for mine, theirs in ((self.keys, keys), (self.values, values)):
            for layer_cache, source in zip(mine, theirs):
                if left_padded:
                    n, kv, _, d = source.shape
                    rows = source.gather(2, columns.view(n, 1, longest, 1).expand(n, kv, longest, d))
                else:
                    rows = source[:, :, :longest]
                layer_cache[where, :, :longest] = rows.to(layer_cache.dtype)

    def load_prefill(self, slots: list[int], *, cache, mask: torch.Tensor, lengths: list[int]) -> None:
        """``load`` a left-padded prefill's HF cache (``cache.layers[l].keys`` / ``.values``)."""
        self.load(slots, keys=[layer.keys for layer in cache.layers], values=[layer.values for layer in cache.layers],
                  lengths=lengths, left_padded=True)

    def move(self, sources: list[int], targets: list[int], *, num_columns: int) -> None:
        """Copy slots ``sources`` to ``targets`` (the decode loop's compaction): their cached columns
        (at most ``num_columns``: the sources' largest position and the one it feeds next; one host
        read of the positions, at the loop's look), fed token and position."""
        if not sources:
            return
        device = self.tokens.device
        src = torch.tensor(sources, dtype=torch.long, device=device)
        dst = torch.tensor(targets, dtype=torch.long, device=device)
        columns = min(num_columns, int(self.positions[src].max()) + 1)
        for cache in self.caches:  # one indexed copy per layer: keys and values together
            cache[:, dst, :, :columns] = cache[:, src, :, :columns]
        self.tokens[dst] = self.tokens[src]
        self.positions[dst] = self.positions[src]

    def row_cache(self, slot: int, length: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Copies of slot ``slot``'s first ``length`` cached positions per layer, ``[kv, length, d]``."""
        return ([k[slot, :, :length].clone() for k in self.keys], [v[slot, :, :length].clone() for v in self.values])

    def release(self) -> None:
        """Drop the caches (their memory goes back to the allocator); the state is unusable afterwards."""
        self._set_caches([])
        self.native_tables = None
