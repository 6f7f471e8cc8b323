"""The static decode path's shapes (llamarl/engines/static_decode.py): the batch buckets a step
runs (``bucket``, ``ladder``), the columns of a state (``state_width``) and the attention spans a
step reads (``span_rung``). Plain integer functions: the decode loop (decode_loop.py) picks its
buckets with them without importing the CUDA decoder's module.
"""

from __future__ import annotations

STATIC_DECODE_MODES = ("auto", "compiled", "eager", "off")
"""``--generator.torch.static-decode``'s values (llamarl/engines/engine_configs.py), which the native
engine checks too: here, where both read them without importing each other."""


def bucket(rows: int) -> int:
    """The batch bucket that runs ``rows`` live rows: the smallest rung >= ``rows`` of the ladder
    1, 2, 4, 8, 16, then multiples of 16, with multiples of 8 between 64 and 128 (72, 80, ... 128).

    Why: a step's cost grows with its bucket, and the padded rows are waste. Powers of two pad up
    to ~50 % (257 rows run as 512); steps of 16 (nano-vllm's ladder) pad at most 15 rows, at most
    12.5 % of the live rows from 121 rows up, but 15 of 65 rows (23 %) below that, hence steps of 8
    there: from 65 rows up the padding is at most 11.6 % of the live rows (129 rows in 144)."""
    if rows < 1:
        raise ValueError(f"a bucket needs at least one row, got {rows}")
    if rows <= 16:
        return 1 << (rows - 1).bit_length()
    step = 8 if 64 < rows <= 128 else 16
    return -(-rows // step) * step


def ladder(capacity: int) -> list[int]:
    """Every bucket up to ``bucket(capacity)``, ascending: the buckets a state of that many slots may step."""
    top, rungs, rows = bucket(capacity), [], 1
    while rows <= top:
        rungs.append(rows)
        rows = bucket(rows + 1)
    return rungs


def span_rung(columns: int, width: int) -> int:
    """The attention span of a step whose rows attend at most ``columns`` columns (their longest
    live KV, each row ``0 .. position``) in a state ``width`` columns wide: ``columns`` rounded up
    to a multiple of 64 up to 1024, then of a sixteenth of the next power of two (eight rungs an
    octave: < 12.5 % over the live columns past 512), at most ``width``. It depends on the live
    columns only: doubling the state's width at the same live lengths changes no span."""
    if columns < 1:
        raise ValueError(f"a span covers at least one column, got {columns}")
    block = max(64, (1 << (columns - 1).bit_length()) // 16)
    return min(width, -(-columns // block) * block)


def state_width(positions: int) -> int:
    """Cache columns for ``positions`` positions: a power of two, at least 64."""
    return max(64, 1 << (positions - 1).bit_length())
