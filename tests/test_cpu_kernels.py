"""The C kernels of bf16 CPU decode steps (llamarl/engines/cpu/cpu_kernels.py, csrc/bf16_decode.c)
against the PyTorch ops they replace: each helper alone (RMSNorm with and without the residual add,
SwiGLU, attention with RoPE and the KV-cache write, the AVX512-BF16 and AMX GEMMs and their weight
layout), refused inputs, a failed
build falling back, and whole decode steps of bf16 Llama / Qwen2 / Mistral layouts through
``FusedDecoder`` with and without them."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch
from model_families import build_family, chat_tokenizer
from slot_steps import load_rows, step_rows

from llamarl.engines.cpu import cpu_kernels
from llamarl.engines.cpu.fused_decode import FusedDecoder, _rotate_half
from llamarl.engines.torch_engine import TorchEngine

BF16 = torch.bfloat16


def randn(*shape: int, seed: int, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale).to(BF16)


def test_the_layer_helpers_build_here():
    # The helpers need only a C compiler (the CI machines have gcc); a failed build must be seen here,
    # not hidden behind the PyTorch fallback.
    assert cpu_kernels.available()
    assert cpu_kernels.gemm_available() == cpu_kernels.cpu_has_avx512_bf16()
    # gcc >= 11 has -mamx-bf16: on an AMX CPU the AMX GEMM must be built (used where Linux grants
    # the process the tile state, which a kernel before 5.16 does not).
    amx_cpu = "amx_bf16" in cpu_kernels.cpu_flags() and cpu_kernels.cpu_has_avx512_bf16()
    assert cpu_kernels._library().llamarl_has_amx() == int(amx_cpu)
    assert cpu_kernels.amx_available() == (amx_cpu and cpu_kernels._library().llamarl_amx_init() == 0)


def test_rmsnorm_and_the_residual_add_match_hfs_bf16_norm():
    x, delta, weight = randn(3, 96, seed=0, scale=3), randn(3, 96, seed=1), randn(96, seed=2)
    eps = 1e-5
    reference = weight * torch.nn.functional.rms_norm(x.float(), (96,), eps=eps).to(BF16)
    torch.testing.assert_close(cpu_kernels.rmsnorm(x, weight, eps=eps), reference)
    hidden = x.clone()
    normed = cpu_kernels.add_rmsnorm(hidden, delta, weight, eps=eps)
    assert torch.equal(hidden, x + delta)  # one bf16 rounding of the sum, as PyTorch's add
    torch.testing.assert_close(normed, weight * torch.nn.functional.rms_norm((x + delta).float(), (96,),
                                                                            eps=eps).to(BF16))


def test_swiglu_matches_silu_times_up_bitwise():
    gate_up = torch.cat([torch.linspace(-40, 40, 4001).to(BF16).view(1, -1), randn(1, 4001, seed=3, scale=4)], dim=1)
    gate, up = gate_up.chunk(2, dim=-1)
    assert torch.equal(cpu_kernels.silu_mul(gate_up), torch.nn.functional.silu(gate) * up)


def reference_attention(qkv, cos, sin, keys, values, positions, *, num_heads, scaling, qk_norms=None, eps=1e-6):
    """HF's eager bf16 attention for one token per row, written with PyTorch ops; with ``qk_norms``
    (q_norm and k_norm weights) each head RMS-normalized first, as Qwen3's attention does."""
    rows, num_kv, d = qkv.shape[0], keys.shape[1], keys.shape[3]
    q = qkv[:, : num_heads * d].view(rows, num_heads, d)
    k = qkv[:, num_heads * d : (num_heads + num_kv) * d].view(rows, num_kv, d)
    v = qkv[:, (num_heads + num_kv) * d :].view(rows, num_kv, d)
    if qk_norms is not None:
        q, k = (w * torch.nn.functional.rms_norm(x.float(), (d,), eps=eps).to(BF16) for w, x in zip(qk_norms, (q, k)))
    c, s = cos[:, None, :], sin[:, None, :]
    q, k = q * c + _rotate_half(q) * s, k * c + _rotate_half(k) * s
    out = []
    for r, pos in enumerate(positions.tolist()):
        keys[r, :, pos], values[r, :, pos] = k[r], v[r]
        kr = keys[r, :, : pos + 1].repeat_interleave(num_heads // num_kv, dim=0)  # [heads, pos + 1, d]
        vr = values[r, :, : pos + 1].repeat_interleave(num_heads // num_kv, dim=0)
        scores = torch.baddbmm(torch.zeros(num_heads, 1, pos + 1, dtype=BF16), q[r][:, None], kr.transpose(1, 2),
                               alpha=scaling)
        weights = torch.softmax(scores, dim=-1, dtype=torch.float32).to(BF16)
        out.append(torch.bmm(weights, vr).reshape(-1))
    return torch.stack(out)


@pytest.mark.parametrize("qk_norms", [False, True], ids=["plain", "qk-norms"])
@pytest.mark.parametrize("num_heads,num_kv,head_dim", [(4, 2, 16), (9, 3, 64), (2, 2, 8)])
def test_attention_writes_the_cache_and_attends_like_hfs_eager_attention(num_heads, num_kv, head_dim, qk_norms):
    rows, width, capacity = 3, 40, 4
    qkv = randn(rows, (num_heads + 2 * num_kv) * head_dim, seed=4, scale=2)
    angles = torch.rand(rows, head_dim // 2, generator=torch.Generator().manual_seed(5)) * 6
    cos, sin = torch.cat([angles.cos()] * 2, -1).to(BF16), torch.cat([angles.sin()] * 2, -1).to(BF16)
    keys, values = randn(capacity, num_kv, width, head_dim, seed=6), randn(capacity, num_kv, width, head_dim, seed=7)
    positions = torch.tensor([0, 17, 39])  # a first token, a middle one, the last column
    ref_keys, ref_values = keys.clone(), values.clone()
    scaling = head_dim ** -0.5
    # Qwen3's q / k norms: weights away from 1, so a kernel that skipped or swapped them fails
    norms = (randn(head_dim, seed=8, scale=0.5) + 1, randn(head_dim, seed=9, scale=0.5) - 1) if qk_norms else None
    out = cpu_kernels.attention(qkv, cos=cos, sin=sin, keys=keys, values=values, positions=positions,
                                num_heads=num_heads, scaling=scaling, norm_eps=1e-6,
                                **(dict(zip(("q_norm", "k_norm"), norms)) if qk_norms else {}))
    expected = reference_attention(qkv, cos, sin, ref_keys, ref_values, positions, num_heads=num_heads,
                                   scaling=scaling, qk_norms=norms)
    assert torch.equal(keys, ref_keys) and torch.equal(values, ref_values)  # roped keys bitwise, nothing else moved
    torch.testing.assert_close(out, expected, rtol=2e-2, atol=2e-2)


def test_bad_inputs_are_refused_before_the_kernels_touch_memory():
    keys = torch.zeros(2, 1, 8, 4, dtype=BF16)
    qkv, cos = torch.zeros(2, 12, dtype=BF16), torch.zeros(2, 4, dtype=BF16)
    args = {"cos": cos, "sin": cos, "keys": keys, "values": keys.clone(), "num_heads": 1, "scaling": 0.5}
    with pytest.raises(ValueError, match="outside the cache's 8 columns"):
        cpu_kernels.attention(qkv, positions=torch.tensor([3, 8]), **args)
    with pytest.raises(ValueError, match="positions must be a contiguous torch.int64"):
        cpu_kernels.attention(qkv, positions=torch.tensor([3, 4], dtype=torch.int32), **args)
    with pytest.raises(ValueError, match="qkv must be"):
        cpu_kernels.attention(qkv.float(), positions=torch.tensor([3, 4]), **args)
    with pytest.raises(ValueError, match="q_norm and k_norm come together"):
        cpu_kernels.attention(qkv, positions=torch.tensor([3, 4]), q_norm=torch.ones(4, dtype=BF16), **args)
    with pytest.raises(ValueError, match="k_norm must be"):
        cpu_kernels.attention(qkv, positions=torch.tensor([3, 4]), q_norm=torch.ones(4, dtype=BF16),
                              k_norm=torch.ones(5, dtype=BF16), **args)
    with pytest.raises(ValueError, match="3 rows in a cache of 2 slots"):
        cpu_kernels.attention(torch.zeros(3, 12, dtype=BF16), positions=torch.tensor([1, 2, 3]), **args)
    with pytest.raises(ValueError, match="not contiguous"):
        cpu_kernels.rmsnorm(torch.zeros(4, 6, dtype=BF16)[:, :3], torch.ones(3, dtype=BF16), eps=1e-6)
    with pytest.raises(ValueError, match="norm weight must be"):
        cpu_kernels.rmsnorm(torch.zeros(4, 3, dtype=BF16), torch.ones(4, dtype=BF16), eps=1e-6)


def test_pack_lays_out_panels_of_16_rows_by_column_pairs():
    weight = randn(19, 7, seed=11)  # a partial panel and an odd column count: both zero-padded
    packed = cpu_kernels.pack(weight)
    assert (packed.out_features, packed.in_features) == (19, 7)
    padded = torch.zeros(32, 8, dtype=BF16)
    padded[:19, :7] = weight
    expected = padded.view(2, 16, 4, 2).permute(0, 2, 1, 3).reshape(-1)  # [panel, pair, row, 2]
    assert torch.equal(packed.data, expected)


@pytest.mark.skipif(not cpu_kernels.cpu_has_avx512_bf16(), reason="the GEMM needs a CPU with AVX512-BF16")
@pytest.mark.parametrize("rows,in_features,out_features,bias", [
    (1, 576, 37, False), (2, 100, 130, True), (5, 31, 37, True), (7, 64, 100, False), (13, 33, 64, True),
    (64, 96, 20, False)])
def test_the_gemm_is_a_bf16_linear_layer(rows, in_features, out_features, bias):
    # Row counts across the 6-row tiles and their tails, output widths across 1-4 panels of 16 and
    # a partial one, odd input widths (the last column alone).
    x, weight = randn(rows, in_features, seed=8), randn(out_features, in_features, seed=9)
    b = randn(out_features, seed=10) if bias else None
    exact = x.double() @ weight.double().T + (0 if b is None else b.double())
    out = cpu_kernels.linear(x, cpu_kernels.pack(weight), b)
    # fp32 sums of exact products, one rounding: within a bf16 rounding of the exact result.
    torch.testing.assert_close(out.double(), exact.to(BF16).double(), rtol=8e-3, atol=1e-6 * in_features)
    torch.testing.assert_close(out, torch.nn.functional.linear(x, weight, b))


@pytest.mark.skipif(not cpu_kernels.amx_available(), reason="the AMX GEMM needs a CPU with AMX (amx_bf16)")
@pytest.mark.parametrize("rows,in_features,out_features,bias", [
    (1, 576, 37, False), (15, 31, 16, True), (16, 32, 48, True), (17, 97, 20, False), (33, 1536, 130, True),
    (64, 576, 64, False), (70, 64, 33, True)])
def test_the_amx_gemm_is_the_avx512_gemm_on_tiles(rows, in_features, out_features, bias):
    # Rows across the 16-row tiles, the padding and the 32-row passes; input widths with no whole
    # 32-column block, exactly one, and a tail with an odd last column; 1-9 panels, pairs and a
    # partial last one. Both GEMMs called directly, over the same packed weights.
    library = cpu_kernels._library()
    x, weight = randn(rows, in_features, seed=18), randn(out_features, in_features, seed=19)
    b = randn(out_features, seed=20) if bias else None
    packed = cpu_kernels.pack(weight)
    outs = {}
    for name, threads in (("llamarl_gemm_amx_bf16", 1), ("llamarl_gemm_bf16", 1), ("llamarl_gemm_amx_bf16", 3)):
        outs[name, threads] = torch.full((rows, out_features), float("nan"), dtype=BF16)
        status = getattr(library, name)(x.data_ptr(), packed.data.data_ptr(), 0 if b is None else b.data_ptr(),
                                        outs[name, threads].data_ptr(), rows, out_features, in_features, threads)
        assert status == 0, (name, status)
    outs = {name: out for (name, threads), out in outs.items() if threads == 1} | {"3 threads": outs[
        "llamarl_gemm_amx_bf16", 3]}
    assert torch.equal(outs["3 threads"], outs["llamarl_gemm_amx_bf16"])  # panels split, sums unchanged
    exact = x.double() @ weight.double().T + (0 if b is None else b.double())
    amx = outs["llamarl_gemm_amx_bf16"]
    torch.testing.assert_close(amx.double(), exact.to(BF16).double(), rtol=8e-3, atol=1e-6 * in_features)
    torch.testing.assert_close(amx, outs["llamarl_gemm_bf16"])  # fp32 sums in another order
    torch.testing.assert_close(amx, torch.nn.functional.linear(x, weight, b))


@pytest.mark.skipif(not cpu_kernels.cpu_has_avx512_bf16(), reason="the GEMM needs a CPU with AVX512-BF16")
def test_the_gemm_gives_a_row_the_same_bits_in_any_batch():
    # Up to 4 rows the AVX512-BF16 GEMM takes its outputs one panel at a time (one stream of
    # weights), from 5 rows in tiles of 4 panels by 6 rows: each output's sum is the same chain in
    # both, so a row's result does not depend on the rows beside it, nor on the thread count.
    library = cpu_kernels._library()
    weight, bias, x = randn(100, 97, seed=30), randn(100, seed=31), randn(13, 97, seed=32)
    packed = cpu_kernels.pack(weight)

    def gemm(rows: torch.Tensor, threads: int) -> torch.Tensor:
        out = torch.full((rows.shape[0], 100), float("nan"), dtype=BF16)
        status = library.llamarl_gemm_bf16(rows.data_ptr(), packed.data.data_ptr(), bias.data_ptr(), out.data_ptr(),
                                           rows.shape[0], 100, 97, threads)
        assert status == 0
        return out

    whole = gemm(x, 1)
    torch.testing.assert_close(whole, torch.nn.functional.linear(x, weight, bias))
    untouched = torch.full((6, 100), float("nan"), dtype=BF16)  # no rows: nothing read or written
    assert library.llamarl_gemm_bf16(x.data_ptr(), packed.data.data_ptr(), 0, untouched.data_ptr(), 0, 100, 97, 2) == 0
    assert untouched.isnan().all()
    for m in range(1, 13):
        for start in (0, 13 - m):
            assert torch.equal(gemm(x[start : start + m].contiguous(), 1 + m % 3), whole[start : start + m]), m


def test_pack_all_packs_as_pack_does_into_one_allocation_from_a_huge_page_boundary():
    weights = [randn(19, 7, seed=40), randn(64, 576, seed=41), randn(37, 100, seed=42)]
    together = cpu_kernels.pack_all(weights)
    for weight, packed in zip(weights, together, strict=True):
        alone = cpu_kernels.pack(weight)
        assert (packed.out_features, packed.in_features) == (alone.out_features, alone.in_features)
        assert torch.equal(packed.data, alone.data)
    assert len({packed.data.untyped_storage().data_ptr() for packed in together}) == 1
    assert together[0].data.data_ptr() % cpu_kernels.HUGE_PAGE == 0
    for first, second in itertools.pairwise(together):  # one after another, in the order given
        assert second.data.data_ptr() == first.data.data_ptr() + 2 * first.data.numel()
    assert cpu_kernels.pack_all([]) == []
    with pytest.raises(ValueError, match=r"weight 1 must be a contiguous torch.bfloat16 CPU tensor"):
        cpu_kernels.pack_all([weights[0], weights[1].t()])


def _thp_eligible(address: int) -> bool | None:
    """Whether this process's mapping holding ``address`` may be backed by huge pages (smaps's
    ``THPeligible``; None where the kernel does not report it)."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0] if line else ""
        if "-" in head and not head.endswith(":"):
            start, end = (int(bound, 16) for bound in head.split("-"))
            inside = start <= address < end
        elif inside and head == "THPeligible:":
            return line.split()[1] == "1"
    return None


def test_pack_all_asks_for_huge_pages():
    mode = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    if not mode.exists() or "[never]" in mode.read_text() or not Path("/proc/self/smaps").exists():
        pytest.skip("transparent huge pages are off here (or no /proc/self/smaps to see them)")
    packed = cpu_kernels.pack_all([randn(4096, 576, seed=43)])  # 4.7 MB: two huge pages and a part
    eligible = _thp_eligible(packed[0].data.data_ptr())
    if eligible is None:
        pytest.skip("this kernel's smaps has no THPeligible field")
    assert eligible  # with THP "madvise" (the CI machines), only because pack_all advised it


def test_the_gemm_refuses_mismatched_inputs():
    packed = cpu_kernels.pack(randn(37, 64, seed=9))
    with pytest.raises(ValueError, match=r"x must be a contiguous torch.bfloat16 CPU tensor of shape \(2, 64\)"):
        cpu_kernels.linear(randn(2, 63, seed=1), packed)
    with pytest.raises(ValueError, match="rows >= 1"):
        cpu_kernels.linear(torch.zeros(0, 64, dtype=BF16), packed)
    with pytest.raises(ValueError, match=r"bias must be .* of shape \(37,\)"):
        cpu_kernels.linear(randn(2, 64, seed=1), packed, randn(36, seed=2))
    with pytest.raises(ValueError, match="weight must be"):
        cpu_kernels.pack(randn(37, 64, seed=9).t())


@pytest.mark.skipif(not cpu_kernels.cpu_has_avx512_bf16(), reason="the GEMM needs a CPU with AVX512-BF16")
def test_the_gemm_writes_a_reused_buffer():
    # Written in place, refused when its shape or dtype is not the result's.
    packed = cpu_kernels.pack(randn(37, 64, seed=9))
    x, buffer = randn(2, 64, seed=1), torch.zeros(2, 37, dtype=BF16)
    assert cpu_kernels.linear(x, packed, out=buffer) is buffer and torch.equal(buffer, cpu_kernels.linear(x, packed))
    with pytest.raises(ValueError, match=r"out must be a contiguous torch.bfloat16 CPU tensor of shape \(2, 37\)"):
        cpu_kernels.linear(x, packed, out=torch.zeros(2, 37))


def test_a_failed_build_is_an_error_naming_the_compiler_and_the_engine_falls_back(tmp_path, monkeypatch):
    with pytest.raises(RuntimeError, match="/bin/false failed on bf16_decode.c"):
        cpu_kernels.build(avx512_bf16=False, cache_dir=tmp_path, compiler="/bin/false")
    assert not list(tmp_path.iterdir())  # no partial library left behind
    monkeypatch.setenv("LLAMARL_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CC", "/bin/false")
    cpu_kernels._library.cache_clear()
    try:
        assert not cpu_kernels.available() and not cpu_kernels.gemm_available()
        model = build_family("llama-tied").to(BF16)
        assert not FusedDecoder(model)._native
    finally:
        cpu_kernels._library.cache_clear()


def two_paths_step_logits(model, *, native: bool, rows: int):
    """Prefill ``rows`` contexts of different lengths with the HF model, then two decode steps; the
    second step's logits and the state's lengths, with the C kernels on (helpers and GEMM) or off
    (PyTorch's ops and oneDNN's matmul)."""
    tok = chat_tokenizer()
    contexts = [tuple(tok(f"Write {i} words about the number {i * 37}.")["input_ids"][: 6 + 3 * i]) for i in range(rows)]
    engine = TorchEngine(model, eos_token_ids=[], pad_token_id=tok.pad_token_id)
    decoder = FusedDecoder(model)
    assert decoder._native  # bf16 on the CPU, RMSNorm and SiLU: the helpers apply
    decoder._native = native
    if not native:
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(cpu_kernels, "gemm_available", lambda: False)
            decoder._layers()  # the projections built now keep PyTorch's matmul
        assert not decoder._head.gemm
    state = decoder.new_state(capacity=rows, like=model.model.embed_tokens.weight)
    _, cache, _ = engine._prefill(contexts)
    load_rows(state, keys=[layer.keys for layer in cache.layers], values=[layer.values for layer in cache.layers],
              lengths=[len(c) for c in contexts], left_padded=True)
    tokens = torch.arange(rows) * 101 + 7
    step_rows(decoder, state, tokens)
    return step_rows(decoder, state, tokens + 1).float(), state.positions[:rows].tolist()


@pytest.mark.parametrize("family", ["llama-tied", "qwen2", "qwen3", "mistral"])
def test_decode_steps_through_the_helpers_match_the_pytorch_steps(family, monkeypatch):
    model = build_family(family).to(BF16)
    calls = []
    native_step = FusedDecoder._step_native
    monkeypatch.setattr(FusedDecoder, "_step_native", lambda self, *a, **k: calls.append(1) or native_step(self, *a, **k))
    torch.set_num_threads(1)
    for rows in (1, 3):
        with torch.no_grad():
            native, lengths = two_paths_step_logits(model, native=True, rows=rows)
            assert len(calls) == 2
            plain, plain_lengths = two_paths_step_logits(model, native=False, rows=rows)
            assert len(calls) == 2 and lengths == plain_lengths
        # Two bf16 implementations of the same layers: their logits agree to bf16 rounding noise.
        spread = plain.abs().max().item()
        assert (native - plain).abs().max().item() < 0.05 * spread, family
        assert (native.argmax(-1) == plain.argmax(-1)).float().mean() >= 0.5
        calls.clear()


def test_with_more_threads_the_helpers_run_only_small_batches_unless_threaded(monkeypatch):
    model = build_family("llama-tied").to(BF16)
    decoder = FusedDecoder(model)
    calls = []
    monkeypatch.setattr(FusedDecoder, "_step_native", lambda self, state, tokens, *a, **k: calls.append(len(tokens)))
    threads = torch.get_num_threads()
    try:
        # A library without OpenMP runs on one thread: with two, only up to THREADED_ROWS rows; built
        # with it (the kernels split their work), any row count.
        for split, num_threads, rows, native in (
                (False, 2, cpu_kernels.THREADED_ROWS, True), (False, 2, cpu_kernels.THREADED_ROWS + 1, False),
                (False, 1, cpu_kernels.THREADED_ROWS + 1, True), (True, 2, 64, True)):
            monkeypatch.setattr(cpu_kernels, "threaded", lambda split=split: split)
            torch.set_num_threads(num_threads)
            calls.clear()
            state = decoder.new_state(capacity=rows, like=model.model.embed_tokens.weight)
            load_rows(state, keys=[torch.zeros(rows, 2, 1, 16, dtype=BF16)] * 2,
                      values=[torch.zeros(rows, 2, 1, 16, dtype=BF16)] * 2, lengths=[1] * rows, left_padded=False)
            with torch.no_grad():
                step_rows(decoder, state, torch.zeros(rows, dtype=torch.long))
            assert calls == ([rows] if native else []), (num_threads, rows)
    finally:
        torch.set_num_threads(threads)


def test_the_portable_build_computes_the_same(tmp_path, monkeypatch):
    """The library as built for a CPU without AVX512-BF16 (plain C loops, no GEMV): the helpers
    still match the PyTorch ops, so CI on such a machine runs what is tested here."""
    portable = cpu_kernels.load(cpu_kernels.build(avx512_bf16=False, cache_dir=tmp_path))
    assert portable.llamarl_has_gemm() == 0
    monkeypatch.setattr(cpu_kernels, "_library", lambda: portable)
    assert cpu_kernels.available() and not cpu_kernels.gemm_available()
    test_rmsnorm_and_the_residual_add_match_hfs_bf16_norm()
    test_swiglu_matches_silu_times_up_bitwise()
    for shape in ((4, 2, 16), (9, 3, 64)):
        for qk_norms in (False, True):
            test_attention_writes_the_cache_and_attends_like_hfs_eager_attention(*shape, qk_norms)
    test_the_softmax_is_pytorchs_to_float_rounding()
    test_the_c_draw_is_the_inverse_cdf_over_its_blocks()
    with pytest.raises(RuntimeError, match="needs a CPU with AVX512-BF16"):
        cpu_kernels.linear(randn(1, 8, seed=0), cpu_kernels.pack(randn(4, 8, seed=1)))


def test_projections_take_the_gemm_on_one_thread_or_for_few_rows(monkeypatch):
    from llamarl.engines.cpu.fused_decode import _Linear

    weight, bias = randn(40, 24, seed=3), randn(40, seed=4)
    calls = []
    gemm = cpu_kernels.linear
    monkeypatch.setattr(cpu_kernels, "linear", lambda x, *a, **k: calls.append(x.shape[0]) or gemm(x, *a, **k))
    monkeypatch.setattr(cpu_kernels, "gemm_available", lambda: True)  # the dispatch, on any CPU
    projection = _Linear([weight[:16], weight[16:]], [bias[:16], bias[16:]])
    assert projection.kernel is None and projection._onednn is None  # packed on first use only
    threads = torch.get_num_threads()
    has_gemm = cpu_kernels.cpu_has_avx512_bf16()
    no_amx, amx = frozenset({"avx512_bf16"}), frozenset({"avx512_bf16", "amx_bf16"})
    try:
        # One thread, or more with a library built with OpenMP: any row count (with the AMX GEMM on
        # an AMX CPU), but on an AMX CPU whose library lacks the AMX GEMM (where oneDNN's matmul
        # runs on the tiles) only up to GEMM_AMX_ROWS; more threads without OpenMP: up to
        # GEMM_THREADED_ROWS.
        for flags, amx_gemm, split, num_threads, rows, used in (
                (no_amx, False, False, 1, 64, True), (amx, True, False, 1, 64, True),
                (amx, False, False, 1, cpu_kernels.GEMM_AMX_ROWS, True),
                (amx, False, True, 2, cpu_kernels.GEMM_AMX_ROWS + 1, False),
                (no_amx, False, False, 2, cpu_kernels.GEMM_THREADED_ROWS, True),
                (amx, True, False, 2, cpu_kernels.GEMM_THREADED_ROWS + 1, False),
                (amx, True, True, 2, 64, True), (no_amx, False, True, 2, 64, True)):
            monkeypatch.setattr(cpu_kernels, "cpu_flags", lambda flags=flags: flags)
            monkeypatch.setattr(cpu_kernels, "threaded", lambda split=split: split)
            # The dispatch only: linear runs whichever GEMM the library here has.
            monkeypatch.setattr(cpu_kernels, "amx_available", lambda amx_gemm=amx_gemm: amx_gemm)
            torch.set_num_threads(num_threads)
            calls.clear()
            x = randn(rows, 24, seed=rows)
            if used and not has_gemm:
                continue  # the library here has no GEMM to call
            out = projection(x)
            assert calls == ([rows] if used else []), (num_threads, rows)
            torch.testing.assert_close(out, torch.nn.functional.linear(x, weight, bias))
    finally:
        torch.set_num_threads(threads)
    # Without the GEMM: oneDNN pre-packed from two rows, PyTorch's plain matmul for one bf16 row
    # (oneDNN's one-row bf16 path is pathologically slow on some weights: fused_decode._Linear).
    monkeypatch.setattr(cpu_kernels, "gemm_available", lambda: False)
    plain = _Linear([weight], [bias])
    x = randn(1, 24, seed=5)
    assert not plain.gemm and torch.equal(plain(x), torch.nn.functional.linear(x, weight, bias))
    assert plain.kernel is None
    assert plain._onednn is None
    plain(randn(3, 24, seed=6))
    assert plain._onednn is not None or not torch.backends.mkldnn.is_available()


def test_a_packed_weight_must_match_its_features():
    with pytest.raises(ValueError, match=r"packed data must be .* of shape \(64,\)"):
        cpu_kernels.PackedWeight(data=torch.zeros(32, dtype=BF16), out_features=2, in_features=3)
    with pytest.raises(ValueError, match="packed data must be a contiguous torch.bfloat16"):
        cpu_kernels.PackedWeight(data=torch.zeros(64), out_features=2, in_features=3)
    with pytest.raises(ValueError, match="features must be >= 1"):
        cpu_kernels.PackedWeight(data=torch.zeros(0, dtype=BF16), out_features=0, in_features=3)


@pytest.mark.skipif(not cpu_kernels.cpu_has_avx512_bf16(), reason="the GEMM needs a CPU with AVX512-BF16")
def test_an_in_place_update_reaches_the_packed_weights(monkeypatch):
    """The GEMM reads packed copies: an in-place write into any projection (o, down, the tied LM
    head: copies now, read live before) must reach the next generate, as a fresh engine sees it."""
    from llamarl.engines.base import Request, SamplingParams

    tok = chat_tokenizer()
    model = build_family("llama-tied").to(BF16)
    packed = []
    pack, pack_all = cpu_kernels.pack, cpu_kernels.pack_all
    monkeypatch.setattr(cpu_kernels, "pack", lambda w: packed.append(w.shape) or pack(w))
    monkeypatch.setattr(cpu_kernels, "pack_all", lambda ws: packed.extend(w.shape for w in ws) or pack_all(ws))
    requests = [Request(sample_id=i, prompt_ids=tok(f"Count to {i + 3}.")["input_ids"]) for i in range(3)]
    greedy = SamplingParams(temperature=0.0, max_new_tokens=8)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        engine = TorchEngine(model, eos_token_ids=[], pad_token_id=tok.pad_token_id)
        before = [c.completion_ids for c in engine.generate(requests, sampling=greedy, version=0)]
        assert len(packed) == 4 * len(model.model.layers) + 1  # every projection went through the GEMM
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.o_proj.weight.mul_(-1.0)
                layer.mlp.down_proj.weight.copy_(layer.mlp.down_proj.weight.flip(0))
            model.lm_head.weight.mul_(0.5)
        after = [c.completion_ids for c in engine.generate(requests, sampling=greedy, version=1)]
        fresh = TorchEngine(model, eos_token_ids=[], pad_token_id=tok.pad_token_id)
        assert after == [c.completion_ids for c in fresh.generate(requests, sampling=greedy, version=1)]
        assert after != before
    finally:
        torch.set_num_threads(threads)


def test_without_the_amx_build_the_avx512_kernels_still_run(monkeypatch, caplog):
    """A compiler without -mamx-bf16 on an AMX CPU: the library is built again without the AMX
    GEMM (logged), and the projections keep oneDNN above GEMM_AMX_ROWS rows (gemm_max_rows)."""
    build = cpu_kernels.build

    def no_amx(*, avx512_bf16, amx=False, **kwargs):
        if amx:
            raise RuntimeError("cc failed on bf16_decode.c: unrecognized command-line option '-mamx-bf16'")
        return build(avx512_bf16=avx512_bf16, **kwargs)

    monkeypatch.setattr(cpu_kernels, "build", no_amx)
    monkeypatch.setattr(cpu_kernels, "cpu_flags", lambda: frozenset({"avx512_bf16", "amx_bf16"}))
    with caplog.at_level("WARNING", logger="llamarl.engines.cpu.cpu_kernels"):
        library = cpu_kernels._library.__wrapped__()
    assert library is not None and not library.amx_ready
    assert "built without the AMX GEMM (" in caplog.text and "-mamx-bf16" in caplog.text
    monkeypatch.setattr(cpu_kernels, "_library", lambda: library)
    assert not cpu_kernels.amx_available() and cpu_kernels.gemm_max_rows(1) == cpu_kernels.GEMM_AMX_ROWS


def test_without_openmp_the_kernels_run_on_the_calling_thread(monkeypatch, caplog):
    """A compiler without OpenMP: the library is built again without it (logged); it ignores the
    thread counts, and the decoder keeps PyTorch's ops above THREADED_ROWS rows on more threads."""
    build = cpu_kernels.build

    def no_openmp(*, avx512_bf16, amx=False, openmp=True, **kwargs):
        if openmp:
            raise RuntimeError("cc failed on bf16_decode.c: unrecognized command-line option '-fopenmp'")
        return build(avx512_bf16=avx512_bf16, amx=amx, openmp=False, **kwargs)

    monkeypatch.setattr(cpu_kernels, "build", no_openmp)
    with caplog.at_level("WARNING", logger="llamarl.engines.cpu.cpu_kernels"):
        library = cpu_kernels._library.__wrapped__()
    assert library is not None and not library.threaded and library.llamarl_parallel_width(4) == 1
    assert "built without OpenMP threads (" in caplog.text and "-fopenmp" in caplog.text
    assert library.amx_ready == cpu_kernels.amx_available()  # only OpenMP was dropped
    monkeypatch.setattr(cpu_kernels, "_library", lambda: library)
    assert cpu_kernels.helpers_max_rows(2) == cpu_kernels.THREADED_ROWS and cpu_kernels.helpers_max_rows(1) is None
    x, weight = randn(5, 64, seed=30), randn(40, 64, seed=31)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(3)
        out = cpu_kernels.linear(x, cpu_kernels.pack(weight)) if cpu_kernels.gemm_available() else None
    finally:
        torch.set_num_threads(threads)
    if out is not None:
        torch.testing.assert_close(out, torch.nn.functional.linear(x, weight))


@pytest.mark.skipif(not cpu_kernels.threaded(), reason="the library was built without OpenMP (no compiler support)")
def test_the_kernels_split_across_threads_and_compute_the_same_bits():
    """Each kernel on 1 and on 3 threads (an uneven split, over 2 cores): the same bits, since the
    split is over outputs and rows, never inside a sum; and a region asking for 3 threads gets 3."""
    library = cpu_kernels._library()
    assert library.llamarl_parallel_width(3) == 3 and library.llamarl_parallel_width(1) == 1
    rows, dim, heads, kv_heads, head_dim, width = 7, 640, 6, 2, 16, 12  # 7 x 640 norms: over PARALLEL_ELEMENTS
    qkv = randn(rows, (heads + 2 * kv_heads) * head_dim, seed=40)
    cos, sin = randn(rows, head_dim, seed=41), randn(rows, head_dim, seed=42)
    positions = torch.tensor([0, 3, 11, 5, 2, 7, 1])
    hidden, delta, norm = randn(rows, dim, seed=43), randn(rows, dim, seed=44), randn(dim, seed=45)
    gate_up, logits = randn(rows, 2 * 700, seed=46), randn(rows, 1000, seed=47)
    weight = cpu_kernels.pack(randn(130, dim, seed=48))
    results = {}
    threads = torch.get_num_threads()
    try:
        for num_threads in (1, 3):
            torch.set_num_threads(num_threads)
            keys = randn(rows, kv_heads, width, head_dim, seed=49)
            values = randn(rows, kv_heads, width, head_dim, seed=50)
            h = hidden.clone()
            results[num_threads] = [
                cpu_kernels.attention(qkv, cos=cos, sin=sin, keys=keys, values=values, positions=positions,
                                      num_heads=heads, scaling=0.25), keys, values,
                cpu_kernels.add_rmsnorm(h, delta, norm, eps=1e-5), h, cpu_kernels.rmsnorm(hidden, norm, eps=1e-5),
                cpu_kernels.silu_mul(gate_up), cpu_kernels.softmax(logits)]
            if cpu_kernels.gemm_available():
                results[num_threads].append(cpu_kernels.linear(randn(rows, dim, seed=51), weight))
    finally:
        torch.set_num_threads(threads)
    for one, three in zip(results[1], results[3], strict=True):
        assert torch.equal(one, three)


def test_the_softmax_is_pytorchs_to_float_rounding():
    # A vocabulary that is not a multiple of 16 (the scalar tail), a masked (-inf) logit, a row with
    # a NaN and a row of -inf (both NaN throughout, as PyTorch's), logits far below the max.
    logits = randn(6, 1000 + 7, seed=30, scale=8.0)
    logits[5, 999] = float("inf")
    logits[1, 3] = float("-inf")
    logits[2, 900:] = -200.0
    logits[3, 17] = float("nan")
    logits[4] = float("-inf")
    out = torch.full(logits.shape, 7.0)
    probs = cpu_kernels.softmax(logits, out=out)
    expected = torch.softmax(logits, dim=-1, dtype=torch.float32)
    assert probs.data_ptr() == out.data_ptr()
    torch.testing.assert_close(probs[:3], expected[:3], rtol=1e-5, atol=1e-30)
    assert probs[1, 3] == 0 and probs[3].isnan().all() and probs[4].isnan().all() and probs[5].isnan().all()
    assert expected[3:].isnan().all()  # PyTorch's rows, the same
    torch.testing.assert_close(probs[:3].double().sum(-1), torch.ones(3, dtype=torch.float64), rtol=0, atol=1e-5)
    with pytest.raises(ValueError, match=r"out must be a contiguous torch.float32 CPU tensor of shape \(6, 1007\)"):
        cpu_kernels.softmax(logits, out=torch.empty(6, 1006))


def test_the_sampler_draws_in_c_in_bf16(monkeypatch):
    from llamarl.engines import sampling
    from llamarl.engines.base import SamplingParams
    from llamarl.engines.cpu import sampling as cpu_sampling

    calls = []
    sample = cpu_kernels.sample
    monkeypatch.setattr(cpu_kernels, "sample", lambda x, u: calls.append(x.shape) or sample(x, u))
    logits = randn(4, 300, seed=31, scale=3.0)
    uniforms = torch.rand(4, generator=torch.Generator().manual_seed(32), dtype=torch.float64)
    params = SamplingParams(temperature=1.0)
    tokens, logprobs = cpu_sampling.sample_tokens_cpu(logits, sampling=params, uniforms=uniforms)
    assert calls == [(4, 300)]
    expected = torch.softmax(logits, dim=-1, dtype=torch.float32)
    # The same inverse-CDF draw as over PyTorch's probabilities (no uniform this close to an edge).
    assert torch.equal(tokens, sampling._draw(expected, uniforms))
    torch.testing.assert_close(logprobs, expected.gather(-1, tokens[:, None]).squeeze(-1).log(), rtol=0, atol=1e-5)
    # The general sampler: no C, the same tokens and log-probs (PyTorch's softmax and draw).
    general = sampling.sample_tokens(logits, sampling=params, uniforms=uniforms)
    assert calls == [(4, 300)] and torch.equal(general[0], tokens)
    torch.testing.assert_close(general[1], logprobs, rtol=0, atol=1e-5)
    fp32 = cpu_sampling.sample_tokens_cpu(logits.float(), sampling=params, uniforms=uniforms)
    assert calls == [(4, 300)] and torch.equal(fp32[0], tokens)  # fp32 logits: PyTorch's softmax and draw
    # Without uniforms: one per row from the generator, as the general sampler draws them.
    seeded = [fn(logits, sampling=params, generator=torch.Generator().manual_seed(5))
              for fn in (cpu_sampling.sample_tokens_cpu, sampling.sample_tokens)]
    assert calls == [(4, 300)] * 2 and torch.equal(seeded[0][0], seeded[1][0])
    # Filtered, another temperature, greedy: the general sampler's results, bit for bit, no C draw.
    for other in (SamplingParams(temperature=1.0, top_k=20), SamplingParams(temperature=0.7),
                  SamplingParams(temperature=0.0)):
        ours = cpu_sampling.sample_tokens_cpu(logits, sampling=other, uniforms=uniforms)
        theirs = sampling.sample_tokens(logits, sampling=other, uniforms=uniforms)
        assert torch.equal(ours[0], theirs[0]) and torch.equal(ours[1], theirs[1])
    assert calls == [(4, 300)] * 2
    # A vocabulary over the C draw's limit (sample gives None): the general draw over the C softmax.
    monkeypatch.setattr(cpu_kernels, "sample", lambda x, u: None)
    softmaxed = []
    softmax = cpu_kernels.softmax
    monkeypatch.setattr(cpu_kernels, "softmax", lambda x, **k: softmaxed.append(x.shape) or softmax(x, **k))
    fallback = cpu_sampling.sample_tokens_cpu(logits, sampling=params, uniforms=uniforms)
    assert softmaxed == [(4, 300)] and torch.equal(fallback[0], tokens)
    monkeypatch.setattr(cpu_kernels, "softmax", softmax)
    # The buffer is reused from call to call up to _SCRATCH_MAX probabilities, a new tensor beyond.
    first, second = cpu_sampling._softmax(logits), cpu_sampling._softmax(logits[:2])
    assert first.data_ptr() == second.data_ptr()
    monkeypatch.setattr(cpu_sampling, "_SCRATCH_MAX", 100)
    third = cpu_sampling._softmax(logits)
    assert third.data_ptr() != first.data_ptr() and torch.equal(third, cpu_kernels.softmax(logits))


@pytest.mark.skipif(not cpu_kernels.threaded(), reason="the library was built without OpenMP (no compiler support)")
def test_an_openmp_runtime_without_a_team_leaves_the_kernels_on_one_thread():
    """The check ``load`` makes before it lets the kernels split their work: OMP_THREAD_LIMIT=1 (as a
    runtime other than PyTorch's libgomp would) gives no team of two, so they run on one thread."""
    import os
    import subprocess
    import sys

    code = ("import logging; logging.basicConfig(); from llamarl.engines.cpu import cpu_kernels as c; "
            "print(c.available(), c.threaded(), c._threads())")
    done = subprocess.run([sys.executable, "-c", code], env={**os.environ, "OMP_THREAD_LIMIT": "1"},
                          capture_output=True, text=True, timeout=300, check=False)
    assert done.stdout.split() == ["True", "False", "1"], done.stdout + done.stderr
    assert "gave no team of 2 threads" in done.stderr


def test_the_c_draw_is_the_inverse_cdf_over_its_blocks():
    """cpu_kernels.sample against sampling._draw over PyTorch's softmax: a vocabulary across several
    256-blocks with a partial last one, uniforms at 0 and just below 1 (the first and the last token
    with probability), -inf (filtered) logits never drawn even at their intervals' edges, and rows
    with a NaN / +inf logit or only -inf ones (refused, naming the rows: PyTorch's softmax is NaN)."""
    vocab = 1000
    logits = randn(6, vocab, seed=60, scale=2.0)
    logits[:, :5] = float("-inf")  # the first tokens filtered out: u = 0 must land past them
    logits[:, -7:] = float("-inf")  # and the last ones: u -> 1 must stop before them
    logits[1, 256:512] = float("-inf")  # a whole block without probability
    uniforms = torch.tensor([0.0, 0.3, 0.5, 1.0 - 2.0**-52, 0.999, 0.25], dtype=torch.float64)
    tokens, logprobs = cpu_kernels.sample(logits, uniforms)
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    assert torch.equal(tokens, sampling_draw(probs, uniforms))
    assert tokens[0] == 5 and tokens[3] == vocab - 8 and not (256 <= tokens[1] < 512)
    assert bool((probs.gather(1, tokens[:, None]) > 0).all())
    torch.testing.assert_close(logprobs, probs.gather(1, tokens[:, None]).squeeze(1).log(), rtol=0, atol=1e-5)
    broken = logits[:3].clone()
    broken[0, 7], broken[1, 9], broken[2] = float("nan"), float("inf"), float("-inf")
    with pytest.raises(ValueError, match=r"logits rows \[0, 1, 2\] hold a NaN or \+inf"):
        cpu_kernels.sample(broken, uniforms[:3])
    with pytest.raises(ValueError, match=r"logits rows \[1\] hold"):  # one bad row among good ones
        cpu_kernels.sample(torch.cat([logits[:1], broken[:1]]), uniforms[:2])
    with pytest.raises(ValueError, match="uniforms must be a contiguous torch.float64"):
        cpu_kernels.sample(logits, uniforms.float())


def sampling_draw(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    from llamarl.engines import sampling

    return sampling._draw(probs, uniforms)
