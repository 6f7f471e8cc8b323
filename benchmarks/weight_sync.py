"""Weight sync time: DDMA vs gather_broadcast vs a local-memcpy lower bound (gloo, CPU).

Not a test. Usage::

    .venv/bin/python benchmarks/weight_sync.py [--sizes 50m,200m,1b] [--layouts 1->1,2->1,2->2,4->2tp]
        [--repeats 5] [--out rows.json] [--plot sync.png] [--mem-budget-gb 12]

Models are synthetic Llama shapes (``transformers.LlamaConfig``, untied embeddings) built on the
meta device, so every rank allocates only what it holds: the trainer an FSDP2 ``Shard(0)`` shard
(``--trainer-dtype``, default fp32), a generator rank a replica or, for ``T->Gtp`` layouts, a
Megatron-style TP shard over all G generator ranks (``llama_tp_slices``) in ``--dtype`` (default
bf16). One torchrun world per layout (``T + G`` CPU ranks, ``OMP_NUM_THREADS=1``) runs every size.

Per (layout, size): one warm-up sync (handshake, plan, buckets), then ``--repeats`` timed syncs,
each between two world barriers; ``seconds_median`` is the median. ``memcpy_bound`` is a local
``copy_`` of the bytes generator rank 0 must receive (the floor for any transport).
For TP layouts ``gather_broadcast`` sends every generator rank the full model and each keeps its
slice (the peers' way of feeding TP engines). A (layout, size,
mode) whose estimated peak memory (all ranks together) exceeds ``--mem-budget-gb`` is skipped.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
SIZES = {  # name -> LlamaConfig kwargs
    "50m": {"hidden_size": 512, "intermediate_size": 1408, "num_hidden_layers": 8, "num_attention_heads": 8,
            "num_key_value_heads": 4},
    "200m": {"hidden_size": 1024, "intermediate_size": 2816, "num_hidden_layers": 12, "num_attention_heads": 16,
             "num_key_value_heads": 8},
    "1b": {"hidden_size": 2048, "intermediate_size": 5632, "num_hidden_layers": 22, "num_attention_heads": 32,
           "num_key_value_heads": 4},  # TinyLlama-1.1B shapes
}
MODES = ("ddma", "gather_broadcast", "memcpy_bound")
RANK_OVERHEAD_BYTES = 450 << 20  # resident torch + transformers per process


def parse_layout(layout: str) -> tuple[int, int, bool]:
    """``"4->2tp"`` -> (trainer ranks 4, generator ranks 2, tensor-parallel True)."""
    try:
        trainers, generators = layout.split("->")
        tp = generators.endswith("tp")
        return int(trainers), int(generators.removesuffix("tp")), tp
    except ValueError:
        raise ValueError(f"layout {layout!r} is not T->G or T->Gtp") from None


def meta_llama(size: str, *, dtype: torch.dtype):
    """An untied Llama of ``SIZES[size]`` on the meta device (no memory)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=32000, tie_word_embeddings=False, **SIZES[size])
    with torch.device("meta"):
        return LlamaForCausalLM(config).to(dtype)


def generator_numels(size: str, *, generators: int, tp: bool) -> list[int]:
    """Elements each generator rank holds."""
    from llamarl.channels.ddma_plan import llama_tp_slices

    model = meta_llama(size, dtype=torch.float32)
    total = sum(p.numel() for p in model.parameters())
    if not tp:
        return [total] * generators
    out = []
    for rank in range(generators):
        slices = llama_tp_slices(model, tp_rank=rank, tp_size=generators)
        params = dict(model.named_parameters())
        out.append(total - sum(params[n].numel() - params[n].numel() // params[n].shape[d] * length
                               for n, (d, _, length) in slices.items()))
    return out


def estimate_bytes(size: str, *, layout: str, mode: str, trainer_bytes: int, gen_bytes: int) -> int:
    """Peak resident bytes of the whole world while ``mode`` runs (models, buckets, gathers)."""
    trainers, generators, tp = parse_layout(layout)
    numels = generator_numels(size, generators=generators, tp=tp)
    total = generator_numels(size, generators=1, tp=False)[0]
    base = total * trainer_bytes + sum(numels) * gen_bytes + (trainers + generators) * RANK_OVERHEAD_BYTES
    if mode == "ddma":  # send buckets (replicas share one) + one receive bucket per generator rank
        send = total * gen_bytes if not tp else sum(numels) * gen_bytes
        return base + send + sum(numels) * gen_bytes
    if mode == "gather_broadcast":  # full fp32 model on every trainer rank + leader bucket + receive buckets
        return base + trainers * total * trainer_bytes + total * gen_bytes + generators * total * gen_bytes
    return base + 2 * numels[0] * gen_bytes


# ----- worker (one rank of a torchrun world) -----
class _Holder:
    """Minimal executor surface the WeightsChannel needs."""

    def __init__(self, model):
        self.model, self.version, self.slices = model, 0, None

    def get_model(self):
        return self.model

    def get_weight_slices(self):
        return self.slices

    def set_weights_version(self, version):
        self.version = version


def _timed(fn, *fn_args, repeats: int) -> list[float]:
    """Wall seconds of ``fn(*fn_args)`` on this rank, each call between two world barriers."""
    import torch.distributed as dist

    times = []
    for _ in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        fn(*fn_args)
        dist.barrier()
        times.append(time.perf_counter() - start)
    return times


def _build(ctx, size: str, *, tp: bool, trainer_dtype, gen_dtype) -> _Holder:
    from llamarl.channels.ddma_plan import llama_tp_slices, local_tensor, narrow_to_slices
    from llamarl.models.sharding import shard_model

    if ctx.executor == "trainer":
        model = shard_model(meta_llama(size, dtype=trainer_dtype), ctx.mesh)
        holder = _Holder(model.to_empty(device=ctx.device))
    else:
        model = meta_llama(size, dtype=gen_dtype)
        holder = _Holder(model)
        if tp:
            holder.slices = llama_tp_slices(model, tp_rank=ctx.local_rank, tp_size=ctx.local_world_size)
            narrow_to_slices(model, holder.slices)
        model.to_empty(device=ctx.device)
    with torch.no_grad():  # touch every page once, so the first timed sync does not pay for it
        for param in holder.model.parameters():
            local_tensor(param).fill_(0.02)
    return holder


def worker(args) -> None:
    """Run every size of ``args.sizes`` for one layout; global rank 0 writes rows to ``args.json``."""
    import torch.distributed as dist

    from llamarl.channels.weights import WeightsChannel
    from llamarl.world import ExecutorContext, ExecutorSpec

    trainers, generators, tp = parse_layout(args.layout)
    ctx = ExecutorContext.create([ExecutorSpec("generator", generators), ExecutorSpec("trainer", trainers)],
                                 timeout_s=1800)
    trainer_dtype, gen_dtype = getattr(torch, args.trainer_dtype), getattr(torch, args.dtype)
    rows = []
    for size in args.sizes.split(","):
        modes = [m for m in MODES if m not in args.skip.get(size, [])]
        if not modes:
            continue
        holder = _build(ctx, size, tp=tp, trainer_dtype=trainer_dtype, gen_dtype=gen_dtype)
        num_params = generator_numels(size, generators=1, tp=False)[0]
        for mode in modes:
            if mode == "memcpy_bound":
                nbytes = sum(local_bytes(p) for p in holder.model.parameters()) if ctx.rank == 0 else 0
                src, dst = torch.ones(nbytes, dtype=torch.uint8), torch.empty(nbytes, dtype=torch.uint8)
                times = _timed(dst.copy_ if ctx.rank == 0 else lambda _: None, src, repeats=args.repeats)
                del src, dst
            else:
                channel = WeightsChannel("weights", "trainer", "generator", mode=mode)
                channel.communicate(ctx, holder)  # warm-up: handshake, plan, buckets
                times = _timed(channel.communicate, ctx, holder, repeats=args.repeats)
                del channel
            gc.collect()
            rows.append({"layout": args.layout, "size": size, "num_params": num_params, "mode": mode,
                         "seconds_median": statistics.median(times), "seconds": times})
            if ctx.rank == 0:
                print(f"{args.layout} {size} {mode}: {statistics.median(times):.3f} s", flush=True)
        del holder
        gc.collect()
    if ctx.rank == 0:
        Path(args.json).write_text(json.dumps(rows))
    dist.barrier()
    ctx.destroy()


def local_bytes(param: torch.Tensor) -> int:
    """Bytes this rank holds of ``param``."""
    from llamarl.channels.ddma_plan import local_tensor

    local = local_tensor(param)
    return local.numel() * local.element_size()


# ----- driver -----
def _launch(layout: str, args, skip: dict[str, list[str]], json_path: Path) -> list[dict]:
    trainers, generators, _ = parse_layout(layout)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO), "TOKENIZERS_PARALLELISM": "false"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={trainers + generators}",
           "--monitor-interval=0.5", __file__, "--worker", "--layout", layout, "--sizes", args.sizes,
           "--repeats", str(args.repeats), "--dtype", args.dtype, "--trainer-dtype", args.trainer_dtype,
           "--skip-json", json.dumps(skip), "--json", str(json_path)]
    # A session of its own, so a timeout can end this world (and only it) by its process group id.
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, start_new_session=True)
    try:
        code = proc.wait(timeout=args.timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        raise RuntimeError(f"layout {layout} ran past --timeout {args.timeout} s") from None
    if code != 0:
        raise RuntimeError(f"layout {layout}: torchrun exited {code}")
    return json.loads(json_path.read_text())


def print_table(rows: list[dict], skipped: list[tuple[str, str, str, float]]) -> None:
    """One line per (layout, size): the three medians and ddma's speed-up over gather_broadcast."""
    table: dict[tuple[str, str], dict] = {}
    for row in rows:
        table.setdefault((row["layout"], row["size"]), {"num_params": row["num_params"]})[row["mode"]] = \
            row["seconds_median"]
    print(f"{'layout':>8} {'size':>5} {'params':>8} {'ddma s':>9} {'gather_bc s':>11} {'memcpy s':>9} "
          f"{'gb/ddma':>8}")
    def cell(cells, mode, width):
        return f"{cells[mode]:>{width}.3f}" if mode in cells else f"{'-':>{width}}"

    for (layout, size), cells in table.items():
        ratio = cells["gather_broadcast"] / cells["ddma"] if {"ddma", "gather_broadcast"} <= cells.keys() else None
        print(f"{layout:>8} {size:>5} {cells['num_params'] / 1e6:>7.0f}M {cell(cells, 'ddma', 9)} "
              f"{cell(cells, 'gather_broadcast', 11)} {cell(cells, 'memcpy_bound', 9)} "
              f"{f'{ratio:.2f}x' if ratio else '-':>8}")
    for layout, size, mode, gib in skipped:
        print(f"skipped {layout} {size} {mode}: estimated {gib:.1f} GiB > --mem-budget-gb")


def plot(rows: list[dict], path: Path) -> None:
    """Seconds vs parameters, one panel per layout, one line per mode (log-log)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    layouts = list(dict.fromkeys(r["layout"] for r in rows))
    fig, axes = plt.subplots(1, len(layouts), figsize=(4 * len(layouts), 3.5), squeeze=False, sharey=True)
    for ax, layout in zip(axes[0], layouts):
        for color, mode in zip(("tab:blue", "tab:orange", "tab:green"), MODES):
            points = sorted((r["num_params"], r["seconds_median"]) for r in rows
                            if r["layout"] == layout and r["mode"] == mode)
            if points:
                ax.plot(*zip(*points), marker="o", label=mode, color=color)  # same colour in every panel
        ax.set(title=layout, xscale="log", yscale="log", xlabel="parameters")
    axes[0][0].set_ylabel("seconds per sync (median)")
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    """Driver (default) or one world's rank (``--worker``); see the module docstring."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="50m,200m,1b")
    parser.add_argument("--layouts", default="1->1,2->1,2->2,4->2tp")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dtype", default="bfloat16", help="generator dtype")
    parser.add_argument("--trainer-dtype", default="float32")
    parser.add_argument("--mem-budget-gb", type=float, default=12.0)
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per layout")
    parser.add_argument("--out", type=Path, help="write the rows as JSON here")
    parser.add_argument("--plot", type=Path, help="PNG path (default: --out with .png)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--layout", help=argparse.SUPPRESS)
    parser.add_argument("--json", help=argparse.SUPPRESS)
    parser.add_argument("--skip-json", default="{}", help=argparse.SUPPRESS)
    args = parser.parse_args()
    for size in args.sizes.split(","):
        if size not in SIZES:
            raise SystemExit(f"unknown size {size!r}; have {list(SIZES)}")
    if args.worker:
        args.skip = json.loads(args.skip_json)
        worker(args)
        return

    trainer_bytes, gen_bytes = getattr(torch, args.trainer_dtype).itemsize, getattr(torch, args.dtype).itemsize
    rows, skipped = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for layout in args.layouts.split(","):
            skip: dict[str, list[str]] = {}
            for size in args.sizes.split(","):
                skip[size] = []
                for mode in MODES:
                    need = estimate_bytes(size, layout=layout, mode=mode, trainer_bytes=trainer_bytes,
                                          gen_bytes=gen_bytes)
                    if mode not in skip[size] and need > args.mem_budget_gb * 2**30:
                        skip[size].append(mode)
                        skipped.append((layout, size, mode, need / 2**30))
            rows += _launch(layout, args, skip, Path(tmp) / f"{len(rows)}.json")
    print_table(rows, skipped)
    if args.out:
        args.out.write_text(json.dumps([{k: r[k] for k in ("layout", "num_params", "mode", "seconds_median")}
                                        | {"size": r["size"], "seconds": r["seconds"]} for r in rows], indent=1))
    plot_path = args.plot or (args.out.with_suffix(".png") if args.out else None)
    if plot_path:
        try:
            plot(rows, plot_path)
        except ImportError:
            print("matplotlib is not installed: no plot", file=sys.stderr)


if __name__ == "__main__":
    main()
