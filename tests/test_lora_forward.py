"""The trainer's merged LoRA forward (``llamarl/models/lora_forward.py``): in fp32 it is peft's
forward (values and adapter gradients); in bf16 the trainer's log-probs are bitwise the generator's
after its in-place merge, where peft's unmerged sum is not (the proxy for the train / generate
mismatch ``make run`` measured); and it steps aside where it cannot serve (adapters disabled,
dropout)."""

import copy
import socket
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

sys.path.insert(0, str(Path(__file__).parent))
from model_families import build_family

from llamarl.models.lora import LoraSpec, adapter_parameters, adapters_disabled
from llamarl.models.lora_forward import use_merged_forward
from llamarl.models.lora_merge import AdapterMerger
from llamarl.models.sharding import shard_model

IDS = torch.tensor([[5, 17, 3, 99, 42, 7, 64, 12, 5, 300, 2, 1000]])


def trainer_policy(base: torch.nn.Module, spec: LoraSpec, *, frozen: torch.dtype, seed: int) -> torch.nn.Module:
    """What the trainer holds (``sharded_loading._adapt``): the base frozen in ``frozen``, fp32
    adapter masters, here with random values of a trained adapter's size (B is zero at first)."""
    model = spec.inject(copy.deepcopy(base))
    generator = torch.Generator().manual_seed(seed)
    for param in model.parameters():
        param.data = param.data.to(torch.float32 if param.requires_grad else frozen)
    with torch.no_grad():
        for param in adapter_parameters(model).values():
            param.copy_(torch.randn(param.shape, generator=generator) * 0.1)
    return model


def generation_policy(base: torch.nn.Module, trainer: torch.nn.Module, spec: LoraSpec) -> torch.nn.Module:
    """The generator's model after an adapter sync: its own bf16 copy of the base, the adapters
    received into bf16 buffers (the wire's dtype) and merged in place."""
    model = copy.deepcopy(base)
    for param in model.parameters():  # as the trainer's base is stored (its buffers, RoPE's, as they are)
        param.data = param.data.to(torch.bfloat16)
    merger = AdapterMerger(model, spec)
    adapters = adapter_parameters(trainer)
    with torch.no_grad():
        for name, buffer in merger.tensors.items():
            buffer.copy_(adapters[name].detach())
    merger.merge()
    return model


def log_probs(model: torch.nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return torch.log_softmax(model(IDS).logits.float(), dim=-1)


@pytest.mark.parametrize("family", ["llama-tied", "qwen2", "qwen3"])
def test_the_merged_forward_is_pefts_forward_in_fp32_values_and_adapter_gradients(family):
    base = build_family(family)
    merged = trainer_policy(base, LoraSpec(rank=4, alpha=8.0), frozen=torch.float32, seed=1)
    unmerged = trainer_policy(base, LoraSpec(rank=4, alpha=8.0, merged_forward=False), frozen=torch.float32, seed=1)
    outputs = []
    for model in (merged, unmerged):
        logits = model(IDS).logits
        (logits * torch.linspace(-1, 1, logits.shape[-1])).sum().backward()
        outputs.append((logits.detach(), {n: p.grad for n, p in adapter_parameters(model).items()}))
    (merged_logits, merged_grads), (peft_logits, peft_grads) = outputs
    torch.testing.assert_close(merged_logits, peft_logits, atol=1e-5, rtol=1e-5)
    assert sorted(merged_grads) == sorted(peft_grads)
    for name, grad in merged_grads.items():
        assert grad is not None and grad.abs().max() > 0, name
        err = (grad - peft_grads[name]).abs().max() / peft_grads[name].abs().max()
        assert err < 1e-5, (name, err.item())
    assert all(p.grad is None for n, p in merged.named_parameters() if ".lora_" not in n), "the base got a gradient"


@pytest.mark.parametrize("family", ["llama-tied", "llama-untied", "qwen2"])
def test_in_bf16_the_trainer_scores_bitwise_what_the_generator_samples(family):
    """The generator samples from ``round(W_base + s B A)``; the trainer's merged forward computes
    with the same bf16 weights, so its log-probs are the generator's exactly. peft's unmerged sum
    (the trainer before the merged forward) is off by far more than bf16's last bit."""
    base = build_family(family)
    generator = log_probs(generation_policy(base, trainer_policy(base, LoraSpec(rank=8, alpha=16.0),
                                                                 frozen=torch.bfloat16, seed=3),
                                            LoraSpec(rank=8, alpha=16.0)))
    merged = log_probs(trainer_policy(base, LoraSpec(rank=8, alpha=16.0), frozen=torch.bfloat16, seed=3))
    unmerged = log_probs(trainer_policy(base, LoraSpec(rank=8, alpha=16.0, merged_forward=False),
                                        frozen=torch.bfloat16, seed=3))
    assert torch.equal(merged, generator)
    assert (unmerged - generator).abs().max() > 1e-3, "peft's unmerged bf16 sum matched the generator: nothing to test"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_under_fsdp2_mixed_precision_and_activation_checkpointing_too():
    """The trainer's real wrapping: FSDP2 casts the fp32 adapter masters to bf16 for the forward
    (as the wire rounds them) and each decoder layer recomputes its forward in the backward."""
    base = build_family("llama-tied")
    spec = LoraSpec(rank=8, alpha=16.0)
    generator = log_probs(generation_policy(base, trainer_policy(base, spec, frozen=torch.bfloat16, seed=5), spec))
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1)
    try:
        model = shard_model(trainer_policy(base, spec, frozen=torch.bfloat16, seed=5), DeviceMesh("cpu", [0]),
                            param_dtype=torch.bfloat16, activation_checkpointing=True)
        assert torch.equal(log_probs(model), generator)
        logits = model(IDS).logits
        logits.float().logsumexp(-1).sum().backward()
        grads = [p.grad for p in adapter_parameters(model).values()]
        assert all(g is not None and g.to_local().isfinite().all() for g in grads)
        assert any(g.to_local().abs().max() > 0 for g in grads)
    finally:
        dist.destroy_process_group()


def test_it_steps_aside_for_disabled_adapters_and_for_dropout():
    base = build_family("llama-tied")
    spec = LoraSpec(rank=4, alpha=8.0)
    model = trainer_policy(base, spec, frozen=torch.float32, seed=2)
    assert use_merged_forward(model) == 0, "already installed by inject: installing again must change nothing"
    with adapters_disabled(model):  # the reference policy of recipes/ref_kl.py
        torch.testing.assert_close(log_probs(model), log_probs(base), atol=0, rtol=0)
    with_dropout = trainer_policy(base, LoraSpec(rank=4, alpha=8.0, dropout=0.5), frozen=torch.float32, seed=2).train()
    assert not torch.equal(log_probs(with_dropout), log_probs(with_dropout)), "dropout did not act: not peft's forward"
    model.train()
    assert torch.equal(log_probs(model), log_probs(model))
