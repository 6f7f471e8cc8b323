"""LoRA in one process (``llamarl/models/lora.py``, ``lora_merge.py``): the generator's in-place merge
against a PEFT forward, initialisation independent of the sharding, targets and their errors, the
base with adapters disabled, and the configuration checks made before any rank starts. The
multi-rank paths (adapter-only sync per generator rank, TP slices) are in tests/test_weights.py;
training, resume and export on every model family in tests/test_model_families.py; the schedules in
tests/test_e2e.py."""

import contextlib
import copy
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

sys.path.insert(0, str(Path(__file__).parent))
from model_families import build_family
from tiny_model import build_tiny_llama

from llamarl.executors.config import GeneratorConfig, TrainerConfig
from llamarl.models.config import LoraConfig, ModelConfig
from llamarl.models.lora import AdapterView, LoraSpec, adapter_parameters, adapters_disabled, checkpoint_name
from llamarl.models.lora_merge import AdapterMerger
from llamarl.models.sharding import shard_model
from llamarl.rl.config import RLConfig
from llamarl.rl.config_checks import validate_config

IDS = torch.tensor([[5, 17, 3, 99, 42, 7, 64, 12]])


def random_adapters(model: torch.nn.Module, seed: int) -> None:
    """Give every adapter of an injected model random values (B is zero at initialisation)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in adapter_parameters(model).values():
            param.copy_(torch.randn(param.shape, generator=generator) * 0.05)


def logits(model: torch.nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model(IDS).logits


@pytest.mark.parametrize(("family", "targets"), [("llama-tied", "all-linear"), ("qwen2", "all-linear"),
                                                 ("llama-untied", "q_proj,v_proj,down_proj")])
def test_the_generators_merge_equals_a_peft_forward_of_the_adapters_in_fp32(family, targets):
    """``W = W_base + (alpha / r) B A`` written into the generation weights gives the logits of peft's
    own LoRA forward with the same adapters (Qwen2: biased q/k/v; tied: the shared embedding is
    never adapted)."""
    spec = LoraSpec(rank=4, alpha=12.0, targets=targets)
    base = build_family(family)
    policy = spec.inject(copy.deepcopy(base))
    random_adapters(policy, seed=1)
    generation = copy.deepcopy(base)
    merger = AdapterMerger(generation, spec)
    adapters = adapter_parameters(policy)
    assert sorted(merger.tensors) == sorted(adapters)
    for name, tensor in merger.tensors.items():
        tensor.copy_(adapters[name].detach())
    pointers = [p.data_ptr() for p in generation.parameters()]
    merger.merge()
    assert pointers == [p.data_ptr() for p in generation.parameters()], "a weight was rebound, not written in place"
    torch.testing.assert_close(logits(generation), logits(policy), atol=1e-5, rtol=1e-5)
    assert not torch.allclose(logits(generation), logits(base), atol=1e-3), "the adapters changed nothing"


def test_each_merge_starts_from_the_base_so_updates_do_not_accumulate():
    spec = LoraSpec(rank=2, alpha=4.0)
    model = build_tiny_llama(seed=0)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    merger = AdapterMerger(model, spec)
    for value in (0.3, 0.1, 0.0):
        for tensor in merger.tensors.values():
            tensor.fill_(value)
        merger.merge()
    for name, param in model.named_parameters():  # B = A = 0 last: exactly the base again
        assert torch.equal(param, before[name]), name


def test_targets_name_linears_of_the_decoder_layers_only_and_bad_ones_are_one_line_errors():
    tied = build_tiny_llama(seed=0, tie_word_embeddings=True)
    every = LoraSpec(rank=2, alpha=4.0).target_modules(tied)
    assert len(every) == 2 * 7 and not any("embed" in n or "lm_head" in n for n in every)
    assert LoraSpec(rank=2, alpha=4.0, targets="q_proj, v_proj").target_modules(tied) == [
        f"model.layers.{i}.self_attn.{p}" for i in range(2) for p in ("q_proj", "v_proj")]
    for targets, needle in [("qkv_proj", "'qkv_proj' matches no linear layer"),
                            ("lm_head", "'lm_head' matches no linear layer")]:
        with pytest.raises(ValueError, match=needle) as err:
            LoraSpec(rank=2, alpha=4.0, targets=targets).target_modules(tied)
        assert "--trainer.lora.targets" in str(err.value) and "\n" not in str(err.value)


def test_injection_freezes_everything_but_the_adapters_and_keeps_checkpoint_names():
    model = LoraSpec(rank=2, alpha=4.0).inject(build_tiny_llama(seed=0, tie_word_embeddings=True))
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all(".lora_" in n for n in trainable)
    plain = {n for n, _ in build_tiny_llama(seed=0, tie_word_embeddings=True).named_parameters()}
    stored = {checkpoint_name(n) for n, _ in model.named_parameters()} - {None}
    assert stored == plain
    view = dict(AdapterView(model).named_parameters())
    assert sorted(view) == sorted(adapter_parameters(model)) and all(n.endswith((".lora_A.weight", ".lora_B.weight"))
                                                                   for n in view)


def test_adapters_disabled_is_the_base_model():
    base = build_tiny_llama(seed=0)
    model = LoraSpec(rank=2, alpha=4.0).inject(copy.deepcopy(base))
    random_adapters(model, seed=2)
    assert not torch.allclose(logits(model), logits(base), atol=1e-4)
    with adapters_disabled(model):
        torch.testing.assert_close(logits(model), logits(base), atol=0, rtol=0)
    assert not torch.allclose(logits(model), logits(base), atol=1e-4)  # on again after the block
    assert all(p.requires_grad for n, p in model.named_parameters() if ".lora_" in n)


@contextlib.contextmanager
def fake_world(world_size: int, rank: int):
    """Rank ``rank`` of a ``fake``-backend world (every collective returns at once): what a rank of
    a real FSDP2 world holds, in one process."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield DeviceMesh("cpu", list(range(world_size)))
    finally:
        dist.destroy_process_group()


def test_initial_adapters_are_the_same_on_any_number_of_ranks():
    """A resharded resume needs the adapters a run starts with not to depend on the trainer's rank
    count: each rank's FSDP2 shard holds the rows of the one whole draw (A), B is zero, and the
    spread is peft's (Kaiming-uniform, a = sqrt(5): bound 1 / sqrt(fan_in))."""
    spec = LoraSpec(rank=4, alpha=8.0)
    whole = spec.inject(build_tiny_llama(seed=0))
    spec.initialise(whole, seed=7)
    full = adapter_parameters(whole)
    for name, tensor in full.items():
        if name.endswith("lora_B.weight"):
            assert not tensor.any()
        else:
            bound = 1 / tensor.shape[1] ** 0.5
            assert tensor.abs().max() <= bound and tensor.abs().max() > 0.8 * bound, name
    for world, rank in [(2, 1), (3, 2)]:
        with fake_world(world, rank) as mesh:
            sharded = shard_model(spec.inject(build_tiny_llama(seed=0)), mesh)
            spec.initialise(sharded, seed=7)
            for name, param in adapter_parameters(sharded).items():
                rows = torch.chunk(full[name], world)[rank] if rank < len(torch.chunk(full[name], world)) else None
                local = param.to_local()
                assert rows is None and local.numel() == 0 or torch.equal(local, rows), (world, rank, name)


def rl_config(tmp_path, model_dir, **lora) -> RLConfig:
    return RLConfig(model=ModelConfig(name=str(model_dir)), trainer=TrainerConfig(lora=LoraConfig(**lora)),
                    generator=GeneratorConfig())


def test_lora_configuration_errors_are_one_line_and_name_the_flag(tmp_path, model_dir):
    for make, needle in [(lambda: LoraConfig(rank=0), "--trainer.lora.rank must be >= 1"),
                         (lambda: LoraConfig(rank=4, alpha=0), "--trainer.lora.alpha must be > 0"),
                         (lambda: LoraConfig(rank=4, dropout=1.0), "--trainer.lora.dropout"),
                         (lambda: LoraConfig(rank=4, targets="q_proj,,v_proj"), "--trainer.lora.targets has an empty"),
                         (lambda: LoraConfig(rank=4, targets="all-linear,q_proj"), "all-linear cannot be combined")]:
        with pytest.raises(ValueError, match=needle):
            make()
    config = rl_config(tmp_path, model_dir, rank=4, targets="q_proj,w_pack")
    config.run.output_dir = str(tmp_path / "run")
    with pytest.raises(ValueError, match="'w_pack' matches no linear layer of the decoder layers of LlamaForCausalLM"):
        validate_config(config)
    config = rl_config(tmp_path, model_dir, rank=4)
    config.run.output_dir = str(tmp_path / "run")
    validate_config(config)
    assert LoraConfig(rank=8).spec().scale == 2.0 and LoraConfig(rank=8, alpha=4).spec().scale == 0.5
    assert LoraConfig().spec() is None
