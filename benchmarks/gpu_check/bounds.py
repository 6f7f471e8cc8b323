"""Pure arithmetic of the check (no torch; unit-tested on CPU, tests/test_gpu_check.py): the bytes a
decode step must read (weights plus the live KV cache), the bound in ms at a measured bandwidth,
the 256 x 256 tick's bound, and the kernel-time histogram of one profiled step.

A decode step must read every weight it multiplies by once (the input embedding only where it is
tied to the LM head: an untied one is gathered, a row per token) and, for attention, the keys and
values of every live position of every row: ``live x layers x kv_heads x head_dim x 2 (K and V) x
dtype bytes`` per row. The bound counts no activation, no logits and no KV write (rows x one
position: below 1 % at every shape checked), so a step cannot beat it; it is the roofline of a
step bound by memory, the regime of decode at these row counts."""

from __future__ import annotations

from collections.abc import Sequence

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
HISTOGRAM_EDGES_US = (2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 1024.0)
"""Upper edges of the kernel-duration bins (µs); a last bin holds the longer kernels."""


def kv_bytes_per_token(*, layers: int, kv_heads: int, head_dim: int, dtype_bytes: int) -> int:
    """Bytes of the keys and values one cached position holds over all layers."""
    return 2 * layers * kv_heads * head_dim * dtype_bytes


def live_kv_bytes(live: int | Sequence[int], *, rows: int, layers: int, kv_heads: int, head_dim: int,
                  dtype_bytes: int) -> float:
    """Bytes of the live KV cache a step reads: ``live`` positions per row (one number for every
    row, or one per row: then ``rows`` must be its length; a mean may be fractional)."""
    if isinstance(live, (int, float)):
        total = live * rows
    else:
        if len(live) != rows:
            raise ValueError(f"{len(live)} live lengths for {rows} rows")
        total = sum(live)
    return total * kv_bytes_per_token(layers=layers, kv_heads=kv_heads, head_dim=head_dim, dtype_bytes=dtype_bytes)


def step_bytes(*, weight_bytes: int, live: int | Sequence[int], rows: int, layers: int, kv_heads: int,
               head_dim: int, dtype_bytes: int) -> float:
    """The bytes one decode step of ``rows`` rows must read: ``weight_bytes`` (``weights_read_bytes``)
    plus the live KV (``live_kv_bytes``)."""
    return weight_bytes + live_kv_bytes(live, rows=rows, layers=layers, kv_heads=kv_heads, head_dim=head_dim,
                                        dtype_bytes=dtype_bytes)


def bound_ms(nbytes: float, gbps: float) -> float:
    """Milliseconds to read ``nbytes`` at ``gbps`` GB/s (1e9 bytes a second)."""
    if gbps <= 0:
        raise ValueError(f"a bandwidth must be > 0 GB/s, got {gbps}")
    return 1000.0 * nbytes / (gbps * 1e9)


def weights_read_bytes(params: Sequence[tuple[str, int, int]], *, tied: bool,
                       input_embedding: str = "model.embed_tokens.weight") -> int:
    """Bytes of the weights a decode step reads, from ``(name, numel, element bytes)`` of every
    unique parameter (a tied tensor listed once): all of them, less the input embedding when it is
    not tied to the LM head (a step gathers one row of it per token)."""
    return sum(numel * size for name, numel, size in params if tied or name != input_embedding)


def model_weights_read_bytes(model) -> int:
    """``weights_read_bytes`` of an HF causal LM (its unique parameters; tied per its config)."""
    seen, params = set(), []
    for name, p in model.named_parameters():
        if id(p) not in seen:
            seen.add(id(p))
            params.append((name, p.numel(), p.element_size()))
    return weights_read_bytes(params, tied=bool(getattr(model.config, "tie_word_embeddings", False)))


def mean_live(prompt_tokens: int, new_tokens: int) -> float:
    """The mean live length of the steps ``(wall(n) - wall(1)) / (n - 1)`` times: the step that
    feeds new token j (j = 1 .. n - 1) attends over ``prompt_tokens + j`` positions."""
    return prompt_tokens + new_tokens / 2


def tick_bound_s(*, weight_bytes: int, rows: int, prompt_tokens: float, new_tokens: int, layers: int,
                 kv_heads: int, head_dim: int, dtype_bytes: int, gbps: float) -> float:
    """Seconds the decode steps of a tick must take at ``gbps``: ``rows`` rows, each with
    ``prompt_tokens`` prompt positions (a mean), decoding ``new_tokens`` tokens (``new_tokens - 1``
    steps after the prefill's token; step j reads ``prompt_tokens + j`` live positions a row)."""
    total = sum(step_bytes(weight_bytes=weight_bytes, live=prompt_tokens + j, rows=rows, layers=layers,
                           kv_heads=kv_heads, head_dim=head_dim, dtype_bytes=dtype_bytes)
                for j in range(1, new_tokens))
    return bound_ms(total, gbps) / 1000.0


def histogram(with_step: Sequence[float], without: Sequence[float], *, steps: int,
              edges: Sequence[float] = HISTOGRAM_EDGES_US) -> list[dict]:
    """Kernels per step by duration: ``with_step`` and ``without`` are the kernel durations (µs) of
    two profiled calls that differ by ``steps`` decode steps (the same prefill and bookkeeping
    otherwise); per bin ``{"upto_us", "kernels", "us"}`` per step (``upto_us`` None: the last,
    open bin). A bin's difference may be slightly negative where durations jitter across an edge."""
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    bins = [{"upto_us": edge, "kernels": 0.0, "us": 0.0} for edge in edges] + [{"upto_us": None, "kernels": 0.0,
                                                                              "us": 0.0}]

    def place(value: float) -> dict:
        return next((b for b in bins[:-1] if value < b["upto_us"]), bins[-1])

    for durations, sign in ((with_step, 1.0), (without, -1.0)):
        for value in durations:
            target = place(value)
            target["kernels"] += sign / steps
            target["us"] += sign * value / steps
    return bins


def ratio(value: float | None, reference: float | None) -> float | None:
    """``value / reference``, None where either is missing or the reference is not > 0."""
    if value is None or reference is None or reference <= 0:
        return None
    return value / reference
