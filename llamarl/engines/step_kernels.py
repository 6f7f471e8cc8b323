"""The kernels of the static decode step (llamarl/engines/static_step.py), as two interchangeable sets
with one signature: ``TORCH_KERNELS`` (aten ops: the CPU's step, and CUDA's where Triton is missing)
and ``FUSED_KERNELS`` (one launch each on CUDA: Triton, llamarl/engines/triton_kernels.py).

Why two: on a GPU a replayed decode step of a small model is bound by its number of kernels (one
H200: ~3 µs each; docs/gpu.md), and aten needs several where one fused kernel does: RoPE with the
KV store (3 aten kernels: queries' rotation, keys' and values' rotation, the indexed write; 5 with
Qwen3's head norms), SiLU·mul (2), Gemma2's ``1 + weight`` norms (5 each, in fp32) and its sandwich
(post-block norm, residual add, next norm: 11). And aten's attention reads every column of the
cache behind a mask (5 kernels a step build it), where a decode kernel reads each row's own live
columns: at 256 rows the KV read is most of a step's bytes. On the CPU the aten step is the one to
keep (its speed is measured, and the bf16 step runs in C anyway: llamarl/engines/cpu/).

The fused set's kernels are ``torch.library`` custom ops (``llamarl::rope_store``, ``act_mul``,
``rms_norm``, ``sandwich``, ``decode_attention``): on CUDA each is one Triton launch; on the CPU each runs its reference
(the same math in aten ops, rounding where the kernel rounds), which is what tests compare the
Triton kernels with under ``TRITON_INTERPRET=1``, and a dispatched op is one kernel on the CPU
proxy's fake-graph tape (tests/fake_cuda.py) as it is one launch on the GPU. Each op has a fake
(meta) implementation, so ``torch.compile`` traces the step through them as opaque calls.

The set is chosen once per decoder (``choose_kernels``): fused where the model is on CUDA, Triton
imports and the family's activation is one the kernel knows; aten otherwise, said in one line.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import NamedTuple

import torch

from llamarl.engines.sampling import _greedy
from llamarl.engines.static_sampling import book_first_rows, sample

logger = logging.getLogger(__name__)

# Activations the fused act_mul kernel computes, by the names HF's configs use.
_ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_new": "gelu_tanh"}


def activation_kind(config) -> str:
    """``"silu"`` / ``"gelu_tanh"`` for the activations the fused kernel knows, else the config's own name."""
    name = getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", "silu")
    return _ACTIVATIONS.get(name, name)


def _round(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return x.to(dtype).float()


# ---- the fused ops: references on the CPU, Triton on CUDA ---------------------------------------

# Schemas written out: they do not depend on how a torch version reads the annotations.
@torch.library.custom_op("llamarl::rope_store", mutates_args={"cache"}, schema=(
    "(Tensor qkv, Tensor positions, Tensor cos, Tensor sin, Tensor(a!) cache, Tensor? head_weight, "
    "int num_heads, int num_kv_heads, float eps) -> Tensor"))
def _rope_store(qkv: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                cache: torch.Tensor, head_weight: torch.Tensor | None, num_heads: int, num_kv_heads: int,
                eps: float) -> torch.Tensor:
    """Queries rotated ``[rows, heads, d]`` (returned); keys rotated and values as they are written
    into ``cache`` ``[2, rows, kv, columns, d]`` at each row's position. ``qkv`` ``[rows, heads +
    2 kv, d]``; ``cos`` / ``sin`` ``[width, d]`` (the sine's first half negated:
    ``static_step.rope_tables``); ``head_weight`` ``[heads + kv, d]``: Qwen3's per-head RMSNorm
    weights (normalise, round, times the weight, round, as HF), None for no head norm."""
    dtype, (rows, _, d) = qkv.dtype, qkv.shape
    x = qkv.float()
    rotated = num_heads + num_kv_heads
    heads = x[:, :rotated]
    if head_weight is not None:
        heads = _round(heads * torch.rsqrt(heads.pow(2).mean(-1, keepdim=True) + eps), dtype)
        heads = _round(heads * head_weight.float(), dtype)
    c, s = cos[positions].float().unsqueeze(1), sin[positions].float().unsqueeze(1)
    heads = heads * c + heads.roll(d // 2, dims=-1) * s
    out = torch.cat((heads, x[:, rotated:]), dim=1).to(dtype)
    row_index = torch.arange(rows, device=qkv.device)
    cache[:, row_index, :, positions] = out[:, num_heads:].view(rows, 2, num_kv_heads, d)
    return out[:, :num_heads].contiguous()


@_rope_store.register_fake
def _(qkv, positions, cos, sin, cache, head_weight, num_heads, num_kv_heads, eps):
    return qkv.new_empty((qkv.shape[0], num_heads, qkv.shape[2]))


@torch.library.custom_op("llamarl::act_mul", mutates_args=(), schema="(Tensor gate_up, bool gelu) -> Tensor")
def _act_mul(gate_up: torch.Tensor, gelu: bool) -> torch.Tensor:
    """``act(gate) * up`` of ``gate_up`` ``[rows, 2 inter]``: SiLU, or (``gelu``) the
    tanh-approximated GELU; the activation rounded to the dtype before the product, as HF's MLP."""
    inter = gate_up.shape[1] // 2
    gate, up = gate_up[:, :inter].float(), gate_up[:, inter:].float()
    act = gate * torch.sigmoid(1.5957691216057308 * (gate + 0.044715 * gate.pow(3))) if gelu else gate * torch.sigmoid(gate)
    return (_round(act, gate_up.dtype) * up).to(gate_up.dtype)


@_act_mul.register_fake
def _(gate_up, gelu):
    return gate_up.new_empty((gate_up.shape[0], gate_up.shape[1] // 2))


def _normalise(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (offset + weight.float())


@torch.library.custom_op("llamarl::rms_norm", mutates_args=(),
                         schema="(Tensor x, Tensor weight, float eps, float offset) -> Tensor")
def _offset_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float) -> torch.Tensor:
    """``(offset + weight) * normalise(x)``, fp32 inside, rounded once (Gemma2's norm)."""
    return _normalise(x.float(), weight, eps, offset).to(x.dtype)


@_offset_rms_norm.register_fake
def _(x, weight, eps, offset):
    return torch.empty_like(x)


@torch.library.custom_op("llamarl::sandwich", mutates_args={"hidden"}, schema=(
    "(Tensor(a!) hidden, Tensor y, Tensor post, Tensor nxt, float eps, float offset) -> Tensor"))
def _sandwich(hidden: torch.Tensor, y: torch.Tensor, post: torch.Tensor, nxt: torch.Tensor, eps: float,
              offset: float) -> torch.Tensor:
    """Gemma2's block end: ``hidden += norm_post(y)`` (the norm's output rounded, then the sum), and
    ``norm_next(hidden)`` returned."""
    dtype = hidden.dtype
    hidden.copy_(hidden.float() + _round(_normalise(y.float(), post, eps, offset), dtype))
    return _normalise(hidden.float(), nxt, eps, offset).to(dtype)


@_sandwich.register_fake
def _(hidden, y, post, nxt, eps, offset):
    return torch.empty_like(hidden)


@torch.library.custom_op("llamarl::decode_attention", mutates_args=(), schema=(
    "(Tensor q, Tensor cache, Tensor positions, float scaling, float softcap) -> Tensor"))
def _decode_attention(q: torch.Tensor, cache: torch.Tensor, positions: torch.Tensor, scaling: float,
                      softcap: float) -> torch.Tensor:
    """Each row's queries ``q`` ``[rows, heads, d]`` over its own columns ``0 .. positions[row]`` of
    ``cache`` ``[2, rows, kv, columns, d]``, a KV head's query heads together (GQA without repeating
    K / V); softmax in fp32; ``softcap`` > 0: scores capped, ``cap * tanh(s / cap)`` (Gemma2). On
    CUDA the kernel reads a row's live columns only (triton_kernels.decode_attention); this
    reference masks the rest."""
    rows, heads, d = q.shape
    kv, columns = cache.shape[2], cache.shape[3]
    scores = torch.einsum("rkgd,rkcd->rkgc", q.float().view(rows, kv, heads // kv, d), cache[0].float()) * scaling
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    live = torch.arange(columns, device=q.device) <= positions.unsqueeze(1)  # [rows, columns]
    scores = scores.masked_fill(~live[:, None, None, :], float("-inf"))
    out = torch.einsum("rkgc,rkcd->rkgd", torch.softmax(scores, dim=-1), cache[1].float())
    return out.reshape(rows, heads, d).to(q.dtype)


@_decode_attention.register_fake
def _(q, cache, positions, scaling, softcap):
    return torch.empty_like(q)


@_decode_attention.register_kernel("cuda")
def _(q, cache, positions, scaling, softcap):
    from llamarl.engines import triton_kernels
    return triton_kernels.decode_attention(q, cache, positions, scaling=scaling, softcap=softcap)


@torch.library.custom_op("llamarl::greedy", mutates_args=(), schema="(Tensor logits) -> (Tensor, Tensor)")
def _greedy_op(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's argmax (ties to the lowest id) and its ``log_softmax`` value (sampling._greedy)."""
    return _greedy(logits)


@_greedy_op.register_fake
def _(logits):
    rows = logits.shape[0]
    return logits.new_empty(rows, dtype=torch.long), logits.new_empty(rows, dtype=torch.float32)


@_greedy_op.register_kernel("cuda")
def _(logits):
    from llamarl.engines import triton_kernels
    return triton_kernels.greedy(logits)


@torch.library.custom_op("llamarl::book", mutates_args={"ids", "rec_lps", "alive", "stopped", "overflow", "fed",
                                                        "positions"}, schema=(
    "(Tensor tokens, Tensor lps, Tensor? ok, Tensor(a!) ids, Tensor(b!) rec_lps, Tensor(c!) alive, "
    "Tensor(d!) stopped, Tensor(e!) overflow, Tensor end, Tensor is_stop, Tensor(f!) fed, Tensor(g!) positions) -> ()"))
def _book_op(tokens: torch.Tensor, lps: torch.Tensor, ok: torch.Tensor | None, ids: torch.Tensor,
             rec_lps: torch.Tensor, alive: torch.Tensor, stopped: torch.Tensor, overflow: torch.Tensor,
             end: torch.Tensor, is_stop: torch.Tensor, fed: torch.Tensor, positions: torch.Tensor) -> None:
    """The books of the first rows after a draw (static_sampling.book_first_rows)."""
    book_first_rows(tokens, lps, ok, ids=ids, rec_lps=rec_lps, alive=alive, stopped=stopped, overflow=overflow,
                    end=end, is_stop=is_stop, fed=fed, positions=positions)


@_book_op.register_fake
def _(tokens, lps, ok, ids, rec_lps, alive, stopped, overflow, end, is_stop, fed, positions):
    return None


@_book_op.register_kernel("cuda")
def _(tokens, lps, ok, ids, rec_lps, alive, stopped, overflow, end, is_stop, fed, positions):
    from llamarl.engines import triton_kernels
    triton_kernels.book(tokens, lps, ok, ids=ids, rec_lps=rec_lps, alive=alive, stopped=stopped, overflow=overflow,
                        end=end, is_stop=is_stop, fed=fed, positions=positions)


@_rope_store.register_kernel("cuda")
def _(qkv, positions, cos, sin, cache, head_weight, num_heads, num_kv_heads, eps):
    from llamarl.engines import triton_kernels
    return triton_kernels.rope_store(qkv, positions, cos, sin, cache, head_weight, num_heads=num_heads,
                                     num_kv_heads=num_kv_heads, eps=eps)


@_act_mul.register_kernel("cuda")
def _(gate_up, gelu):
    from llamarl.engines import triton_kernels
    return triton_kernels.act_mul(gate_up, gelu=gelu)


@_offset_rms_norm.register_kernel("cuda")
def _(x, weight, eps, offset):
    from llamarl.engines import triton_kernels
    return triton_kernels.rms_norm(x, weight, eps=eps, offset=offset)


@_sandwich.register_kernel("cuda")
def _(hidden, y, post, nxt, eps, offset):
    from llamarl.engines import triton_kernels
    return triton_kernels.sandwich(hidden, y, post, nxt, eps=eps, offset=offset)


# ---- the two sets -----------------------------------------------------------------------------

class StepKernels(NamedTuple):
    """The step's kernels: one signature, two sets (module docstring).

    * ``prepare(cos, sin, positions, *, width, num_kv_heads, dtype)``: what the others need once a
      step (the aten set's RoPE rotation matrices and attention mask; None for the fused set);
    * ``norm(x, weight, eps, offset)``;
    * ``sandwich(hidden, y, post, next, eps, offset)``: ``hidden += norm_post(y)`` in place,
      returns ``norm_next(hidden)``;
    * ``rope_store(qkv, prepared, positions, cos, sin, cache, head_weight, num_heads, num_kv_heads,
      eps)``: returns the rotated queries ``[rows, heads, d]``, writes keys and values into ``cache``;
    * ``attend(q, cache, prepared, positions, scaling, softcap)``: ``[rows, heads, d]``, each row
      over its columns ``0 .. position`` (softcap None: none): aten, one SDPA kernel over every
      column of the cache behind a mask; fused, one kernel reading each row's live columns only;
    * ``act_mul(gate_up, act_fn, kind)``;
    * ``sample(logits, uniforms, key)``: ``(tokens, log-probs, ok)`` (static_sampling.sample's
      contract; the fused set draws greedy rows in one kernel);
    * ``book(records, rows, tokens, lps, ok, fed, positions)``: the first ``rows`` slots' books
      after a draw (static_sampling.SlotRecords.book; one kernel in the fused set)."""

    name: str
    reads_live_columns: bool
    """``attend`` reads each row's columns ``0 .. position`` only, whatever the cache's width (the
    step then needs no attention span: static_decode.StaticDecoder.attention_span)."""
    prepare: Callable
    norm: Callable
    sandwich: Callable
    rope_store: Callable
    attend: Callable
    act_mul: Callable
    sample: Callable
    book: Callable


def _aten_norm(x, weight, eps, offset):
    """HF's Llama-family RMSNorm as one fused kernel on CUDA; ``offset`` (Gemma2's 1):
    ``(offset + weight) * normalise(x)`` in fp32, rounded once, as HF's Gemma2 norm."""
    if not offset:
        return torch.nn.functional.rms_norm(x, (x.shape[-1],), weight, eps)
    return torch.nn.functional.rms_norm(x.float(), (x.shape[-1],), weight.float() + offset, eps).to(x.dtype)


def _aten_sandwich(hidden, y, post, nxt, eps, offset):
    hidden.add_(_aten_norm(y, post, eps, offset))
    return _aten_norm(hidden, nxt, eps, offset)


def _aten_prepare(cos_table, sin_table, positions, *, width, num_kv_heads, dtype):
    """``[R | I]`` per row ``[rows, d, 2d]``, ``R`` RoPE at the row's position as a matrix (the
    sine table's first half negated): a row vector ``x`` times ``R`` is HF's ``x * cos +
    rotate_half(x) * sin``, the identity half passes the values through; the rows' indices, for the
    cache writes; the attention's additive mask, one row per (row, KV head): ``[rows * kv, 1, 1,
    width]``, 0 up to the row's position."""
    cos, sin = cos_table[positions].unsqueeze(1), sin_table[positions].unsqueeze(1)  # [rows, 1, d]
    d = cos.shape[-1]
    eye = torch.eye(d, dtype=cos.dtype, device=cos.device)
    rotation = eye * cos + eye.roll(d // 2, dims=1) * sin
    rows = positions.shape[0]
    visible = torch.arange(width, device=positions.device) <= positions.unsqueeze(1)  # [rows, width]
    bias = torch.zeros((rows, num_kv_heads, 1, width), dtype=dtype, device=positions.device).masked_fill(
        ~visible[:, None, None, :], torch.finfo(dtype).min).view(rows * num_kv_heads, 1, 1, width)
    return (torch.cat((rotation, eye.expand_as(rotation)), dim=2), torch.arange(rows, device=positions.device), bias)


def _aten_rope_store(qkv, prepared, positions, cos, sin, cache, head_weight, num_heads, num_kv_heads, eps):
    rows, _, head_dim = qkv.shape
    if head_weight is not None:
        # Qwen3: RMSNorm over each q and k head before RoPE, as HF (normalise, round, then the
        # weight): one norm over every head (v's is not used), one product written back into the
        # q / k heads, so keys and values stay one buffer for the rotation below.
        qk = qkv[:, :num_heads + num_kv_heads]
        normed = torch.nn.functional.rms_norm(qkv, (head_dim,), None, eps)
        if torch.compiler.is_compiling():  # dynamo refuses a strided out=; inductor fuses these two
            qk.copy_(normed[:, :num_heads + num_kv_heads] * head_weight)
        else:
            torch.mul(normed[:, :num_heads + num_kv_heads], head_weight, out=qk)
    rotation, row_index, _ = prepared
    q, kv = qkv[:, :num_heads], qkv[:, num_heads:]
    q = torch.bmm(q, rotation[:, :, :head_dim])  # [rows, heads, d], contiguous
    new = torch.bmm(kv, rotation)  # [rows, 2 kv, 2d]: rotated keys in the first half, values in the second
    # A view [rows, 2, kv, d] of (keys, values): head h's rotated half of the keys, its identity
    # half of the values, i.e. the diagonal of (keys / values) x (first / second half).
    new = torch.diagonal(new.view(rows, 2, num_kv_heads, 2, head_dim), dim1=1, dim2=3).permute(0, 3, 1, 2)
    cache[:, row_index, :, positions] = new  # the indexed dims first: [rows, 2, kv, d]
    return q


def _aten_attend(q, cache, prepared, positions, scaling, softcap):
    """One SDPA kernel over (row, KV head) pairs, a KV head's query heads as its queries (GQA
    without repeating K / V), masked by position; with ``softcap`` (Gemma2) HF's eager math,
    ``softmax(cap * tanh(q k^T * scaling / cap) + mask)`` in fp32, then ``@ values``."""
    rows, heads, d = q.shape
    kv, width = cache.shape[2], cache.shape[3]
    bias = prepared[2]
    q = q.view(rows * kv, 1, heads // kv, d)
    keys, values = cache[0].view(rows * kv, 1, width, d), cache[1].view(rows * kv, 1, width, d)
    if softcap is None:
        out = torch.nn.functional.scaled_dot_product_attention(q, keys, values, attn_mask=bias, scale=scaling)
    else:
        scores = torch.matmul(q, keys.transpose(-1, -2)) * scaling
        scores = torch.tanh(scores / softcap) * softcap + bias
        out = torch.matmul(torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype), values)
    return out.view(rows, heads, d)


def _aten_act_mul(gate_up, act_fn, kind):
    inter = gate_up.shape[1] // 2
    return act_fn(gate_up[:, :inter]) * gate_up[:, inter:]


def _aten_book(records, rows, tokens, lps, ok, fed, positions):
    records.book(slice(0, rows), tokens, lps, ok, fed=fed, positions=positions)


TORCH_KERNELS = StepKernels("torch", False, _aten_prepare, _aten_norm, _aten_sandwich, _aten_rope_store, _aten_attend,
                            _aten_act_mul, sample, _aten_book)
"""aten ops: 12 kernels a layer on CUDA for Llama / Qwen2 / Mistral (static_step.py)."""


def _fused_norm(x, weight, eps, offset):
    if not offset:  # aten's rms_norm is already one fused kernel on CUDA
        return _aten_norm(x, weight, eps, offset)
    return torch.ops.llamarl.rms_norm(x, weight, eps, offset)


def _fused_prepare(cos_table, sin_table, positions, *, width, num_kv_heads, dtype):
    return None  # RoPE's tables are read by position, the attention reads each row's own length


def _fused_attend(q, cache, prepared, positions, scaling, softcap):
    return torch.ops.llamarl.decode_attention(q, cache, positions, scaling, softcap or 0.0)


def _fused_rope_store(qkv, prepared, positions, cos, sin, cache, head_weight, num_heads, num_kv_heads, eps):
    return torch.ops.llamarl.rope_store(qkv, positions, cos, sin, cache, head_weight, num_heads, num_kv_heads, eps)


def _fused_act_mul(gate_up, act_fn, kind):
    return torch.ops.llamarl.act_mul(gate_up, kind == "gelu_tanh")


def _fused_sample(logits, uniforms, key):
    if key[0] == 0:  # greedy
        return (*torch.ops.llamarl.greedy(logits), None)
    return sample(logits, uniforms, key)


def _fused_book(records, rows, tokens, lps, ok, fed, positions):
    torch.ops.llamarl.book(tokens, lps, ok, records.ids[:rows], records.lps[:rows], records.alive[:rows],
                           records.stopped[:rows], records.overflow[:rows], records.end[:rows], records.is_stop,
                           fed[:rows], positions[:rows])


FUSED_KERNELS = StepKernels("fused", True, _fused_prepare, _fused_norm, torch.ops.llamarl.sandwich, _fused_rope_store,
                            _fused_attend, _fused_act_mul, _fused_sample, _fused_book)
"""One launch per op on CUDA (Triton): 9 kernels a layer for every supported family, the attention
reading each row's live columns only, nothing built once a step."""

KERNEL_SETS = {"torch": TORCH_KERNELS, "fused": FUSED_KERNELS}


def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def choose_kernels(model: torch.nn.Module, *, cuda: bool) -> StepKernels:
    """The fused set where the step runs on CUDA (``cuda``), Triton imports and the model's
    activation is one the fused kernel knows; the aten set otherwise (on CUDA, said in one line)."""
    if not cuda:
        return TORCH_KERNELS
    kind = activation_kind(model.config)
    if kind not in ("silu", "gelu_tanh"):
        logger.info("static decode: aten kernels (the fused kernels do not compute the activation %r)", kind)
        return TORCH_KERNELS
    if not triton_available():
        logger.info("static decode: aten kernels, 12 a layer (Triton is not importable: `pip install triton` "
                    "for the fused kernels, 9 a layer)")
        return TORCH_KERNELS
    return FUSED_KERNELS
