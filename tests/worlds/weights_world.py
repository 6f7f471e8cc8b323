"""WeightsChannel in a real gloo world under several trainer -> generator splits.

usage: weights_world.py --out OUT_DIR --splits G:T [G:T ...]

The first split (generator = the first G ranks, trainer = the next T, G + T = the world size) is
made by ``ExecutorContext.create``. Each further split takes the first G' generator ranks and the
first T' trainer ranks of it, with real process groups / meshes of their own, and leaves the other
ranks idle: one world start-up (the expensive part: ~7 s of imports per rank) tests many layouts.
Every split writes into ``OUT_DIR/<T>to<G>/``.

For every case of ``cases(G)`` (see there) the trainer builds a tiny Llama, shards it with
``shard_model`` on its mesh (uneven shards: no size is divisible by 3) and perturbs each local
shard rank-dependently, so only a correct routing reproduces its full weights. The channel syncs
twice (the trainer perturbs again in between, so buckets are reused). Then:

- the trainer's first rank writes ``<case>_trainer.safetensors`` (the full parameters);
- every trainer rank writes ``<case>_trainer<r>.json`` (its ``bytes_sent``);
- every generator rank writes ``<case>_gen<i>.safetensors`` (its local parameters) with metadata
  ``info`` = JSON {version, bytes_received, slices}.

Error cases (``ERROR_CASES``) write ``error_<case>_<executor><local rank>.txt``: the ValueError's message, or
``NO ERROR``. A crash exits non-zero (the test shows the output).
"""

import argparse
import json
import os
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import save_file
from tiny_model import build_tiny_llama
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard
from tp_layout import llama_tp_slices, narrow_to_slices

from llamarl.channels.ddma_plan import local_tensor
from llamarl.channels.weights import WeightsChannel
from llamarl.models.lora import AdapterView, LoraSpec
from llamarl.models.lora_merge import AdapterMerger
from llamarl.models.sharding import full_named_parameters, shard_model
from llamarl.runtime.executor import Executor
from llamarl.runtime.world import ExecutorContext, ExecutorSpec

# 131 / 40 / 71 / 20 (kv) are divisible by neither 2 nor 3 where it matters: uneven FSDP and TP shards.
SIZES = {"vocab_size": 131, "hidden_size": 40, "num_heads": 4, "num_kv_heads": 2, "intermediate_size": 71}
BUCKET_MB = 8 / 1024
ERROR_CASES = {"unknown": "'extra.weight' does not exist", "shape": "'model.embed_tokens.weight' is [131, 40]"}


def cases(num_generators: int) -> dict[str, dict]:
    """Case name -> {tied, trainer_dtype, dtype (generator's), layout (replica / tp / tp_dtensor), mode}."""
    out = {}
    layouts = ["replica", "tp"] if num_generators > 1 else ["replica"]
    for tied in (False, True):
        for dtype in ("float32", "bfloat16"):
            for layout in layouts:
                name = f"{'tied' if tied else 'untied'}_{dtype}_{layout}"
                out[name] = {"tied": tied, "trainer_dtype": "float32", "dtype": dtype, "layout": layout,
                             "mode": "ddma"}
                if layout == "replica":
                    out[f"{name}_gb"] = {**out[name], "mode": "gather_broadcast"}
                    out[f"{name}_gb_bucketed"] = {**out[name], "mode": "gather_broadcast", "bucket_mb": BUCKET_MB}
    # DDMA in bounded buckets (--weights.bucket-mb): 8 KiB, so every pair needs several rounds and
    # some pieces (the embedding's row blocks) exceed a bucket on their own.
    for layout in layouts:
        out[f"tied_bfloat16_{layout}_bucketed"] = {"tied": True, "trainer_dtype": "float32", "dtype": "bfloat16",
                                                   "layout": layout, "mode": "ddma", "bucket_mb": BUCKET_MB}
    # A streaming sink (a vLLM generator: layout on the meta device, weights handed over as they arrive).
    out["tied_bfloat16_stream"] = {"tied": True, "trainer_dtype": "float32", "dtype": "bfloat16",
                                   "layout": "stream", "mode": "ddma"}
    out["tied_bfloat16_stream_bucketed"] = {**out["tied_bfloat16_stream"], "bucket_mb": BUCKET_MB}
    out["untied_float32_stream_gb_bucketed"] = {"tied": False, "trainer_dtype": "float32", "dtype": "float32",
                                                "layout": "stream", "mode": "gather_broadcast",
                                                "bucket_mb": BUCKET_MB}
    out["untied_trainerbf16_float32_replica"] = {"tied": False, "trainer_dtype": "bfloat16", "dtype": "float32",
                                                 "layout": "replica", "mode": "ddma"}
    if num_generators > 1:
        out["untied_bfloat16_tp_dtensor"] = {"tied": False, "trainer_dtype": "float32", "dtype": "bfloat16",
                                             "layout": "tp_dtensor", "mode": "ddma"}
    return out


LORA = LoraSpec(rank=4, alpha=12.0)


def lora_cases(num_generators: int) -> dict[str, dict]:
    """LoRA (``--trainer.lora.rank``): only the adapters move and each generator rank merges them
    into its own weights; replicas (DDMA and gather-broadcast) and, with 2 generators, TP DTensors."""
    out = {}
    for tied in (False, True):
        for dtype in ("float32", "bfloat16"):
            name = f"lora_{'tied' if tied else 'untied'}_{dtype}_replica"
            out[name] = {"tied": tied, "dtype": dtype, "layout": "replica", "mode": "ddma"}
            out[f"{name}_gb"] = {**out[name], "mode": "gather_broadcast"}
            if num_generators > 1:
                out[name.replace("replica", "tp_dtensor")] = {**out[name], "layout": "tp_dtensor"}
    return out


def run_lora_case(ctx, out: Path, name: str, case: dict, num_generators: int) -> None:
    """The trainer adapts a tiny Llama (``LoraSpec.inject``), shards it, perturbs its adapters and
    syncs twice; a generator rank (its own base, seed 2) merges after each sync and writes its
    receive buffers, merged weights and the base it kept; the trainer writes the full adapters."""
    if ctx.executor not in ("trainer", "generator"):
        return
    channel = WeightsChannel("weights", "trainer", "generator", mode=case["mode"])
    if ctx.executor == "trainer":
        model = LORA.inject(build_tiny_llama(seed=1, tie_word_embeddings=case["tied"], **SIZES))
        LORA.initialise(model, seed=3)
        model = shard_model(model, ctx.mesh)
        toy = Toy(ctx, AdapterView(model))
        for step in range(2):
            with torch.no_grad():
                for param in model.parameters():
                    if param.requires_grad:  # B starts at zero: give it values, rank-dependent
                        local_tensor(param).add_(0.01 * (ctx.local_rank + 1) + 0.1 * step)
            toy.version = 10 * step + 7
            channel.communicate(ctx, toy)
        full = {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach()
                for n, p in AdapterView(model).named_parameters()}
        if ctx.local_rank == 0:
            save_file({k: v.contiguous() for k, v in full.items()}, out / f"{name}_trainer.safetensors")
        sent = [[src, dst, n] for (src, dst), n in channel.bytes_sent.items()]
        (out / f"{name}_trainer{ctx.local_rank}.json").write_text(json.dumps({"bytes_sent": sent}))
        return
    model = build_tiny_llama(seed=2, tie_word_embeddings=case["tied"], **SIZES).to(getattr(torch, case["dtype"]))
    if case["layout"] == "tp_dtensor":
        slices = llama_tp_slices(model, tp_rank=ctx.local_rank, tp_size=num_generators)
        narrow_to_slices(model, slices)
        to_dtensors(model, slices, ctx.mesh)
    merger = AdapterMerger(model, LORA)
    pointers = [local_tensor(p).data_ptr() for p in model.parameters()]

    class LoraToy(Toy):
        def set_weights_version(self, version):
            merger.merge()
            self.version = version

    toy = LoraToy(ctx, merger.view(), slices=merger.slices())
    for _ in range(2):
        channel.communicate(ctx, toy)
    tensors = {f"adapter/{n}": t.contiguous() for n, t in merger.tensors.items()}
    for module, target in merger.targets.items():
        tensors[f"merged/{module}"] = target.weight.detach().contiguous()
        tensors[f"base/{module}"] = target.base.contiguous()
    info = {"version": toy.version, "slices": merger.slices() or {}, "nbytes": merger.nbytes,
            "same_storage": pointers == [local_tensor(p).data_ptr() for p in model.parameters()],
            "bytes_received": [[src, dst, n] for (src, dst), n in channel.bytes_received.items()]}
    save_file(tensors, out / f"{name}_gen{ctx.local_rank}.safetensors", metadata={"info": json.dumps(info)})


class Toy(Executor):
    """Trainer or generator stand-in: a model, a version, and (TP generators) a slice spec."""

    def __init__(self, ctx, model, *, slices=None):
        super().__init__(ctx)
        self.model, self.slices, self.version = model, slices, 0

    def get_model(self):
        return self.model

    def get_weight_slices(self):
        return self.slices

    def set_weights_version(self, version):
        self.version = version


class StreamToy(Toy):
    """A generator that keeps no weights: its model is on the meta device (the layout) and its
    ``weight_sink`` keeps what each sync streams, as a vLLM generator hands it to vLLM."""

    def __init__(self, ctx, model):
        super().__init__(ctx, model)
        self.received: dict[str, torch.Tensor] = {}
        self.streams: list[dict] = []

    def weight_sink(self):
        def sink(named_tensors):
            seen = []
            for name, tensor in named_tensors:
                seen.append(name)
                self.received[name] = tensor
            self.streams.append({"count": len(seen), "unique": len(set(seen)),
                                 "devices": sorted({str(t.device) for t in self.received.values()})})
        return sink


def perturb(model, ctx, step: int) -> None:
    """Change every local shard in a rank- and step-dependent way (no collective)."""
    with torch.no_grad():
        for param in model.parameters():
            local = local_tensor(param)
            local.mul_(1.5).add_(0.001 * (ctx.local_rank + 1) + 0.01 * step)


def to_dtensors(model, slices, mesh) -> None:
    """Turn each sliced parameter into a DTensor ``Shard(dim)`` over ``mesh`` (its global shape kept)."""
    full = dict(build_tiny_llama(seed=2, **SIZES).named_parameters())
    for name, (dim, _, _) in slices.items():
        owner, _, leaf = name.rpartition(".")
        module = model.get_submodule(owner)
        local = getattr(module, leaf).detach()
        dt = DTensor.from_local(local, mesh, [Shard(dim)], run_check=False, shape=full[name].shape,
                                stride=full[name].stride())
        setattr(module, leaf, torch.nn.Parameter(dt))


def generator_model(ctx, case: dict, num_generators: int):
    model = build_tiny_llama(seed=2, tie_word_embeddings=case["tied"], **SIZES).to(getattr(torch, case["dtype"]))
    slices = None
    if case["layout"] != "replica":
        slices = llama_tp_slices(model, tp_rank=ctx.local_rank, tp_size=num_generators)
        narrow_to_slices(model, slices)
        if case["layout"] == "tp_dtensor":
            to_dtensors(model, slices, ctx.mesh)
            return model, None, slices
    return model, slices, slices


def sub_context(ctx: ExecutorContext, *, generators: int, trainers: int) -> ExecutorContext:
    """A split over ``ctx``'s first generator / trainer ranks; the rest are executor ``idle``.

    Collective over WORLD (``new_group``): every rank calls it, with the same arguments, in order.
    """
    ranks = {"generator": ctx.ranks["generator"][:generators], "trainer": ctx.ranks["trainer"][:trainers]}
    ranks["idle"] = [r for r in range(ctx.world_size) if r not in ranks["generator"] + ranks["trainer"]]
    groups = {name: dist.new_group(rs, timeout=timedelta(seconds=120)) for name, rs in ranks.items() if rs}
    executor = next(name for name, rs in ranks.items() if ctx.rank in rs)
    mesh = DeviceMesh.from_group(groups[executor], ctx.device.type, mesh=ranks[executor])
    return ExecutorContext(rank=ctx.rank, world_size=ctx.world_size, executor=executor, ranks=ranks,
                           group=groups[executor], mesh=mesh, device=ctx.device)


def run_case(ctx, out: Path, name: str, case: dict, num_generators: int) -> None:
    if ctx.executor not in ("trainer", "generator"):
        return
    channel = WeightsChannel("weights", "trainer", "generator", mode=case["mode"], bucket_mb=case.get("bucket_mb", 0.0))
    if ctx.executor == "trainer":
        model = build_tiny_llama(seed=1, tie_word_embeddings=case["tied"], **SIZES)
        model = shard_model(model.to(getattr(torch, case["trainer_dtype"])), ctx.mesh)
        toy = Toy(ctx, model)
        for step in range(2):
            perturb(model, ctx, step)
            toy.version = 10 * step + 7
            channel.communicate(ctx, toy)
        full = full_named_parameters(model)  # collective over the trainer group
        if ctx.local_rank == 0:
            save_file({k: v.contiguous() for k, v in full.items()}, out / f"{name}_trainer.safetensors")
        sent = [[src, dst, n] for (src, dst), n in channel.bytes_sent.items()]
        (out / f"{name}_trainer{ctx.local_rank}.json").write_text(json.dumps({"bytes_sent": sent,
                                                                               **bucket_info(channel)}))
    elif case["layout"] == "stream":
        model = build_tiny_llama(seed=2, tie_word_embeddings=case["tied"], **SIZES).to(getattr(torch, case["dtype"]))
        model = model.to("meta")
        model.tie_weights()  # moving to meta unties; the layout must list the tied weight once
        toy = StreamToy(ctx, model)
        for _ in range(2):
            channel.communicate(ctx, toy)
        info = {"version": toy.version, "slices": {}, **bucket_info(channel), "streams": toy.streams,
                "meta": all(p.is_meta for p in model.parameters()),
                "bytes_received": [[src, dst, n] for (src, dst), n in channel.bytes_received.items()]}
        tensors = {n: t.contiguous() for n, t in toy.received.items()}
        save_file(tensors, out / f"{name}_gen{ctx.local_rank}.safetensors", metadata={"info": json.dumps(info)})
    else:
        model, exposed, slices = generator_model(ctx, case, num_generators)
        toy = Toy(ctx, model, slices=exposed)
        for _ in range(2):
            channel.communicate(ctx, toy)
        info = {"version": toy.version, "slices": slices or {}, **bucket_info(channel),
                "bytes_received": [[src, dst, n] for (src, dst), n in channel.bytes_received.items()]}
        tensors = {n: local_tensor(p).detach().contiguous() for n, p in model.named_parameters()}
        save_file(tensors, out / f"{name}_gen{ctx.local_rank}.safetensors", metadata={"info": json.dumps(info)})


def bucket_info(channel: WeightsChannel) -> dict:
    """DDMA rounds, this rank's buffer bytes (each allocated once) and its largest single piece."""
    if channel.mode != "ddma":
        return {}
    buffers = {id(b.buffer): b.buffer.numel() for buckets in channel._rounds for b in buckets}
    pieces = [p.numel * b.dtype.itemsize for buckets in channel._rounds for b in buckets for p in b.pieces]
    return {"rounds": channel.plan_rounds, "buffer_bytes": sorted(buffers.values()),
            "largest_piece": max(pieces, default=0)}


def run_error_case(ctx, out: Path, name: str) -> None:
    if ctx.executor not in ("trainer", "generator"):
        return
    channel = WeightsChannel("weights", "trainer", "generator")
    if ctx.executor == "trainer":
        toy = Toy(ctx, shard_model(build_tiny_llama(seed=1, **SIZES), ctx.mesh))
    else:
        sizes = {**SIZES, "vocab_size": 132} if name == "shape" else SIZES
        model = build_tiny_llama(seed=2, **sizes)
        if name == "unknown":
            model.extra = torch.nn.Linear(2, 2)
        toy = Toy(ctx, model)
    try:
        channel.communicate(ctx, toy)
        message = "NO ERROR"
    except ValueError as err:
        message = str(err)
    (out / f"error_{name}_{ctx.executor}{ctx.local_rank}.txt").write_text(message)


def parse_split(text: str) -> tuple[int, int]:
    """``"G:T"``: G generator ranks, T trainer ranks."""
    generators, trainers = text.split(":")
    return int(generators), int(trainers)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--out", type=Path, required=True, help="each split writes into OUT_DIR/<T>to<G>/")
    parser.add_argument("--splits", type=parse_split, nargs="+", required=True, metavar="G:T",
                        help="the first covers the world; each further one takes its first G' and T' ranks")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    out, splits = args.out, args.splits
    ctx = ExecutorContext.create([ExecutorSpec("generator", splits[0][0]),
                                  ExecutorSpec("trainer", int(os.environ["WORLD_SIZE"]) - splits[0][0])],
                                 timeout_s=60)
    for index, (generators, trainers) in enumerate(splits):
        split = ctx if index == 0 else sub_context(ctx, generators=generators, trainers=trainers)
        split_dir = out / f"{trainers}to{generators}"
        split_dir.mkdir(parents=True, exist_ok=True)
        for name, case in cases(generators).items():
            run_case(split, split_dir, name, case, generators)
        for name, case in lora_cases(generators).items():
            run_lora_case(split, split_dir, name, case, generators)
        for name in ERROR_CASES:
            run_error_case(split, split_dir, name)
    ctx.destroy()


if __name__ == "__main__":
    main()
