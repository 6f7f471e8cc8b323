"""Tensor-parallel generator: 2-D (dp, tp) mesh, TP=2 greedy == TP=1, DDMA into TP shards.

One 3-rank gloo world (tests/worlds/tp_world.py: generator 2 ranks with tp=2, trainer 1 rank)
checks everything that needs processes; the rest are single-process checks of validation and
the data-parallel prompt split.
"""

import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from safetensors import safe_open
from safetensors.torch import load_file

sys.path.insert(0, str(Path(__file__).parent))
from launch import check, run_torchrun
from tiny_model import build_tiny_llama, save_tiny_model
from worlds.tp_world import PROMPTS, VERSION

from llamarl.data.prompts import Problem
from llamarl.executors.config import GeneratorConfig
from llamarl.executors.generator import GeneratorExecutor
from llamarl.models.tensor_parallel import apply_tensor_parallel
from llamarl.runtime.world import ExecutorContext, ExecutorSpec, plan_ranks, tp_grid

COLUMN = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
ROW = ("o_proj", "down_proj")


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("tp")
    model_dir = save_tiny_model(root / "model")
    out = root / "out"
    out.mkdir()
    check(run_torchrun("tp_world.py", nproc=3, args=["--pair", str(model_dir), str(out), "--episodes"], timeout_s=240))
    return out


def read(out: Path, name: str):
    return json.loads((out / name).read_text())


def test_generator_mesh_is_2d_dp_tp_and_trainer_mesh_stays_1d(world):
    for rank in (0, 1):
        mesh = read(world, f"mesh{rank}.json")
        assert mesh["ndim"] == 2 and mesh["dim_names"] == ["dp", "tp"] and mesh["mesh"] == [[0, 1]]
        assert (mesh["tp_rank"], mesh["dp_rank"], mesh["tp_size"], mesh["dp_size"]) == (rank, 0, 2, 1)
        assert mesh["tp_mesh"] == [0, 1] and mesh["tp_mesh_rank"] == rank
    trainer = read(world, "mesh2.json")
    assert trainer["ndim"] == 1 and trainer["mesh"] == [2] and trainer["tp_mesh"] is None


@pytest.mark.parametrize("phase", ["greedy", "greedy2"])
def test_tp2_greedy_generation_equals_tp1(world, phase):
    assert len({len(p) for p in PROMPTS}) == len(PROMPTS)  # prompts of different lengths: left padding
    want = read(world, f"{phase}_tp1.json")
    for rank in (0, 1):
        got = read(world, f"{phase}_gen{rank}.json")
        assert [g["ids"] for g in got] == [w["ids"] for w in want], f"generator rank {rank}"
        for g, w in zip(got, want):
            torch.testing.assert_close(torch.tensor(g["logprobs"]), torch.tensor(w["logprobs"]), rtol=0, atol=1e-4)


def test_tp_peers_sample_identically_and_only_the_first_emits(world):
    first, peer = read(world, "step_gen0.json"), read(world, "step_gen1.json")
    assert first["generated"] == peer["generated"]  # same requests, same seed, bitwise-equal logits
    assert len(first["generated"]) == 4  # 2 prompts x 2 samples
    assert len({tuple(g["ids"]) for g in first["generated"]}) > 1  # it really sampled
    assert first["emitted"] == 4 and peer["emitted"] == 0


def test_tp_peers_share_the_first_ranks_sampled_tokens(world):
    """TP peers drawing from different RNG streams still generate the same tokens and log-probs: each
    step's sample is the group's first rank's, broadcast (else a peer that drew another token, or
    stopped at another step, would hang the group's next all-reduce)."""
    first, peer = read(world, "diverged_gen0.json"), read(world, "diverged_gen1.json")
    assert first == peer
    assert len({tuple(g["ids"]) for g in first}) > 1  # it really sampled


def test_tp_peers_append_the_first_ranks_tool_answers(world):
    """The environment's tool names the rank it runs on: the peers' episodes are identical and hold
    rank 0's answers only (the TP group's first rank runs the tools and shares them)."""
    first, peer = read(world, "episodes_gen0.json"), read(world, "episodes_gen1.json")
    assert first["generated"] == peer["generated"] and len(first["generated"]) == 4
    assert first["emitted"] == 4 and peer["emitted"] == 0
    assert first["tool_calls"] > 0 and any(0 in g["mask"] and " r0" in g["text"] for g in first["generated"])
    assert not any(" r1" in g["text"] for g in first["generated"])


def test_ddma_into_tp2_generator_gives_the_trainers_weights(world):
    trainer = load_file(world / "trainer.safetensors")
    full = load_file(world / "generator_full.safetensors")
    assert sorted(full) == sorted(trainer)
    for name, tensor in trainer.items():
        assert torch.equal(full[name], tensor), name
    for rank in (0, 1):
        path = world / f"generator_local{rank}.safetensors"
        with safe_open(str(path), "pt") as fh:
            assert int(fh.metadata()["version"]) == VERSION
        local = load_file(path)
        sharded = 0
        for name, tensor in local.items():
            module = name.rsplit(".", 2)[-2]
            dim = 0 if module in COLUMN else 1 if module in ROW else None
            want = trainer[name] if dim is None else trainer[name].chunk(2, dim=dim)[rank]
            assert torch.equal(tensor, want), f"generator rank {rank}: {name}"
            sharded += dim is not None
        assert sharded == 2 * len(COLUMN + ROW)  # 2 layers, every projection is a TP shard


# ----- single process -----
def test_tp_grid_puts_tp_innermost():
    assert tp_grid([4, 5, 6, 7], 2) == [[4, 5], [6, 7]]
    assert tp_grid([0, 1, 2], 1) == [[0], [1], [2]]
    with pytest.raises(ValueError, match="3 ranks cannot be split into TP groups of 2"):
        tp_grid([0, 1, 2], 2)


def test_num_ranks_not_a_multiple_of_tp_fails_before_any_group(monkeypatch):
    with pytest.raises(ValueError, match=r"--generator.num-ranks \(3\) must be a multiple of --generator.tp \(2\)"):
        GeneratorConfig(num_ranks=3, tp=2)
    specs = [ExecutorSpec("generator", 3, tp=2), ExecutorSpec("trainer", 1)]
    with pytest.raises(ValueError, match=r"'generator': num_ranks \(3\) must be a multiple of tp \(2\)"):
        plan_ranks(specs, 4)
    monkeypatch.setenv("WORLD_SIZE", "4")
    with pytest.raises(ValueError, match="must be a multiple of tp"):
        ExecutorContext.create(specs)
    assert not dist.is_initialized()


@pytest.mark.parametrize(("tp", "needle"), [(3, "num_heads (4)"), (4, "num_kv_heads (2)")])
def test_heads_must_divide_by_tp(tp, needle):
    model = build_tiny_llama(num_heads=4, num_kv_heads=2, intermediate_size=96)
    with pytest.raises(ValueError, match="tensor parallelism") as err:
        apply_tensor_parallel(model, SimpleNamespace(size=lambda: tp))
    assert needle in str(err.value)


def test_prompts_are_split_by_dp_replica_not_by_rank():
    """4 ranks, tp=2: TP peers get the same prompts, the two replicas disjoint ones."""

    class Task:
        def sample(self, index):
            return Problem(question=str(index), answer="")

    config = GeneratorConfig(num_ranks=4, tp=2, num_prompts_per_step=3, samples_per_prompt=2)
    seen = {}
    for local_rank in range(4):
        ctx = SimpleNamespace(dp_rank=local_rank // 2, dp_size=2, tp_rank=local_rank % 2)
        gen = GeneratorExecutor(ctx, model_config=None, config=config, task=Task(), prompt_fn=lambda t, q: [int(q)])
        gen.tokenizer = None
        seen[local_rank] = [[r.prompt_ids[0] for r in gen._new_requests()] for _ in range(2)]
    assert seen[0] == seen[1] == [[0, 0, 1, 1, 2, 2], [6, 6, 7, 7, 8, 8]]
    assert seen[2] == seen[3] == [[3, 3, 4, 4, 5, 5], [9, 9, 10, 10, 11, 11]]


def test_gather_broadcast_into_tp2_generator_gives_the_trainers_weights(world):
    trainer = load_file(world / "trainer_gb.safetensors")
    generator = load_file(world / "generator_full_gb.safetensors")
    assert sorted(trainer) == sorted(generator)
    assert any(not torch.equal(trainer[n], load_file(world / "trainer.safetensors")[n]) for n in trainer)
    for name, tensor in trainer.items():
        assert torch.equal(generator[name], tensor), name


def test_tp_refuses_an_architecture_it_cannot_shard_with_one_line():
    """A fused-projection model (GPT-2's c_attn / c_fc are Conv1D, not q/k/v_proj) or a Llama layer
    missing one projection is refused by name, never left silently unsharded."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from llamarl.models.tensor_parallel import check_tp_supported

    check_tp_supported(build_tiny_llama(seed=0, vocab_size=128))  # the supported layout passes
    with pytest.raises(ValueError, match="supports Llama-family models with decoder layers at model.model.layers; "
                                         "GPT2LMHeadModel has none"):
        check_tp_supported(GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64)))
    fused = build_tiny_llama(seed=0, vocab_size=128)
    del fused.model.layers[1].mlp.gate_proj
    with pytest.raises(ValueError, match=r"cannot shard LlamaForCausalLM: decoder layer 1 has no nn.Linear "
                                         r"mlp.gate_proj \(its linear layers: mlp.down_proj, mlp.up_proj, "
                                         r"self_attn.k_proj"):
        check_tp_supported(fused)
