"""The static decode step's fused kernels in Triton (llamarl/engines/step_kernels.py registers them as
the CUDA implementations of its ``llamarl::`` ops): one launch each where the step written in aten
ops needs several.

* ``rope_store``: every head of a ``[rows, heads + 2 kv, d]`` q / k / v row at once: Qwen3's per-head
  RMSNorm (optional), RoPE for queries and keys (HF's ``x cos + rotate_half(x) sin``), queries to a
  new buffer, keys and values straight into the row's slot of the KV cache at its position.
* ``act_mul``: ``act(gate) * up`` over a ``[rows, 2 inter]`` gate / up GEMM output (SiLU, or
  Gemma2's tanh-approximated GELU).
* ``rms_norm``: ``(offset + w) * normalise(x)`` (Gemma2's offset norms; without an offset the step
  uses aten's fused ``rms_norm``).
* ``sandwich``: Gemma2's block end: ``hidden += norm_a(y)``, then the next norm of ``hidden``: the
  post-block norm, the residual add and the next block's input norm in one pass over the row.

Numerics: fp32 inside, each value rounded (``.to(dtype).to(tl.float32)``) to the tensors' dtype where HF's modules round it (the
normalised head before Qwen3's weight, the activation before the product, the block output before
the residual add, the residual itself), so a bf16 step differs from the aten step by at most a
rounding. Rows of any length: a block is the next power of two (masked). The kernels are tested on
the CPU under ``TRITON_INTERPRET=1`` against the aten references (tests/test_triton_kernels.py)
before a GPU sees them. Importing this module needs ``triton``; nothing imports it where no CUDA
device runs the step (step_kernels.py imports it lazily).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rope_store_kernel(qkv, positions, cos, sin, head_weight, q_out, cache,
                       s_qkv_r, s_qkv_h, s_cos, s_w, s_q_r, s_q_h,
                       s_c_kv, s_c_r, s_c_h, s_c_col,
                       half, eps, num_heads: tl.constexpr, num_kv: tl.constexpr,
                       HAS_NORM: tl.constexpr, BLOCK: tl.constexpr):
    row, head = tl.program_id(0), tl.program_id(1)
    offs = tl.arange(0, BLOCK)
    mask = offs < half
    base = qkv + row * s_qkv_r + head * s_qkv_h
    dtype = q_out.dtype.element_ty
    x1 = tl.load(base + offs, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(base + half + offs, mask=mask, other=0.0).to(tl.float32)
    pos = tl.load(positions + row)
    if head < num_heads + num_kv:
        if HAS_NORM:  # Qwen3: normalise, round, times the head's weight, round (HF's order)
            rstd = tl.rsqrt((tl.sum(x1 * x1, axis=0) + tl.sum(x2 * x2, axis=0)) / (2 * half) + eps)
            w1 = tl.load(head_weight + head * s_w + offs, mask=mask, other=0.0).to(tl.float32)
            w2 = tl.load(head_weight + head * s_w + half + offs, mask=mask, other=0.0).to(tl.float32)
            x1 = ((x1 * rstd).to(dtype).to(tl.float32) * w1).to(dtype).to(tl.float32)
            x2 = ((x2 * rstd).to(dtype).to(tl.float32) * w2).to(dtype).to(tl.float32)
        c1 = tl.load(cos + pos * s_cos + offs, mask=mask, other=0.0).to(tl.float32)
        c2 = tl.load(cos + pos * s_cos + half + offs, mask=mask, other=0.0).to(tl.float32)
        n1 = tl.load(sin + pos * s_cos + offs, mask=mask, other=0.0).to(tl.float32)  # -sin (static_step.rope_tables)
        n2 = tl.load(sin + pos * s_cos + half + offs, mask=mask, other=0.0).to(tl.float32)
        y1 = x1 * c1 + x2 * n1
        y2 = x2 * c2 + x1 * n2
    else:  # values pass through
        y1 = x1
        y2 = x2
    if head < num_heads:
        out = q_out + row * s_q_r + head * s_q_h
    else:
        kv_head = head - num_heads
        which = kv_head // num_kv  # 0: keys, 1: values
        out = cache + which * s_c_kv + row * s_c_r + (kv_head - which * num_kv) * s_c_h + pos * s_c_col
    tl.store(out + offs, y1.to(dtype), mask=mask)
    tl.store(out + half + offs, y2.to(dtype), mask=mask)


def rope_store(qkv: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               cache: torch.Tensor, head_weight: torch.Tensor | None, *, num_heads: int, num_kv_heads: int,
               eps: float) -> torch.Tensor:
    """One launch: the rotated queries ``[rows, heads, d]`` (returned) and the row's keys / values
    written into ``cache`` ``[2, rows, kv, columns, d]`` at ``positions`` (step_kernels.rope_store's
    contract)."""
    rows, _, d = qkv.shape
    q = qkv.new_empty((rows, num_heads, d))
    half = d // 2
    weight = head_weight if head_weight is not None else q  # unread without a norm
    _rope_store_kernel[(rows, num_heads + 2 * num_kv_heads)](
        qkv, positions, cos, sin, weight, q, cache,
        qkv.stride(0), qkv.stride(1), cos.stride(0), weight.stride(0), q.stride(0), q.stride(1),
        cache.stride(0), cache.stride(1), cache.stride(2), cache.stride(3),
        half, eps, num_heads=num_heads, num_kv=num_kv_heads, HAS_NORM=head_weight is not None,
        BLOCK=triton.next_power_of_2(half))
    return q


@triton.jit
def _act_mul_kernel(gate_up, out, inter, s_in, s_out, GELU: tl.constexpr, BLOCK: tl.constexpr):
    row, block = tl.program_id(0), tl.program_id(1)
    offs = block * BLOCK + tl.arange(0, BLOCK)
    mask = offs < inter
    dtype = out.dtype.element_ty
    gate = tl.load(gate_up + row * s_in + offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(gate_up + row * s_in + inter + offs, mask=mask, other=0.0).to(tl.float32)
    if GELU:  # 0.5 g (1 + tanh(z)) = g sigmoid(2 z), z = sqrt(2 / pi) (g + 0.044715 g^3)
        act = gate * tl.sigmoid(2.0 * 0.7978845608028654 * (gate + 0.044715 * gate * gate * gate))
    else:
        act = gate * tl.sigmoid(gate)
    tl.store(out + row * s_out + offs, ((act).to(dtype).to(tl.float32) * up).to(dtype), mask=mask)


def act_mul(gate_up: torch.Tensor, *, gelu: bool) -> torch.Tensor:
    """One launch: ``act(gate) * up`` ``[rows, inter]`` of ``gate_up`` ``[rows, 2 inter]``."""
    rows, inter = gate_up.shape[0], gate_up.shape[1] // 2
    out = gate_up.new_empty((rows, inter))
    block = min(1024, triton.next_power_of_2(inter))
    _act_mul_kernel[(rows, triton.cdiv(inter, block))](gate_up, out, inter, gate_up.stride(0), out.stride(0),
                                                       GELU=gelu, BLOCK=block)
    return out


@triton.jit
def _rms_norm_kernel(x, weight, out, n, s_x, s_out, eps, offset, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    mask = offs < n
    v = tl.load(x + row * s_x + offs, mask=mask, other=0.0).to(tl.float32)
    w = tl.load(weight + offs, mask=mask, other=0.0).to(tl.float32)
    rstd = tl.rsqrt(tl.sum(v * v, axis=0) / n + eps)
    tl.store(out + row * s_out + offs, (v * rstd * (offset + w)).to(out.dtype.element_ty), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, *, eps: float, offset: float) -> torch.Tensor:
    """One launch: ``(offset + weight) * normalise(x)`` in fp32, rounded once, ``x`` ``[rows, n]``."""
    out = torch.empty_like(x)
    n = x.shape[1]
    _rms_norm_kernel[(x.shape[0],)](x, weight, out, n, x.stride(0), out.stride(0), eps, offset,
                                    BLOCK=triton.next_power_of_2(n))
    return out


@triton.jit
def _sandwich_kernel(hidden, y, post, nxt, out, n, s_h, s_y, s_out, eps, offset, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    mask = offs < n
    dtype = hidden.dtype.element_ty
    v = tl.load(y + row * s_y + offs, mask=mask, other=0.0).to(tl.float32)
    w = tl.load(post + offs, mask=mask, other=0.0).to(tl.float32)
    normed = (v * tl.rsqrt(tl.sum(v * v, axis=0) / n + eps) * (offset + w)).to(dtype).to(tl.float32)
    h = (tl.load(hidden + row * s_h + offs, mask=mask, other=0.0).to(tl.float32) + normed).to(dtype).to(tl.float32)
    tl.store(hidden + row * s_h + offs, h.to(dtype), mask=mask)
    w = tl.load(nxt + offs, mask=mask, other=0.0).to(tl.float32)
    rstd = tl.rsqrt(tl.sum(h * h, axis=0) / n + eps)
    tl.store(out + row * s_out + offs, (h * rstd * (offset + w)).to(dtype), mask=mask)


def sandwich(hidden: torch.Tensor, y: torch.Tensor, post: torch.Tensor, nxt: torch.Tensor, *, eps: float,
             offset: float) -> torch.Tensor:
    """One launch: ``hidden += norm_post(y)`` in place, returns ``norm_next(hidden)`` (both norms
    ``(offset + w) * normalise``, fp32 inside, rounded where HF rounds)."""
    out = torch.empty_like(hidden)
    n = hidden.shape[1]
    _sandwich_kernel[(hidden.shape[0],)](hidden, y, post, nxt, out, n, hidden.stride(0), y.stride(0), out.stride(0),
                                         eps, offset, BLOCK=triton.next_power_of_2(n))
    return out


@triton.jit
def _decode_attention_kernel(q, cache, positions, out, visits,
                             s_q_r, s_q_h, s_c_kv, s_c_r, s_c_h, s_c_col, s_o_r, s_o_h,
                             scaling, softcap, d, groups, num_kv,
                             SOFTCAP: tl.constexpr, PRECISION: tl.constexpr, COUNT: tl.constexpr,
                             BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    row, kv_head = tl.program_id(0), tl.program_id(1)
    g, dd, n = tl.arange(0, BLOCK_G), tl.arange(0, BLOCK_D), tl.arange(0, BLOCK_N)
    g_mask, d_mask = g < groups, dd < d
    dtype = out.dtype.element_ty
    # The KV head's query heads, padded to a tile of at least 16 rows (tl.dot's least), zeros past them.
    queries = tl.load(q + row * s_q_r + (kv_head * groups + g)[:, None] * s_q_h + dd[None, :],
                      mask=g_mask[:, None] & d_mask[None, :], other=0.0).to(tl.float32)
    length = tl.load(positions + row) + 1  # this row's live columns: 0 .. position
    keys = cache + row * s_c_r + kv_head * s_c_h
    values = keys + s_c_kv
    best = tl.full((BLOCK_G,), float("-inf"), tl.float32)
    total = tl.zeros((BLOCK_G,), tl.float32)
    acc = tl.zeros((BLOCK_G, BLOCK_D), tl.float32)
    blocks = row * 0  # an int32 scalar, carried through the loop
    for start in range(0, length, BLOCK_N):
        cols = start + n
        c_mask = cols < length
        k = tl.load(keys + cols[:, None] * s_c_col + dd[None, :], mask=c_mask[:, None] & d_mask[None, :],
                    other=0.0).to(tl.float32)
        scores = tl.dot(queries, tl.trans(k), input_precision=PRECISION) * scaling
        if SOFTCAP:  # Gemma2: cap * tanh(s / cap), tanh(x) = 2 sigmoid(2x) - 1
            scores = softcap * (2.0 * tl.sigmoid(2.0 * scores / softcap) - 1.0)
        scores = tl.where(c_mask[None, :], scores, float("-inf"))
        new_best = tl.maximum(best, tl.max(scores, axis=1))
        alpha = tl.exp(best - new_best)
        p = tl.exp(scores - new_best[:, None])
        total = total * alpha + tl.sum(p, axis=1)
        v = tl.load(values + cols[:, None] * s_c_col + dd[None, :], mask=c_mask[:, None] & d_mask[None, :],
                    other=0.0).to(tl.float32)
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=PRECISION)
        best = new_best
        blocks += 1
    tl.store(out + row * s_o_r + (kv_head * groups + g)[:, None] * s_o_h + dd[None, :],
             (acc / total[:, None]).to(dtype), mask=g_mask[:, None] & d_mask[None, :])
    if COUNT:
        tl.store(visits + row * num_kv + kv_head, blocks)


def decode_attention(q: torch.Tensor, cache: torch.Tensor, positions: torch.Tensor, *, scaling: float,
                     softcap: float, visits: torch.Tensor | None = None, block: int | None = None) -> torch.Tensor:
    """One launch: each row's queries ``q`` ``[rows, heads, d]`` over its own live keys and values,
    columns ``0 .. positions[row]`` of ``cache`` ``[2, rows, kv, columns, d]`` (a KV head's query
    heads together: GQA without repeating K / V), online softmax in fp32 (flash decoding without
    splits); ``softcap`` > 0 caps the scores (Gemma2). The products run on fp32 tiles: exact IEEE
    for an fp32 cache; TF32 for a 16-bit one, whose values TF32 holds exactly (bf16's 8-bit
    mantissa inside TF32's 10), so a bf16 cache loses nothing to the tensor cores' format. Blocks of ``block`` columns past a row's
    position are never read, whatever the cache's width. ``visits`` (int32 ``[rows * kv]``, tests):
    the blocks each program read. ``block`` (None: 64 columns, 32 past a head dim of 128, so a
    tile of keys and one of values stay small in shared memory: Gemma2's 256)."""
    rows, heads, d = q.shape
    block = block or (64 if d <= 128 else 32)
    kv = cache.shape[2]
    out = torch.empty_like(q)
    count = visits is not None
    _decode_attention_kernel[(rows, kv)](
        q, cache, positions, out, visits if count else out,
        q.stride(0), q.stride(1), cache.stride(0), cache.stride(1), cache.stride(2), cache.stride(3),
        out.stride(0), out.stride(1), scaling, softcap if softcap else 1.0, d, heads // kv, kv,
        SOFTCAP=bool(softcap), PRECISION="ieee" if q.dtype == torch.float32 else "tf32", COUNT=count,
        BLOCK_G=max(16, triton.next_power_of_2(heads // kv)), BLOCK_N=block, BLOCK_D=max(16, triton.next_power_of_2(d)),
        num_stages=2)
    return out


@triton.jit
def _greedy_kernel(logits, tokens, lps, vocab, s_l, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    best = tl.full((), float("-inf"), tl.float32)
    arg = row * 0
    total = tl.zeros((), tl.float32)  # sum of exp(x - best) so far
    for start in range(0, vocab, BLOCK):
        cols = start + offs
        x = tl.load(logits + row * s_l + cols, mask=cols < vocab, other=float("-inf")).to(tl.float32)
        block_best = tl.max(x, axis=0)
        block_arg = tl.argmax(x, axis=0, tie_break_left=True) + start
        new_best = tl.maximum(best, block_best)
        total = total * tl.exp(best - new_best) + tl.sum(tl.exp(x - new_best), axis=0)
        arg = tl.where(block_best > best, block_arg, arg)  # ties keep the earlier block: the lowest id
        best = new_best
    tl.store(tokens + row, arg.to(tl.int64))
    tl.store(lps + row, -tl.log(total))  # log_softmax at the max: (best - best) - log(total)


def greedy(logits: torch.Tensor, *, block: int = 4096) -> tuple[torch.Tensor, torch.Tensor]:
    """One launch: each row's argmax (ties to the lowest id) and its ``log_softmax`` value, the
    logits read once in blocks with a running max and sum of exponentials (fp32)."""
    rows, vocab = logits.shape
    tokens = torch.empty(rows, dtype=torch.long, device=logits.device)
    lps = torch.empty(rows, dtype=torch.float32, device=logits.device)
    _greedy_kernel[(rows,)](logits, tokens, lps, vocab, logits.stride(0), BLOCK=min(block, triton.next_power_of_2(vocab)))
    return tokens, lps


@triton.jit
def _book_kernel(tokens, lps, ok, ids, rec_lps, alive, stopped, overflow, end, is_stop, fed, positions,
                 s_ids, s_lps, width, HAS_OK: tl.constexpr):
    row = tl.program_id(0)
    token = tl.load(tokens + row)
    position = tl.load(positions + row)
    live = tl.load(alive + row) != 0
    take = live
    if HAS_OK:
        fine = tl.load(ok + row) != 0
        take = live & fine
        tl.store(overflow + row, (tl.load(overflow + row) != 0) | (live & ~fine))
    column = tl.where(take, position, width - 1)  # a row that takes nothing writes the trash column
    tl.store(ids + row * s_ids + column, token)
    tl.store(rec_lps + row * s_lps + column, tl.load(lps + row))
    hit = (tl.load(is_stop + token) != 0) & take
    still = take & ~hit & (position + 1 < tl.load(end + row))
    tl.store(stopped + row, (tl.load(stopped + row) != 0) | hit)
    tl.store(alive + row, live & (still | ~take))
    tl.store(fed + row, tl.where(still, token, tl.load(fed + row)))
    tl.store(positions + row, position + still.to(position.dtype))


def book(tokens: torch.Tensor, lps: torch.Tensor, ok: torch.Tensor | None, *, ids: torch.Tensor,
         rec_lps: torch.Tensor, alive: torch.Tensor, stopped: torch.Tensor, overflow: torch.Tensor,
         end: torch.Tensor, is_stop: torch.Tensor, fed: torch.Tensor, positions: torch.Tensor) -> None:
    """One launch: the books of the first ``len(tokens)`` slots after a draw
    (static_sampling.SlotRecords.book's contract, for a slice of the first rows)."""
    rows = tokens.shape[0]
    _book_kernel[(rows,)](tokens, lps, ok if ok is not None else alive, ids, rec_lps, alive, stopped, overflow, end,
                          is_stop, fed, positions, ids.stride(0), rec_lps.stride(0), ids.shape[1],
                          HAS_OK=ok is not None)
