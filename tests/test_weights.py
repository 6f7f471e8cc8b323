"""WeightsChannel (DDMA and gather_broadcast) in a real gloo world, plus the DDMA planner alone.

One 5-rank world (tests/worlds/weights_world.py) runs three trainer -> generator splits: 3 -> 2
(uneven FSDP2 shards; replicas, explicit-slice TP and DTensor TP), 2 -> 1 and 1 -> 2, each with
every case of ``cases(G)`` (tied / untied, fp32 / bf16 generator, ddma / gather_broadcast). One
world, not three: a world's cost is almost all process start-up (~7 s of imports per rank).
"""

import json
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

sys.path.insert(0, str(Path(__file__).parent))
from launch import check, run_torchrun
from tiny_model import build_tiny_llama
from tp_layout import llama_tp_slices
from worlds.weights_world import BUCKET_MB, ERROR_CASES, LORA, SIZES, cases, lora_cases

from llamarl.channels.ddma_plan import build_plan
from llamarl.runtime.boxes import chunk_slice

# Split name -> (trainer ranks, generator ranks); the first one spans the whole world.
WORLDS = {"3->2": (3, 2), "2->1": (2, 1), "1->2": (1, 2), "1->1": (1, 1)}


@pytest.fixture(scope="module")
def worlds(tmp_path_factory):
    out = tmp_path_factory.mktemp("weights")
    splits = [f"{g}:{t}" for t, g in WORLDS.values()]
    proc = run_torchrun("weights_world.py", nproc=sum(WORLDS["3->2"]), args=["--out", str(out), "--splits", *splits], timeout_s=240)
    return out, proc


def world_dir(worlds, name) -> Path:
    out, proc = worlds
    check(proc)
    trainers, generators = WORLDS[name]
    return out / f"{trainers}to{generators}"


def load_generator(out: Path, case: str, index: int) -> tuple[dict, dict]:
    path = out / f"{case}_gen{index}.safetensors"
    with safe_open(str(path), "pt") as fh:
        info = json.loads(fh.metadata()["info"])
    return load_file(path), info


def expected_local(full: torch.Tensor, dtype: torch.dtype, spec) -> torch.Tensor:
    cast = full.to(dtype)
    return cast.narrow(spec[0], spec[1], spec[2]) if spec else cast


ALL_CASES = [(w, c) for w, (_, g) in WORLDS.items() for c in cases(g)]


@pytest.mark.parametrize(("world", "case"), ALL_CASES, ids=[f"{w}-{c}" for w, c in ALL_CASES])
def test_generator_weights_equal_the_trainers_bitwise(worlds, world, case):
    out = world_dir(worlds, world)
    config = cases(WORLDS[world][1])[case]
    dtype = getattr(torch, config["dtype"])
    full = load_file(out / f"{case}_trainer.safetensors")
    for index in range(WORLDS[world][1]):
        got, info = load_generator(out, case, index)
        assert sorted(got) == sorted(full), "generator and trainer disagree on parameter names"
        assert ("lm_head.weight" in got) == (not config["tied"])
        for name, tensor in got.items():
            want = expected_local(full[name], dtype, info["slices"].get(name))
            assert tensor.dtype == dtype and tensor.shape == want.shape, name
            assert torch.equal(tensor, want), f"{case} generator {index}: {name} differs"
        assert info["version"] == 17  # the second sync's trainer version


LORA_CASES = [(w, c) for w, (_, g) in WORLDS.items() for c in lora_cases(g)]


@pytest.mark.parametrize(("world", "case"), LORA_CASES, ids=[f"{w}-{c}" for w, c in LORA_CASES])
def test_lora_syncs_only_the_adapters_and_each_generator_rank_merges_them_in_place(worlds, world, case):
    """--trainer.lora.rank: each generator rank receives exactly its slice of every adapter, bitwise
    (a TP rank: rows of B for column-parallel weights, columns of A for row-parallel ones), keeps
    the base it loaded, and holds ``W_base + (alpha / r) B A`` in the weights' own storage; the wire
    carries the adapters only."""
    out = world_dir(worlds, world)
    trainers, generators = WORLDS[world]
    config = lora_cases(generators)[case]
    dtype = getattr(torch, config["dtype"])
    full = load_file(out / f"{case}_trainer.safetensors")
    base_model = dict(build_tiny_llama(seed=2, tie_word_embeddings=config["tied"], **SIZES).to(dtype).named_parameters())
    full_bytes = sum(p.numel() * p.element_size() for p in base_model.values())
    sent = [tuple(x) for t in range(trainers)
            for x in json.loads((out / f"{case}_trainer{t}.json").read_text())["bytes_sent"]]
    for index in range(generators):
        got, info = load_generator(out, case, index)
        adapters = {k.removeprefix("adapter/"): v for k, v in got.items() if k.startswith("adapter/")}
        assert sorted(adapters) == sorted(full) and len(full) == 2 * 7 * 2  # A and B of 7 linears x 2 layers
        for name, tensor in adapters.items():
            assert torch.equal(tensor, expected_local(full[name], dtype, info["slices"].get(name))), (case, name)
        weight_slices = llama_tp_slices(build_tiny_llama(seed=2, **SIZES), tp_rank=index,
                                        tp_size=generators) if config["layout"] == "tp_dtensor" else {}
        for module in (k.removeprefix("merged/") for k in got if k.startswith("merged/")):
            spec = weight_slices.get(f"{module}.weight")
            base = expected_local(base_model[f"{module}.weight"], dtype, spec)
            assert torch.equal(got[f"base/{module}"], base), f"{case}: the base of {module} changed"
            a = expected_local(full[f"{module}.lora_A.weight"], dtype, info["slices"].get(f"{module}.lora_A.weight"))
            b = expected_local(full[f"{module}.lora_B.weight"], dtype, info["slices"].get(f"{module}.lora_B.weight"))
            want = torch.addmm(base, b, a, alpha=LORA.scale)  # the merge's own op, on the trainer's adapters
            assert torch.equal(got[f"merged/{module}"], want), f"{case} generator {index}: {module} merged wrongly"
        assert info["same_storage"], f"{case}: a generation weight was rebound instead of written in place"
        assert sum(n for _, _, n in info["bytes_received"]) == info["nbytes"], case
        assert sum(n for _, dst, n in sent if dst == index) == info["nbytes"], case
        assert info["nbytes"] < 0.2 * full_bytes, f"{case}: {info['nbytes']} bytes for a {full_bytes}-byte model"
        assert info["version"] == 17


@pytest.mark.parametrize("world", list(WORLDS))
def test_a_streaming_sink_gets_every_parameter_once_per_sync_and_holds_no_model(worlds, world):
    """A generator with ``weight_sink()`` (vLLM's: no HF copy) keeps its layout on the meta device and
    is handed each parameter exactly once per sync, whole, on its device, in DDMA (one round or
    many) and gather-broadcast alike; the values are checked bitwise with the other cases above."""
    out = world_dir(worlds, world)
    generators = WORLDS[world][1]
    streaming = [c for c, config in cases(generators).items() if config["layout"] == "stream"]
    assert {cases(generators)[c]["mode"] for c in streaming} == {"ddma", "gather_broadcast"}
    for case in streaming:
        for index in range(generators):
            got, info = load_generator(out, case, index)
            assert info["meta"], f"{case}: the streaming generator's model got storage"
            assert [s["count"] for s in info["streams"]] == [len(got)] * 2, (case, info["streams"])
            assert all(s["unique"] == s["count"] and s["devices"] == ["cpu"] for s in info["streams"]), case


@pytest.mark.parametrize("world", list(WORLDS))
def test_wire_bytes_are_exactly_what_each_generator_rank_holds(worlds, world):
    out = world_dir(worlds, world)
    trainers, generators = WORLDS[world]
    for case, config in cases(generators).items():
        sent = [tuple(x) for t in range(trainers)
                for x in json.loads((out / f"{case}_trainer{t}.json").read_text())["bytes_sent"]]
        for index in range(generators):
            got, info = load_generator(out, case, index)
            needed = sum(t.numel() * t.element_size() for t in got.values())
            received = sum(n for _, _, n in info["bytes_received"])
            assert received == needed, f"{case} generator {index}"
            # Generator ranks are global ranks 0..G-1 (they come first in the split).
            assert sum(n for _, dst, n in sent if dst == index) == needed, f"{case} generator {index}"
        if config["mode"] == "ddma":
            assert len({src for src, _, n in sent if n}) == trainers, f"{case}: every trainer rank sends"


@pytest.mark.parametrize("world", list(WORLDS))
def test_bucketed_ddma_holds_each_peer_to_one_bounded_buffer(worlds, world):
    """--weights.bucket-mb: the sync runs in several rounds, each rank keeps one buffer per peer, none
    larger than the bound unless one piece alone is (the weights are checked bitwise above)."""
    out = world_dir(worlds, world)
    trainers, generators = WORLDS[world]
    bound = int(BUCKET_MB * 2**20)
    bucketed = [c for c, config in cases(generators).items() if config.get("bucket_mb") and config["mode"] == "ddma"]
    assert bucketed
    for case in bucketed:
        infos = [json.loads((out / f"{case}_trainer{t}.json").read_text()) for t in range(trainers)]
        infos += [load_generator(out, case, g)[1] for g in range(generators)]
        assert all(info["rounds"] > 1 for info in infos), case
        for info in infos:
            assert info["buffer_bytes"] and max(info["buffer_bytes"]) <= max(bound, info["largest_piece"]), (case, info)
        unbucketed = json.loads((out / f"{case.removesuffix('_bucketed')}_trainer0.json").read_text())
        assert unbucketed["rounds"] == 1 and max(unbucketed["buffer_bytes"]) > bound


@pytest.mark.parametrize("world", list(WORLDS))
def test_ddma_and_gather_broadcast_give_identical_generator_weights(worlds, world):
    out = world_dir(worlds, world)
    generators = WORLDS[world][1]
    pairs = [c for c in cases(generators) if c + "_gb" in cases(generators)]
    assert pairs
    for case in pairs:
        for index in range(generators):
            ddma, gb = load_generator(out, case, index)[0], load_generator(out, case + "_gb", index)[0]
            assert all(torch.equal(ddma[n], gb[n]) for n in ddma), f"{case} generator {index}"


@pytest.mark.parametrize("world", list(WORLDS))
def test_layout_mismatch_raises_the_same_one_line_error_on_every_rank(worlds, world):
    out = world_dir(worlds, world)
    trainers, generators = WORLDS[world]
    ranks = [f"trainer{i}" for i in range(trainers)] + [f"generator{i}" for i in range(generators)]
    for case, needle in ERROR_CASES.items():
        for rank in ranks:
            message = (out / f"error_{case}_{rank}.txt").read_text()
            assert needle in message and "\n" not in message, f"{rank}: {message}"


# ----- the planner alone -----
def layout(params, dtype="float32"):
    return {"dtype": dtype, "params": [{"name": n, "shape": s, "box": b} for n, s, b in params]}


def rows(shape, start, length):
    return [[start, length]] + [[0, s] for s in shape[1:]]


def test_chunk_slice_follows_torch_chunk_including_empty_ranks():
    for size, world in [(10, 3), (2, 3), (131, 2), (7, 4), (5, 4)]:
        lengths = [c.shape[0] for c in torch.arange(size).chunk(world)]
        lengths += [0] * (world - len(lengths))
        assert [chunk_slice(size, rank=r, world=world)[1] for r in range(world)] == lengths


def test_plan_intersects_row_shards_with_column_shards_into_blocks():
    shape = [5, 4]
    trainer = [layout([("w", shape, rows(shape, *chunk_slice(5, rank=r, world=3)))]) for r in range(3)]
    generator = [layout([("w", [5, None], [[0, 5], [0, 3]])], "bfloat16"),
                 layout([("w", [5, None], [[0, 5], [3, 1]])], "bfloat16")]
    plan = build_plan(trainer, generator)
    assert plan.pieces[(2, 1)][0].src == ((0, 1), (3, 1))  # trainer 2 holds row 4 only
    assert plan.pieces[(2, 1)][0].dst == ((4, 1), (0, 1))
    assert plan.numel((0, 0)) == 2 * 3 and plan.numel((1, 1)) == 2 * 1
    assert sum(plan.numel((t, g)) for t in range(3) for g in range(2)) == 5 * 4


def test_plan_spreads_replicated_trainer_params_and_skips_empty_shards():
    trainer = [layout([("w", [2, 3], rows([2, 3], *chunk_slice(2, rank=r, world=3))), ("b", [3], [[0, 3]])])
               for r in range(3)]
    generator = [layout([("w", [2, 3], [[0, 2], [0, 3]]), ("b", [3], [[0, 3]])]) for _ in range(2)]
    plan = build_plan(trainer, generator)
    assert [p.name for p in plan.pieces[(0, 0)]] == ["w", "b"]  # b from holder 0 % 3
    assert [p.name for p in plan.pieces[(1, 1)]] == ["w", "b"]  # b from holder 1 % 3
    assert (2, 0) not in plan.pieces and (2, 1) not in plan.pieces  # trainer 2's shard is empty
    assert plan.pieces[(1, 1)][1].offset == 3  # after w's row


@pytest.mark.parametrize(("generator", "needle"), [
    (layout([("v", [4], [[0, 4]])]), "'v' does not exist"),
    (layout([("w", [4, 3], [[0, 4], [0, 3]])]), "'w' is [4, 2] on the trainer but [4, 3]"),
    (layout([("w", [4, None], [[0, 4], [1, 2]])]), "outside its trainer shape"),
    (layout([("w", [4, 2], [[0, 4], [0, 2]])], "float8"), "unsupported dtype"),
])
def test_plan_rejects_bad_generator_layouts(generator, needle):
    trainer = [layout([("w", [4, 2], rows([4, 2], 2 * r, 2))]) for r in range(2)]
    with pytest.raises(ValueError, match="^x: ") as err:
        build_plan(trainer, [generator], label="x")
    assert needle in str(err.value)


def test_plan_rejects_trainer_shards_that_do_not_tile():
    overlapping = [layout([("w", [4, 2], rows([4, 2], r, 3))]) for r in range(2)]
    with pytest.raises(ValueError, match="shards of 'w' do not tile"):
        build_plan(overlapping, [layout([("w", [4, 2], [[0, 4], [0, 2]])])])
