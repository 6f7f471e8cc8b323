"""Weight sync time: DDMA vs gather_broadcast vs a local-memcpy lower bound (gloo, CPU).

Not a test. Usage::

    .venv/bin/python benchmarks/weight_sync.py [--sizes 50m,200m,1b] [--layouts 1->1,2->1,2->2,4->2tp]
        [--repeats 5] [--out rows.json] [--plot sync.png] [--mem-budget-gb 12] [--lora-rank 8]

Models are synthetic Llama shapes (``transformers.LlamaConfig``, untied embeddings) built on the
meta device, so every rank allocates only what it holds: the trainer an FSDP2 ``Shard(0)`` shard
(``--trainer-dtype``, default fp32), a generator rank a replica or, for ``T->Gtp`` layouts, a
Megatron-style TP shard over all G generator ranks (``llama_tp_slices``) in ``--dtype`` (default
bf16). One torchrun world per layout (``T + G`` CPU ranks, ``OMP_NUM_THREADS=1``) runs every size.

Per (layout, size): ``memcpy_bound`` first, ``--repeats`` local ``copy_`` of the bytes generator
rank 0 must receive (the floor for any transport; timed on that rank alone, no barriers), then per
mode one warm-up sync (handshake, plan, buckets) and ``--repeats`` timed syncs, each between two
world barriers; ``seconds_median`` is the median.

Every sync is a real one: before each (outside the timed region) the trainer bumps its weight
version, which the channel would otherwise skip as unchanged, and refills each parameter with a
value unique to (parameter, version) (``pattern_value``). After each, every rank checks that the
sync was not skipped, that each generator rank received exactly the bytes its layout needs (its own
shard for ``ddma``, the whole model for ``gather_broadcast``), that the trainer ranks sent what the
generator ranks received, and that every generator element now holds the new version's value; then
that no timed sync beat the fastest memcpy of the same bytes (enforced where that copy takes at
least ``BOUND_CHECK_MIN_S``; below it scheduling and timer noise is of the order of the bound). Any
failure ends the run with the reason. Rows record ``bytes_per_sync`` (all generator ranks together;
memcpy_bound: the bytes copied) and ``memcpy_ratio`` (median seconds over memcpy_bound's median).

For TP layouts ``gather_broadcast`` sends every generator rank the full model and each keeps its
slice (the peers' way of feeding TP engines). A (layout, size,
mode) whose estimated peak memory (all ranks together) exceeds ``--mem-budget-gb`` is skipped.
Size ``tiny`` (a 1k vocabulary, 2 layers) exists for the smoke test, not for timing.

``--lora-rank R`` adds, per (layout, size), modes ``ddma_lora`` and ``gather_broadcast_lora``: the
same channel modes moving only LoRA adapters (rank R, alpha 2R, every decoder linear), each sync
followed by the generator ranks' in-place merge, timed on its own (``merge_seconds_median``, between
world barriers) and checked exactly (``weight_sync_lora.py``). Their rows add ``bytes_ratio_to_full``
and ``seconds_ratio_to_full`` / ``with_merge_ratio_to_full`` (over the full ``ddma`` row); no memcpy
floor applies (the adapters are far fewer bytes than the bound's copy).
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
from collections.abc import Callable
from pathlib import Path

import torch
from weight_sync_lora import LORA_MODES
from weight_sync_lora import print_table as print_lora_table

REPO = Path(__file__).resolve().parents[1]
if str(REPO / "tests") not in sys.path:  # tp_layout: the TP stand-in the weight-channel tests use too
    sys.path.insert(0, str(REPO / "tests"))
SIZES = {  # name -> LlamaConfig kwargs (vocab_size 32000 unless given)
    "tiny": {"vocab_size": 1024, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
             "num_attention_heads": 4, "num_key_value_heads": 2},
    "50m": {"hidden_size": 512, "intermediate_size": 1408, "num_hidden_layers": 8, "num_attention_heads": 8,
            "num_key_value_heads": 4},
    "200m": {"hidden_size": 1024, "intermediate_size": 2816, "num_hidden_layers": 12,
             "num_attention_heads": 16, "num_key_value_heads": 8},
    "1b": {"hidden_size": 2048, "intermediate_size": 5632, "num_hidden_layers": 22, "num_attention_heads": 32,
           "num_key_value_heads": 4},  # TinyLlama-1.1B shapes
}
MODES = ("ddma", "gather_broadcast", "memcpy_bound")
RUN_ORDER = ("memcpy_bound", "ddma", "gather_broadcast")  # the bound first: every sync is checked against it
RANK_OVERHEAD_BYTES = 450 << 20  # resident torch + transformers per process
BOUND_CHECK_MIN_S = 0.005
"""The floor check is enforced only when the fastest memcpy takes at least this long."""


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

    config = LlamaConfig(**{"vocab_size": 32000, **SIZES[size]}, tie_word_embeddings=False)
    with torch.device("meta"):
        return LlamaForCausalLM(config).to(dtype)


def generator_numels(size: str, *, generators: int, tp: bool) -> list[int]:
    """Elements each generator rank holds."""
    from tp_layout import llama_tp_slices

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


def estimate_bytes(size: str, *, layout: str, mode: str, trainer_bytes: int, gen_bytes: int,
                   lora_rank: int = 0) -> int:
    """Peak resident bytes of the whole world while ``mode`` runs (models, buckets, gathers)."""
    trainers, generators, tp = parse_layout(layout)
    numels = generator_numels(size, generators=generators, tp=tp)
    total = generator_numels(size, generators=1, tp=False)[0]
    base = total * trainer_bytes + sum(numels) * gen_bytes + (trainers + generators) * RANK_OVERHEAD_BYTES
    if mode in LORA_MODES:  # + the merger's base copies; adapters in fp32 a few times over on every rank
        from weight_sync_lora import adapter_counts

        adapters, adapted = adapter_counts(meta_llama(size, dtype=torch.float32), lora_rank)
        return base + adapted * gen_bytes * (1 if tp else generators) + 4 * adapters * 4 * (trainers + generators)
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


def pattern_value(index: int, version: int) -> float:
    """What every element of parameter ``index`` (in sorted-name order) holds at weight ``version``.

    ``n / 128`` with ``1 <= n <= 251``: exact in fp32, bf16 and fp16, so a generator compares for
    equality; distinct across up to 251 parameters of one version, and never the previous version's
    value (a step of 7 is not a multiple of 251).
    """
    return ((index + 7 * version) % 251 + 1) / 128


def _sorted_params(model) -> list[tuple[str, torch.Tensor]]:
    return sorted(model.named_parameters(), key=lambda item: item[0])


def _set_version(holder: _Holder, version: int) -> None:
    """Trainer: a new weight version with new weights (``pattern_value``), so the next sync is real."""
    from llamarl.channels.ddma_plan import local_tensor

    with torch.no_grad():
        for index, (_, param) in enumerate(_sorted_params(holder.model)):
            local_tensor(param).fill_(pattern_value(index, version))
    holder.version = version


def _check_sync(ctx, channel, holder: _Holder, *, version: int, expected_bytes: int) -> str | None:
    """Why the sync of ``version`` that just ran on this rank did not happen as it must, or None.

    A generator rank must have received exactly ``expected_bytes`` and hold ``pattern_value`` of
    ``version`` in every element it owns.
    """
    from llamarl.channels.ddma_plan import local_tensor

    if channel.last_skipped:
        return f"version {version}: the channel skipped the sync"
    if ctx.executor == "trainer":
        return None
    received = sum(channel.bytes_received.values())
    if received != expected_bytes:
        return f"version {version}: received {received} bytes, the layout needs {expected_bytes}"
    if holder.version != version:
        return f"version {version}: the generator was told version {holder.version}"
    for index, (name, param) in enumerate(_sorted_params(holder.model)):
        local = local_tensor(param)
        if local.numel() == 0:
            continue
        low, high = (x.item() for x in torch.aminmax(local))
        if low != pattern_value(index, version) or high != low:
            return (f"version {version}: {name} holds values in [{low}, {high}], "
                    f"expected {pattern_value(index, version)} everywhere")
    return None


def _gather(obj) -> list:
    """``obj`` (JSON-serialisable) of every rank, in rank order (a collective over the world).

    JSON bytes in uint8 tensors, not ``all_gather_object``: nothing is unpickled from the wire."""
    import torch.distributed as dist

    payload = torch.frombuffer(bytearray(json.dumps(obj).encode()), dtype=torch.uint8)
    sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(dist.get_world_size())]
    dist.all_gather(sizes, torch.tensor([payload.numel()], dtype=torch.int64))
    width = max(int(size) for size in sizes)
    buffers = [torch.zeros(width, dtype=torch.uint8) for _ in sizes]
    dist.all_gather(buffers, torch.nn.functional.pad(payload, (0, width - payload.numel())))
    return [json.loads(bytes(buf[: int(size)].tolist()).decode()) for buf, size in zip(buffers, sizes)]


def _raise_if(errors: list[str | None]) -> None:
    """The same RuntimeError on every rank (they all hold the same ``errors``) if any is set."""
    failed = [f"rank {rank}: {e}" for rank, e in enumerate(errors) if e]
    if failed:
        raise RuntimeError("weight-sync benchmark: " + "; ".join(failed))


def check_floor(times: list[float], bound_times: list[float] | None, *, label: str) -> str | None:
    """Why ``times`` cannot be real syncs of the bytes that ``bound_times`` copied, or None.

    Every real sync copies at least those bytes, so none may take less than the fastest copy; a faster
    one means a sync that moved nothing was timed. Not enforced (None) without a bound or when the
    fastest copy took under ``BOUND_CHECK_MIN_S``, where scheduling and timer noise is of its order.
    """
    if not bound_times or min(bound_times) < BOUND_CHECK_MIN_S:
        return None
    floor = min(bound_times)
    fast = [t for t in times if t < floor]
    if fast:
        return (f"{label}: {len(fast)} of {len(times)} timed syncs took as little as {min(fast):.4f} s, "
                f"below the memcpy bound {floor:.4f} s: a sync that moved nothing was timed")
    return None


def _timed(fn: Callable[[], object], *, repeats: int, before: Callable[[int], object] = lambda k: None,
           after: Callable[[int], object] = lambda k: None) -> list[float]:
    """Wall seconds of ``fn()`` on this rank, each call between two world barriers.

    ``before(k)`` / ``after(k)`` run outside the timed region, around the ``k``-th call.
    """
    import torch.distributed as dist

    times = []
    for k in range(repeats):
        before(k)
        dist.barrier()
        start = time.perf_counter()
        fn()
        dist.barrier()
        times.append(time.perf_counter() - start)
        after(k)
    return times


def _memcpy_times(nbytes: int, *, repeats: int) -> list[float]:
    """Global rank 0's wall seconds for ``repeats`` local copies of ``nbytes`` (on every rank).

    Timed on rank 0 alone, without barriers: a world barrier on a loaded machine can take longer than
    a small copy, and the bound must be a floor that every real sync's copies cannot beat.
    """
    import torch.distributed as dist

    src, dst = torch.ones(nbytes, dtype=torch.uint8), torch.empty(nbytes, dtype=torch.uint8)
    dst.copy_(src)  # fault the destination's pages in before timing
    dist.barrier()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - start)
    return _gather(times)[0]


def _build(ctx, size: str, *, tp: bool, trainer_dtype, gen_dtype) -> _Holder:
    from tp_layout import llama_tp_slices, narrow_to_slices

    from llamarl.channels.ddma_plan import local_tensor
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
            local_tensor(param).fill_(0.02)  # not a pattern_value: the warm-up sync must change it
    return holder


def _run_mode(ctx, holder: _Holder, mode: str, *, repeats: int, version: int, expected_bytes: int,
              bound_times: list[float] | None, merger=None) -> tuple[list[float], int, list[float]]:
    """Warm-up plus ``repeats`` timed syncs of ``mode`` from ``version + 1`` on, each checked.

    LoRA modes (``*_lora``): after each sync the generator ranks' ``merger`` (None on trainer
    ranks) merges, timed on its own between world barriers, and the merged weights are checked.
    Returns this rank's times, the bytes all generator ranks received per sync and the merge times.
    """
    from weight_sync_lora import check_merged

    from llamarl.channels.weights import WeightsChannel

    lora = mode in LORA_MODES
    channel = WeightsChannel("weights", "trainer", "generator", mode=mode.removesuffix("_lora"))
    per_sync: set[int] = set()
    merge_times: list[float] = []

    def before(k: int) -> None:
        if ctx.executor == "trainer":
            _set_version(holder, version + 1 + k)

    def after(k: int) -> None:
        if lora:
            merge_times.append(_timed(merger.merge if merger else lambda: None, repeats=1)[0])
        # One collective: every rank's verdict and byte counts, so all ranks raise together.
        error = _check_sync(ctx, channel, holder, version=version + 1 + k, expected_bytes=expected_bytes)
        if error is None and merger is not None:
            error = check_merged(merger, version=version + 1 + k, value=pattern_value)
        sent = sum(channel.bytes_sent.values()) if ctx.executor == "trainer" else 0
        received = sum(channel.bytes_received.values()) if ctx.executor == "generator" else 0
        reports = _gather((error, sent, received))
        _raise_if([r[0] for r in reports])
        sent_all, received_all = sum(r[1] for r in reports), sum(r[2] for r in reports)
        if sent_all != received_all:
            _raise_if([(f"{mode} version {version + 1 + k}: trainer ranks sent {sent_all} bytes, "
                        f"generator ranks received {received_all}")])
        per_sync.add(received_all)

    before(0)
    channel.communicate(ctx, holder)  # warm-up: handshake, plan, buckets
    after(0)
    times = _timed(lambda: channel.communicate(ctx, holder), repeats=repeats,
                   before=lambda k: before(k + 1), after=lambda k: after(k + 1))
    # Rank 0's verdict for all (its times are the ones reported).
    _raise_if([_gather(check_floor(times, bound_times, label=mode) if ctx.rank == 0 else None)[0]])
    (nbytes,) = per_sync  # the same layout moves the same bytes every sync
    return times, nbytes, merge_times[1:]  # not the warm-up's merge


def _build_lora(ctx, size: str, *, tp: bool, rank: int, trainer_dtype, gen_dtype):
    """``(holder, merger)``: the trainer's ``AdapterView`` (merger None) or a generator rank's
    receive buffers and their ``AdapterMerger`` (``weight_sync_lora.py``)."""
    from weight_sync_lora import build_generator, build_trainer

    if ctx.executor == "trainer":
        return _Holder(build_trainer(ctx, meta_llama(size, dtype=trainer_dtype), rank, fill=0.02)), None
    model, merger = build_generator(ctx, meta_llama(size, dtype=gen_dtype), rank, tp=tp, fill=0.02)
    holder = _Holder(merger.view())
    holder.slices, holder.generation_model = merger.slices(), model
    return holder, merger


def worker(args) -> None:
    """Run every size of ``args.sizes`` for one layout; global rank 0 writes rows to ``args.json``."""
    import torch.distributed as dist
    from weight_sync_lora import adapter_counts, add_ratios

    from llamarl.runtime.world import ExecutorContext, ExecutorSpec

    trainers, generators, tp = parse_layout(args.layout)
    ctx = ExecutorContext.create([ExecutorSpec("generator", generators), ExecutorSpec("trainer", trainers)],
                                 timeout_s=1800)
    trainer_dtype, gen_dtype = getattr(torch, args.trainer_dtype), getattr(torch, args.dtype)
    rows = []

    def record(size: str, mode: str, times: list[float], nbytes: int, bound_times, merge_times=None) -> None:
        median = statistics.median(times)
        ratio = median / statistics.median(bound_times) if bound_times else None
        rows.append({"layout": args.layout, "size": size, "num_params": num_params, "mode": mode,
                     "seconds_median": median, "seconds": times, "bytes_per_sync": nbytes, "memcpy_ratio": ratio,
                     "floor_checked": bool(bound_times) and min(bound_times) >= BOUND_CHECK_MIN_S})
        if merge_times is not None:
            rows[-1].update(lora_rank=args.lora_rank, merge_seconds_median=statistics.median(merge_times),
                            merge_seconds=merge_times)
        if ctx.rank == 0:
            print(f"{args.layout} {size} {mode}: {median:.3f} s, {nbytes / 1e6:.{1 if nbytes > 1e7 else 3}f} MB per sync"
                  + (f", {ratio:.2f}x memcpy" if ratio else "")
                  + (f", merge {rows[-1]['merge_seconds_median']:.3f} s" if merge_times is not None else ""),
                  flush=True)

    for size in args.sizes.split(","):
        modes = [m for m in RUN_ORDER if m not in args.skip.get(size, [])]
        lora_modes = [m for m in LORA_MODES if args.lora_rank > 0 and m not in args.skip.get(size, [])]
        num_params = generator_numels(size, generators=1, tp=False)[0]
        version = 0
        if modes:
            holder = _build(ctx, size, tp=tp, trainer_dtype=trainer_dtype, gen_dtype=gen_dtype)
            # What one sync must deliver to this generator rank: its own shard (ddma), the whole model
            # (gather_broadcast, TP layouts included).
            mine = sum(local_bytes(p) for p in holder.model.parameters()) if ctx.executor == "generator" else 0
            expected = {"ddma": mine, "gather_broadcast": num_params * gen_dtype.itemsize}
            bound_times = None
            for mode in modes:
                if mode == "memcpy_bound":
                    nbytes = mine if ctx.rank == 0 else 0  # global rank 0 is generator rank 0
                    times = bound_times = _memcpy_times(nbytes, repeats=args.repeats)
                else:
                    times, nbytes, _ = _run_mode(ctx, holder, mode, repeats=args.repeats, version=version,
                                                 expected_bytes=expected[mode], bound_times=bound_times)
                    version += args.repeats + 1
                gc.collect()
                record(size, mode, times, nbytes, bound_times)
            del holder
            gc.collect()
        if lora_modes:
            holder, merger = _build_lora(ctx, size, tp=tp, rank=args.lora_rank, trainer_dtype=trainer_dtype,
                                         gen_dtype=gen_dtype)
            # ddma: this rank's receive buffers (its TP slices of the adapters); gather_broadcast:
            # every adapter whole.
            whole = adapter_counts(meta_llama(size, dtype=gen_dtype), args.lora_rank)[0] * gen_dtype.itemsize
            expected = {"ddma_lora": merger.nbytes if merger else 0, "gather_broadcast_lora": whole}
            for mode in lora_modes:
                times, nbytes, merge_times = _run_mode(ctx, holder, mode, repeats=args.repeats, version=version,
                                                       expected_bytes=expected[mode], bound_times=None,
                                                       merger=merger)
                version += args.repeats + 1
                gc.collect()
                record(size, mode, times, nbytes, None, merge_times)
            del holder, merger
            gc.collect()
    add_ratios(rows)
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
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={trainers + generators}",
           "--monitor-interval=0.5", __file__, "--worker", "--layout", layout, "--sizes", args.sizes,
           "--repeats", str(args.repeats), "--dtype", args.dtype, "--trainer-dtype", args.trainer_dtype,
           "--lora-rank", str(args.lora_rank),
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
    """One line per (layout, size): the three medians, ddma's speed-up over gather_broadcast, the MB
    each mode moved per sync (all generator ranks) and each median over memcpy_bound's (``x cp``)."""
    table: dict[tuple[str, str], dict] = {}
    for row in rows:
        if row["mode"] in MODES:
            table.setdefault((row["layout"], row["size"]), {"num_params": row["num_params"]})[row["mode"]] = row
    print(f"{'layout':>8} {'size':>5} {'params':>8} {'ddma s':>9} {'gather_bc s':>11} {'memcpy s':>9} "
          f"{'gb/ddma':>8} {'ddma MB':>8} {'gb MB':>8} {'ddma x cp':>9} {'gb x cp':>8}")

    def cell(cells, mode, key, width, spec):
        value = cells[mode][key] if mode in cells else None
        return f"{value:>{width}{spec}}" if value is not None else f"{'-':>{width}}"

    for (layout, size), cells in table.items():
        both = {"ddma", "gather_broadcast"} <= cells.keys()
        speedup = (cells["gather_broadcast"]["seconds_median"] / cells["ddma"]["seconds_median"]
                   if both else None)
        megabytes = {m: {"mb": c["bytes_per_sync"] / 1e6} for m, c in cells.items() if m in MODES}
        millions = cells["num_params"] / 1e6
        print(f"{layout:>8} {size:>5} {millions:>7.{0 if millions >= 10 else 2}f}M "
              f"{cell(cells, 'ddma', 'seconds_median', 9, '.3f')} "
              f"{cell(cells, 'gather_broadcast', 'seconds_median', 11, '.3f')} "
              f"{cell(cells, 'memcpy_bound', 'seconds_median', 9, '.3f')} "
              f"{f'{speedup:.2f}x' if speedup else '-':>8} {cell(megabytes, 'ddma', 'mb', 8, '.1f')} "
              f"{cell(megabytes, 'gather_broadcast', 'mb', 8, '.1f')} "
              f"{cell(cells, 'ddma', 'memcpy_ratio', 9, '.1f')} "
              f"{cell(cells, 'gather_broadcast', 'memcpy_ratio', 8, '.1f')}")
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
        for color, mode in zip(("tab:blue", "tab:orange", "tab:green", "tab:purple", "tab:red"), MODES + LORA_MODES):
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
    parser.add_argument("--lora-rank", type=int, default=0,
                        help="> 0: also ddma_lora / gather_broadcast_lora (adapters of this rank, then a merge)")
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

    trainer_bytes = getattr(torch, args.trainer_dtype).itemsize
    gen_bytes = getattr(torch, args.dtype).itemsize
    rows, skipped = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for layout in args.layouts.split(","):
            skip: dict[str, list[str]] = {}
            for size in args.sizes.split(","):
                skip[size] = []
                for mode in MODES + (LORA_MODES if args.lora_rank > 0 else ()):
                    need = estimate_bytes(size, layout=layout, mode=mode, trainer_bytes=trainer_bytes,
                                          gen_bytes=gen_bytes, lora_rank=args.lora_rank)
                    if mode not in skip[size] and need > args.mem_budget_gb * 2**30:
                        skip[size].append(mode)
                        skipped.append((layout, size, mode, need / 2**30))
            rows += _launch(layout, args, skip, Path(tmp) / f"{len(rows)}.json")
    print_table(rows, skipped)
    print_lora_table(rows)
    if args.out:
        args.out.write_text(json.dumps(rows, indent=1))
    plot_path = args.plot or (args.out.with_suffix(".png") if args.out else None)
    if plot_path:
        try:
            plot(rows, plot_path)
        except ImportError:
            print("matplotlib is not installed: no plot", file=sys.stderr)


if __name__ == "__main__":
    main()
