"""The static decode step's Triton kernels (llamarl/engines/triton_kernels.py), run on the CPU by
Triton's interpreter (``TRITON_INTERPRET=1``) before a GPU sees them: each equals its op's CPU
reference (llamarl/engines/step_kernels.py, ``torch.ops.llamarl.*``: what the CPU proxy's step
runs) in fp32 and bf16, on shapes that are not powers of two and on the strided cache views the
step hands it, writing nothing but what it should, in one launch a call (the count the fake-graph
tape gives each op: tests/test_cuda_graph_proxies.py).

Needs ``triton`` (a dev dependency: pyproject.toml) and its interpreter, which tests/conftest.py
chooses before anything imports Triton (where no CUDA device is)."""

from __future__ import annotations

import importlib
import os

import pytest
import torch

pytest.importorskip("triton", reason="the Triton kernels need triton (pip install -e '.[dev]')")

import llamarl.engines.step_kernels  # noqa: F401 - registers torch.ops.llamarl.*

DTYPES = [torch.float32, torch.bfloat16]


@pytest.fixture(scope="module")
def kernels():
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("a CUDA device is here: tests/gpu runs the compiled kernels")
    return importlib.import_module("llamarl.engines.triton_kernels")


class Launches:
    """Counts a kernel's launches (``kernel[grid](...)``)."""

    def __init__(self, kernel) -> None:
        self.kernel, self.count = kernel, 0

    def __getitem__(self, grid):
        self.count += 1
        return self.kernel[grid]


@pytest.fixture
def launches(kernels, monkeypatch):
    counted = {}
    for name in ("_rope_store_kernel", "_act_mul_kernel", "_rms_norm_kernel", "_sandwich_kernel",
                 "_decode_attention_kernel", "_greedy_kernel", "_book_kernel"):
        counted[name] = Launches(getattr(kernels, name))
        monkeypatch.setattr(kernels, name, counted[name])
    return counted


def close(got: torch.Tensor, expected: torch.Tensor) -> None:
    """fp32: to rounding (the math). bf16: within 4 bf16 ulps of the tensor's largest value. Triton's
    interpreter casts fp32 to bf16 by truncation where a GPU rounds to nearest (checked: every one of
    1,000 values truncated), so a value the kernel rounds several times, or a difference of two
    rounded terms (RoPE), is off by a few ulps of its inputs here; the dtype handling (loads, the
    casts' places, stores) is what bf16 checks."""
    if got.dtype == torch.float32:
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    else:
        assert got.dtype == expected.dtype
        torch.testing.assert_close(got.float(), expected.float(), rtol=0,
                                   atol=4 * 2 ** -8 * expected.abs().max().item())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [16, 12])
@pytest.mark.parametrize("head_norm", [False, True])
def test_rope_store_rotates_and_writes_only_each_rows_position(kernels, launches, dtype, head_dim, head_norm):
    generator = torch.Generator().manual_seed(head_dim + head_norm)
    rows, heads, kv, slots, width, columns = 3, 4, 2, 5, 32, 24

    def rand(*shape):
        return torch.randn(shape, generator=generator).to(dtype)

    qkv = rand(rows, heads + 2 * kv, head_dim)
    cos, sin = rand(width, head_dim), rand(width, head_dim)
    weight = rand(heads + kv, head_dim) if head_norm else None
    positions = torch.tensor([0, 23, 7])
    full = rand(2, slots, kv, width, head_dim)
    original, expected_full = full.clone(), full.clone()
    expected_q = torch.ops.llamarl.rope_store(qkv, positions, cos, sin, expected_full[:, :rows, :, :columns],
                                              weight, heads, kv, 1e-6)
    q = kernels.rope_store(qkv, positions, cos, sin, full[:, :rows, :, :columns], weight, num_heads=heads,
                           num_kv_heads=kv, eps=1e-6)
    assert launches["_rope_store_kernel"].count == 1
    close(q, expected_q)
    close(full, expected_full)
    written = torch.zeros(full.shape, dtype=torch.bool)
    for row, position in enumerate(positions.tolist()):
        written[:, row, :, position] = True
    assert torch.equal(full[~written], original[~written])  # each row's position written, nothing else


def test_rope_store_is_hfs_rotation(kernels):
    """The reference itself: HF's ``x cos + rotate_half(x) sin`` for queries and keys, values as they are."""
    generator = torch.Generator().manual_seed(0)
    heads, kv, d = 2, 1, 8
    qkv = torch.randn((2, heads + 2 * kv, d), generator=generator)
    angles = torch.randn((16, d // 2), generator=generator)
    cos, sin = torch.cat((angles.cos(), angles.cos()), -1), torch.cat((angles.sin(), angles.sin()), -1)
    negated = torch.cat((-sin[:, :d // 2], sin[:, d // 2:]), -1)  # static_step.rope_tables' sine
    positions = torch.tensor([3, 9])
    cache = torch.zeros((2, 2, kv, 16, d))
    q = kernels.rope_store(qkv, positions, cos, negated, cache, None, num_heads=heads, num_kv_heads=kv, eps=1e-6)

    def hf(x, p):
        rotated = torch.cat((-x[..., d // 2:], x[..., :d // 2]), -1)
        return x * cos[p] + rotated * sin[p]

    for r, p in enumerate(positions.tolist()):
        close(q[r], hf(qkv[r, :heads], p))
        close(cache[0, r, :, p], hf(qkv[r, heads:heads + kv], p))
        close(cache[1, r, :, p], qkv[r, heads + kv:])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("inter", [40, 1500])
@pytest.mark.parametrize("gelu", [False, True])
def test_act_mul(kernels, launches, dtype, inter, gelu):
    gate_up = torch.randn((3, 2 * inter), generator=torch.Generator().manual_seed(inter)).mul(3).to(dtype)
    got = kernels.act_mul(gate_up, gelu=gelu)
    assert launches["_act_mul_kernel"].count == 1
    close(got, torch.ops.llamarl.act_mul(gate_up, gelu))
    # and the reference is HF's activation times up (fp32: to rounding)
    act = torch.nn.functional.gelu(gate_up[:, :inter].float(), approximate="tanh") if gelu \
        else torch.nn.functional.silu(gate_up[:, :inter].float())
    torch.testing.assert_close(torch.ops.llamarl.act_mul(gate_up.float(), gelu), act * gate_up[:, inter:].float(),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("offset", [0.0, 1.0])
def test_rms_norm(kernels, launches, dtype, offset):
    generator = torch.Generator().manual_seed(1)
    x, weight = torch.randn((3, 48), generator=generator).to(dtype), torch.randn(48, generator=generator).to(dtype)
    got = kernels.rms_norm(x, weight, eps=1e-6, offset=offset)
    assert launches["_rms_norm_kernel"].count == 1
    close(got, torch.ops.llamarl.rms_norm(x, weight, 1e-6, offset))
    expected = torch.nn.functional.rms_norm(x.float(), (48,), weight.float() + offset, 1e-6).to(dtype)
    close(torch.ops.llamarl.rms_norm(x, weight, 1e-6, offset), expected)


@pytest.mark.parametrize("dtype", DTYPES)
def test_sandwich_adds_the_normalised_block_and_normalises_the_sum(kernels, launches, dtype):
    generator = torch.Generator().manual_seed(2)

    def rand(*shape):
        return torch.randn(shape, generator=generator).to(dtype)

    hidden, y, post, nxt = rand(3, 40), rand(3, 40), rand(40), rand(40)
    before, expected_hidden = hidden.clone(), hidden.clone()
    expected = torch.ops.llamarl.sandwich(expected_hidden, y, post, nxt, 1e-6, 1.0)
    got = kernels.sandwich(hidden, y, post, nxt, eps=1e-6, offset=1.0)
    assert launches["_sandwich_kernel"].count == 1
    close(hidden, expected_hidden)
    close(got, expected)
    # The reference is Gemma2's block end: hidden + norm_post(y) (rounded, as HF's modules), then norm_next.
    normed = torch.nn.functional.rms_norm(y.float(), (40,), post.float() + 1, 1e-6).to(dtype)
    assert torch.equal(expected_hidden, (before.float() + normed.float()).to(dtype))
    close(expected, torch.nn.functional.rms_norm(expected_hidden.float(), (40,), nxt.float() + 1, 1e-6).to(dtype))


def reference_attention(q, cache, positions, scaling, softcap):
    """Attention written out: each row's heads over its columns 0 .. position, fp32, GQA by repeat."""
    rows, heads, d = q.shape
    kv = cache.shape[2]
    keys = cache[0].float().repeat_interleave(heads // kv, dim=1)  # [rows, heads, columns, d]
    values = cache[1].float().repeat_interleave(heads // kv, dim=1)
    out = torch.empty(rows, heads, d)
    for r, p in enumerate(positions.tolist()):
        s = torch.einsum("hd,hcd->hc", q[r].float(), keys[r, :, :p + 1]) * scaling
        if softcap:
            s = torch.tanh(s / softcap) * softcap
        out[r] = torch.einsum("hc,hcd->hd", s.softmax(-1), values[r, :, :p + 1])
    return out


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("softcap", [0.0, 5.0])
def test_decode_attention_reads_each_rows_live_columns(kernels, launches, monkeypatch, dtype, softcap):
    """Issue 45's attention over live tokens, per row: the kernel visits ceil((position + 1) / 64)
    blocks of columns for each (row, KV head), counted by the kernel itself, so doubling the
    cache's width at the same positions changes neither the blocks visited nor the output; the
    output is attention over each row's own columns (GQA, 3 query heads a KV head, head dim 24)."""
    generator = torch.Generator().manual_seed(3)
    rows, heads, kv, d = 4, 6, 2, 24
    positions = torch.tensor([0, 63, 64, 150])
    q = torch.randn((rows, heads, d), generator=generator).to(dtype)
    narrow = torch.randn((2, rows, kv, 256, d), generator=generator).to(dtype)
    wide = torch.zeros((2, rows + 3, kv, 512, d), dtype=dtype)  # more slots and twice the columns
    wide[:, :rows, :, :256] = narrow
    wide[:, :rows, :, 256:] = float("nan")  # never read: a read would poison the output
    outs, visits = [], []
    for cache in (narrow, wide[:, :rows]):
        counted = torch.zeros(rows * kv, dtype=torch.int32)
        outs.append(kernels.decode_attention(q, cache, positions, scaling=d ** -0.5, softcap=softcap, visits=counted))
        visits.append(counted)
    assert launches["_decode_attention_kernel"].count == 2
    expected_visits = torch.tensor([1, 1, 1, 1, 2, 2, 3, 3], dtype=torch.int32)  # ceil((p + 1) / 64) per KV head
    assert torch.equal(visits[0], expected_visits) and torch.equal(visits[1], expected_visits)
    assert torch.equal(outs[0], outs[1]) and not outs[0].isnan().any()
    reference = torch.ops.llamarl.decode_attention(q, narrow, positions, d ** -0.5, softcap)
    close(outs[0], reference)
    close(reference, reference_attention(q, narrow, positions, d ** -0.5, softcap).to(dtype))


@pytest.mark.parametrize("vocab", [1000, 9000])  # one block; three blocks, the last partial
def test_greedy_is_the_argmax_and_its_log_softmax(kernels, launches, vocab):
    generator = torch.Generator().manual_seed(vocab)
    logits = torch.randn((5, vocab), generator=generator) * 4
    logits[1, 7] = logits[1, vocab - 3] = logits[1].max() + 1  # a tie across blocks: the lowest id wins
    logits[2, min(4096 + 5, vocab - 1)] = logits[2].max() + 1  # the maximum in a later block (the last id)
    tokens, lps = kernels.greedy(logits, block=4096)
    assert launches["_greedy_kernel"].count == 1
    expected_tokens, expected_lps = torch.ops.llamarl.greedy(logits)
    assert tokens.tolist() == expected_tokens.tolist() == logits.argmax(-1).tolist()
    torch.testing.assert_close(lps, expected_lps, rtol=0, atol=1e-5)
    torch.testing.assert_close(lps, torch.log_softmax(logits, -1).gather(1, tokens[:, None]).squeeze(1),
                               rtol=0, atol=1e-5)


@pytest.mark.parametrize("with_ok", [False, True])
def test_book_keeps_the_records_as_the_reference(kernels, launches, with_ok):
    """Rows alive or not, a stop id drawn, a budget reached, a stalled top-p row (``ok`` False):
    the kernel writes the records, liveness, fed tokens and positions the reference writes."""
    from llamarl.engines.static_sampling import SlotRecords

    def records():
        r = SlotRecords(slots=6, width=16, vocab=50, device=torch.device("cpu"))
        r.begin([7, 9])
        r.admit(torch.arange(5), bases=[2, 3, 4, 5, 6], limits=[5, 1, 5, 5, 5], uniforms=None)
        r.alive[3] = False  # finished earlier
        return r

    tokens, lps = torch.tensor([7, 3, 4, 5, 9]), torch.tensor([-0.1, -0.2, -0.3, -0.4, -0.5])
    ok = torch.tensor([True, True, True, False, False]) if with_ok else None
    states = []
    for run in ("kernel", "reference"):
        r, fed, positions = records(), torch.tensor([1, 2, 3, 4, 5, 6]), torch.tensor([2, 3, 4, 5, 6, 0])
        args = {"ids": r.ids[:5], "rec_lps": r.lps[:5], "alive": r.alive[:5], "stopped": r.stopped[:5],
                    "overflow": r.overflow[:5], "end": r.end[:5], "is_stop": r.is_stop, "fed": fed[:5], "positions": positions[:5]}
        if run == "kernel":
            kernels.book(tokens, lps, ok, **args)
        else:
            r.book(slice(0, 5), tokens, lps, ok, fed=fed, positions=positions)
        states.append([r.ids, r.lps, r.alive, r.stopped, r.overflow, fed, positions])
    assert launches["_book_kernel"].count == 1
    for got, expected in zip(*states):
        assert torch.equal(got, expected)
    alive, stopped = states[1][2], states[1][3]
    assert stopped[0] and not alive[0]  # drew a stop id
    assert not alive[1]  # reached its budget (one new token)
    assert alive[2] and states[1][6][2] == 5  # went on: its position advanced
    if with_ok:
        assert states[1][4][4] and alive[4] and states[1][6][4] == 6  # stalled: overflow, alive, same position
