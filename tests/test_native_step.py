"""The whole-step C call (llamarl/engines/cpu/native_step.py, csrc/decode_step.c) against the same step
kernel by kernel: the same bits for bf16 Llama (tied) / Qwen2 (q/k/v biases) / Qwen3 (q/k norms) / Mistral layouts, on
one and three threads, at row counts below, at and past the AMX tiles' 16 rows, across a widening
of the caches and a weight update; and the inputs it refuses."""

from __future__ import annotations

import pytest
import torch
from model_families import build_family, chat_tokenizer
from slot_steps import load_rows, step_rows

from llamarl.engines.base import Request, SamplingParams
from llamarl.engines.cpu import cpu_kernels, native_step
from llamarl.engines.cpu.fused_decode import FusedDecoder
from llamarl.engines.torch_engine import TorchEngine

BF16 = torch.bfloat16
pytestmark = pytest.mark.skipif(not native_step.available(),
                                reason="the one-call step needs the C GEMM (a CPU with AVX512-BF16)")


def generate(model, *, one_call: bool, rows: int, max_new_tokens: int, calls: list) -> list:
    tok = chat_tokenizer()
    engine = TorchEngine(model, eos_token_ids=[], pad_token_id=tok.pad_token_id)
    engine._fused = FusedDecoder(model)
    engine._fused.one_call = one_call
    requests = [Request(sample_id=i, prompt_ids=tuple(tok(f"Count {i} apples and {3 * i} pears.")["input_ids"]
                                                      [: 5 + (7 * i) % 11]))
                for i in range(rows)]
    calls.clear()
    completions = engine.generate(requests, sampling=SamplingParams(max_new_tokens=max_new_tokens, temperature=1.0),
                                  version=0, generator=torch.Generator().manual_seed(rows))
    return [(c.completion_ids, c.logprobs) for c in completions]


@pytest.mark.parametrize("family", ["llama-tied", "qwen2", "qwen3", "mistral"])
@pytest.mark.parametrize("amx", [True, False], ids=["amx-if-here", "avx512"])
def test_one_call_is_the_kernel_by_kernel_step_bit_for_bit(family, amx, monkeypatch):
    model = build_family(family).to(BF16)
    library = cpu_kernels._library()
    monkeypatch.setattr(library, "amx_ready", library.amx_ready and amx)  # both paths take the same GEMM
    if not amx:  # as on a CPU without AMX, where the AVX512-BF16 GEMM takes any row count
        flags = cpu_kernels.cpu_flags() - {"amx_bf16"}
        monkeypatch.setattr(cpu_kernels, "cpu_flags", lambda: flags)
    calls, widths = [], []
    decode_layers = native_step.decode_layers
    monkeypatch.setattr(native_step, "decode_layers", lambda *a, **k: calls.append(1) or decode_layers(*a, **k))
    tables = native_step.LayerTables

    class Recorded(tables):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            widths.append(self.width)

    monkeypatch.setattr(native_step, "LayerTables", Recorded)
    # The caches sized step by step, not once for the whole decode (FusedDecoder.new_state's
    # `positions`): they widen during it, as when a longer request is admitted mid-decode.
    new_state = FusedDecoder.new_state
    monkeypatch.setattr(FusedDecoder, "new_state", lambda self, *, capacity, like=None, positions=0: new_state(
        self, capacity=capacity, like=like))
    threads = torch.get_num_threads()
    try:
        for num_threads, rows in ((2, 3), (3, 17), (1, 16)):  # 3 rows: the GEMM's one-panel stream
            torch.set_num_threads(num_threads)
            widths.clear()
            # 80 new tokens: the caches widen during the decode (KVSlots.grow), new tables.
            one = generate(model, one_call=True, rows=rows, max_new_tokens=80, calls=calls)
            assert len(calls) == 79, (num_threads, rows, len(calls))  # every decode step, the first is prefill
            assert len(set(widths)) >= 2, widths
            assert generate(model, one_call=False, rows=rows, max_new_tokens=80, calls=calls) == one and not calls
    finally:
        torch.set_num_threads(threads)


def two_steps_across_a_weight_update(*, one_call: bool) -> tuple[torch.Tensor, bool]:
    """Two decode steps of one state, a weight written in place between them: the second step's
    logits, and whether the one-call tables were rebuilt for it (Mistral: no biases, whose fused
    copies would change the table's addresses anyway)."""
    model = build_family("mistral").to(BF16)
    tok = chat_tokenizer()
    engine = TorchEngine(model, eos_token_ids=[], pad_token_id=tok.pad_token_id)
    decoder = FusedDecoder(model)
    decoder.one_call = one_call
    contexts = [tuple(tok(f"Tell me about {word}.")["input_ids"]) for word in ("cats", "the moon and tides")]
    state = decoder.new_state(capacity=2, like=model.model.embed_tokens.weight)
    _, cache, _ = engine._prefill(contexts)
    load_rows(state, keys=[layer.keys for layer in cache.layers], values=[layer.values for layer in cache.layers],
              lengths=[len(c) for c in contexts], left_padded=True)
    tokens = torch.tensor([11, 12])
    with torch.no_grad():
        step_rows(decoder, state, tokens)
        before = state.native_tables
        model.model.layers[0].mlp.down_proj.weight.mul_(-3.0)  # in place: the same tensor, a new version
        logits = step_rows(decoder, state, tokens + 1).clone()
    return logits, before is not None and state.native_tables[1] is not before[1]


def test_the_tables_follow_a_weight_update_within_a_decode():
    logits, rebuilt = two_steps_across_a_weight_update(one_call=True)
    reference, _ = two_steps_across_a_weight_update(one_call=False)
    assert rebuilt and torch.equal(logits, reference)


def test_bad_inputs_are_refused_before_the_step_runs():
    model = build_family("llama-tied").to(BF16)
    decoder = FusedDecoder(model)
    rows = 2
    state = decoder.new_state(capacity=rows, like=model.model.embed_tokens.weight)
    config = model.config
    kv, d = decoder.num_kv_heads, decoder.head_dim
    load_rows(state, keys=[torch.zeros(rows, kv, 3, d, dtype=BF16)] * config.num_hidden_layers,
              values=[torch.zeros(rows, kv, 3, d, dtype=BF16)] * config.num_hidden_layers, lengths=[3, 3],
              left_padded=False)
    fused = decoder._layers()
    tables = decoder._layer_tables(fused, state)
    decoder._buffers(rows, fused[0], like=model.model.embed_tokens.weight)
    buffers = {name: decoder._workspace[name] for name in ("x", "delta", "qkv", "attended", "gate_up", "act")}
    hidden = torch.randn(rows, config.hidden_size).to(BF16)
    snapshot = hidden.clone()
    good = {"hidden": hidden, "buffers": buffers, "cos": torch.ones(rows, d, dtype=BF16),
            "sin": torch.zeros(rows, d, dtype=BF16), "positions": torch.tensor([3, 1]),
            "final_norm": model.model.norm.weight, "eps": 1e-5, "scaling": 0.125, "scratch": torch.empty(4096)}
    with pytest.raises(ValueError, match=rf"a position in \[3, {tables.width}\] is outside the caches' {tables.width} "):
        native_step.decode_layers(tables, **{**good, "positions": torch.tensor([3, tables.width])})
    with pytest.raises(ValueError, match="buffer act has shape"):
        native_step.decode_layers(tables, **{**good, "buffers": {**buffers, "act": buffers["act"][:1]}})
    with pytest.raises(ValueError, match="3 rows for caches of 2 slots"):
        native_step.decode_layers(tables, **{**good, "hidden": torch.zeros(3, config.hidden_size, dtype=BF16)})
    with pytest.raises(ValueError, match="scratch must be a contiguous fp32"):
        native_step.decode_layers(tables, **{**good, "scratch": torch.empty(4)})
    with pytest.raises(ValueError, match="positions must be a contiguous torch.int64"):
        native_step.decode_layers(tables, **{**good, "positions": torch.tensor([3, 1], dtype=torch.int32)})
    assert torch.equal(hidden, snapshot)  # nothing ran
    with pytest.raises(ValueError, match="layer 1's keys must be"):
        native_step.LayerTables(shape=tables.shape, projections=tables.held[0], norms=tables.held[1],
                                keys=[state.keys[0], state.keys[1][:, :, :1]] + state.keys[2:], values=state.values)
    with pytest.raises(ValueError, match="layer 0's o projection is"):
        wrong = [list(layer) for layer in tables.held[0]]
        wrong[0][1] = wrong[0][0]
        native_step.LayerTables(shape=tables.shape, projections=wrong, norms=tables.held[1], keys=state.keys,
                                values=state.values)
    native_step.decode_layers(tables, **good)  # the good inputs run
    assert not torch.equal(hidden, snapshot)


def test_without_a_gemm_the_step_runs_kernel_by_kernel(monkeypatch):
    model = build_family("llama-tied").to(BF16)
    monkeypatch.setattr(cpu_kernels, "gemm_available", lambda: False)
    decoder = FusedDecoder(model)
    assert decoder.one_call and not decoder._in_one_call(decoder._layers(), 4)
