"""Activations counted (llamarl/models/memory.py) and bounded (per-layer checkpointing in
llamarl/models/sharding.py): the fake-tensor count against what a real CPU forward keeps, the
``auto`` decision, and checkpointed FSDP2 models with the same names, log-probs and gradients."""

import ctypes
import gc
import json

import pytest
import torch
from launch import check, run_torchrun
from tiny_model import build_tiny_llama

from llamarl.models import memory
from llamarl.models.memory import (
    activation_checkpointing_for,
    resolve_activation_checkpointing,
    saved_activation_bytes,
)
from llamarl.models.sharding import checkpoint_layers


class _Mallinfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                    "fsmblks", "uordblks", "fordblks", "keepcost")]


def _malloc_in_use() -> int:
    """Bytes glibc's malloc has handed out and not taken back (heap + mmapped blocks): where torch's
    CPU allocator gets every tensor's storage."""
    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = _Mallinfo2
    info = libc.mallinfo2()
    return info.uordblks + info.hblkhd


def _held_by_the_graph(model, inputs) -> int:
    """What a real training forward keeps alive until its backward: the bytes in use after a
    forward with autograd minus after the same forward without (the output is alive in both)."""
    def after(grad: bool) -> int:
        before = _malloc_in_use()
        with torch.set_grad_enabled(grad):
            out = model(**inputs).logits  # noqa: F841 - alive while measuring
        return _malloc_in_use() - before

    after(True)  # first-call caches (the kernels' scratch, RoPE) out of the measurement
    # No collection in between (a full one takes 0.2 s here): what is freed, is freed by refcount.
    gc.collect()
    gc.disable()
    try:
        return after(True) - after(False)
    finally:
        gc.enable()


def test_count_within_10_percent_of_what_a_real_cpu_forward_keeps():
    """The reference is the real thing, measured independently of the count: a real fp32 forward of
    a 4-layer model on the CPU, packed rows behind a 4D mask as the trainer calls it, and the growth
    of glibc's in-use bytes (``mallinfo2``) that autograd's graph holds once the forward returns,
    i.e. exactly what a backward frees. The count runs on fake tensors and never touches that
    memory. Both with and without per-layer checkpointing (then only each layer's input is kept),
    within 10 %; a count that kept parameters, missed the attention mask's per-layer copy or counted
    a shared storage twice would be tens of percent off."""
    try:
        _malloc_in_use()
    except (OSError, AttributeError):
        pytest.skip("needs glibc's mallinfo2 to measure the real bytes")
    model = build_tiny_llama(seed=0, hidden_size=128, intermediate_size=256, num_layers=4,
                             max_position_embeddings=1024).train()
    rows, width = 2, 512
    inputs = {"input_ids": torch.randint(3, 100, (rows, width), generator=torch.Generator().manual_seed(0)),
              "attention_mask": torch.ones(rows, 1, width, width, dtype=torch.bool).tril(),
              "position_ids": torch.arange(width).expand(rows, -1), "use_cache": False, "logits_to_keep": 1}
    count = saved_activation_bytes(model, tokens=rows * width, row_tokens=width)
    real = _held_by_the_graph(model, inputs)
    assert count.kept(False) == pytest.approx(real, rel=0.10), (count, real)
    checkpoint_layers(model)
    real_checkpointed = _held_by_the_graph(model, inputs)
    assert count.kept(True) == pytest.approx(real_checkpointed, rel=0.10), (count, real_checkpointed)
    assert real_checkpointed < real / 5  # what checkpointing is for


def test_parameters_are_not_activations_and_shared_storages_count_once():
    """A 32x larger vocabulary (embedding and untied head) changes no count: parameters and their
    views (the head's transposed weight) are left out. Layers are counted alike, RoPE's cos / sin
    (saved by every layer) once, and the checkpointed peak adds one layer to what is kept."""
    small = saved_activation_bytes(build_tiny_llama(seed=0, vocab_size=128), tokens=64)
    large = saved_activation_bytes(build_tiny_llama(seed=0, vocab_size=4096), tokens=64)
    assert small.layers == large.layers and small.shared == large.shared
    assert abs(small.other - large.other) <= 2 * 4096 * 4  # the one kept position's logits, fp32
    assert len(set(small.layers)) == 1 and small.shared > 0
    assert small.peak(True) == small.kept(True) + small.inputs + small.layers[0]
    assert small.kept(True) < small.kept(False)
    with pytest.raises(ValueError, match="must divide"):
        saved_activation_bytes(build_tiny_llama(seed=0), tokens=10, row_tokens=4)
    checkpointed = build_tiny_llama(seed=0)
    checkpoint_layers(checkpointed)
    with pytest.raises(ValueError, match="before checkpoint_layers"):
        saved_activation_bytes(checkpointed, tokens=8)


def test_meta_models_are_counted_without_memory():
    """A model on the meta device (how the trainer builds one before sharding) is counted: the
    same bytes as the real model, in the dtype asked for."""
    with torch.device("meta"):
        meta = build_tiny_llama(seed=0)
    real = saved_activation_bytes(build_tiny_llama(seed=0), tokens=64)
    assert saved_activation_bytes(meta, tokens=64) == real
    half = saved_activation_bytes(meta, tokens=64, dtype=torch.bfloat16)
    assert half.layer_inputs[0] * 2 == real.layer_inputs[0]


def test_resolve_activation_checkpointing():
    gib = 2**30
    assert resolve_activation_checkpointing("on", estimated_bytes=None, device_bytes=None)
    assert not resolve_activation_checkpointing("off", estimated_bytes=200 * gib, device_bytes=80 * gib)
    # auto on a CPU: off whatever the estimate (no budget of the trainer's own is known)
    assert not resolve_activation_checkpointing("auto", estimated_bytes=10**15, device_bytes=None)
    assert resolve_activation_checkpointing("auto", estimated_bytes=70 * gib, device_bytes=80 * gib)
    assert not resolve_activation_checkpointing("auto", estimated_bytes=50 * gib, device_bytes=80 * gib)
    with pytest.raises(ValueError, match="auto, on or off"):
        resolve_activation_checkpointing("yes", estimated_bytes=None, device_bytes=None)


def test_auto_counts_the_model_on_a_gpu_and_stays_off_on_a_cpu(monkeypatch):
    """``activation_checkpointing_for``: on a CPU ``auto`` is off without counting; on a device of
    a given size it counts the model and turns on where a micro-batch would not fit."""
    model = build_tiny_llama(seed=0)
    assert not activation_checkpointing_for("auto", model=model, device="cpu", microbatch_tokens=10**6, world_size=1)
    assert activation_checkpointing_for("on", model=model, device="cpu", microbatch_tokens=8, world_size=1)
    monkeypatch.setattr(memory, "device_memory_bytes", lambda device: 8 * 2**20)  # an 8 MiB "GPU"
    assert not activation_checkpointing_for("auto", model=model, device="cuda", microbatch_tokens=64, world_size=1)
    assert activation_checkpointing_for("auto", model=model, device="cuda", microbatch_tokens=2048, world_size=1)


def test_checkpointed_layers_keep_names_and_values_in_one_process():
    plain, checkpointed = build_tiny_llama(seed=0).train(), build_tiny_llama(seed=0).train()
    assert checkpoint_layers(checkpointed) == 2 and checkpoint_layers(checkpointed) == 2  # idempotent
    assert [n for n, _ in checkpointed.named_parameters()] == [n for n, _ in plain.named_parameters()]
    assert checkpointed.state_dict().keys() == plain.state_dict().keys()
    ids = torch.randint(3, 100, (2, 12), generator=torch.Generator().manual_seed(1))
    for model in (plain, checkpointed):
        torch.log_softmax(model(input_ids=ids).logits, -1).mean().backward()
    for (name, a), b in zip(plain.named_parameters(), checkpointed.parameters(), strict=True):
        torch.testing.assert_close(b.grad, a.grad, rtol=0, atol=1e-6, msg=name)
    with torch.no_grad():  # a no-grad forward runs the layer as it is
        torch.testing.assert_close(checkpointed(input_ids=ids).logits, plain(input_ids=ids).logits)


def test_checkpointed_fsdp2_models_match_the_unsharded_model(tmp_path):
    """tests/worlds/checkpointing_world.py: FSDP2 worlds of 2 ranks and of 1 (gloo), with and
    without per-layer checkpointing: HF parameter names unchanged (``named_parameters`` and
    ``get_model_state_dict``), the trainer's shared-prefix log-probs and the gradients within 1e-6
    of the unsharded fp32 model's, and each layer recomputed in the backward only when checkpointed;
    checkpointed and compiled per layer (``--trainer.compile layers``, aot_eager) the same."""
    out = tmp_path / "out.json"
    check(run_torchrun("checkpointing_world.py", nproc=2, args=["--out", str(out)], timeout_s=240))
    results = json.loads(out.read_text())
    assert set(results) == {f"world{n}-{mode}" for n in (1, 2) for mode in ("off", "on", "compiled")}
    for name, result in results.items():
        assert result["names_equal"] and result["state_dict_names_equal"], name
        assert result["logp_diff"] <= 1e-6, (name, result)
        assert result["grad_diff"] <= 1e-6 * max(1.0, result["largest_grad"]), (name, result)
        assert result["compiled"] == name.endswith("-compiled"), (name, result)
        if not name.endswith("-compiled"):  # a compiled layer's module hooks are traced, not counted
            assert result["mlp_calls"] == ([2, 2] if name.endswith("-on") else [1, 1]), (name, result)
