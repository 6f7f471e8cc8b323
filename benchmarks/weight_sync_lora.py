"""LoRA adapter-only syncs for ``benchmarks/weight_sync.py --lora-rank R`` (modes ``ddma_lora``,
``gather_broadcast_lora``: the weights channel's ``ddma`` / ``gather_broadcast`` moving adapters).

As a ``--trainer.lora.rank R`` run does: the trainer injects peft LoRA rank R, alpha 2R (scale 2),
every linear of the decoder layers (``LoraSpec.inject``) into its meta Llama before ``shard_model``,
and its weights channel sees ``AdapterView(model)`` (the FSDP2-sharded adapters only). A generator
rank builds the same generation model as the full modes (a replica, or for ``T->Gtp`` its TP slice,
here as DTensors ``Shard(dim)`` on the generator mesh, which ``AdapterMerger`` reads its TP slices
from) and an ``AdapterMerger``: its receive buffers are what the channel fills, and ``merge()``
writes ``W = W_base + 2 B A`` into the generation weights in place after each sync.

Checks (besides weight_sync.py's per-sync ones on the adapters: not skipped, the bytes the layout
needs, sent == received, every received element the new version's ``pattern_value``):
``check_merged``: every adapted weight of the rank equals base + scale * B A exactly. The base is
one constant (the generator's page-touching fill) and A, B hold ``pattern_value``s (n / 128), so
each element of ``B A`` is ``r * a * b``, exact in fp32, and the merge rounds once, as here.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

LORA_MODES = ("ddma_lora", "gather_broadcast_lora")


def lora_spec(rank: int):
    from llamarl.models.lora import LoraSpec

    return LoraSpec(rank=rank, alpha=2.0 * rank)


def adapter_counts(meta_model: torch.nn.Module, rank: int) -> tuple[int, int]:
    """(elements of all adapters, elements of the weights they adapt) of an un-injected model."""
    adapters = adapted = 0
    for module in lora_spec(rank).target_modules(meta_model):
        out_features, in_features = meta_model.get_submodule(module).weight.shape
        adapters += rank * (in_features + out_features)
        adapted += out_features * in_features
    return adapters, adapted


def build_trainer(ctx, meta_model: torch.nn.Module, rank: int, *, fill: float) -> torch.nn.Module:
    """The trainer's side: adapters injected on the meta device, sharded, allocated, every local
    element set to ``fill``; returns ``AdapterView`` of it (what ``get_model()`` gives the channel)."""
    from llamarl.channels.ddma_plan import local_tensor
    from llamarl.models.lora import AdapterView
    from llamarl.models.sharding import shard_model

    model = shard_model(lora_spec(rank).inject(meta_model), ctx.mesh).to_empty(device=ctx.device)
    with torch.no_grad():
        for param in model.parameters():
            local_tensor(param).fill_(fill)
    return AdapterView(model)


def build_generator(ctx, meta_model: torch.nn.Module, rank: int, *, tp: bool, fill: float):
    """A generator rank's side: its generation model (replica, or TP DTensors on ``ctx.mesh``) with
    every element ``fill`` (the base), and the ``AdapterMerger`` over it."""
    from torch.distributed.tensor import DTensor, Shard
    from tp_layout import llama_tp_slices, narrow_to_slices

    from llamarl.channels.ddma_plan import local_tensor
    from llamarl.models.lora_merge import AdapterMerger

    model = meta_model
    slices = {}
    if tp:
        shapes = {name: param.shape for name, param in model.named_parameters()}
        slices = llama_tp_slices(model, tp_rank=ctx.local_rank, tp_size=ctx.local_world_size)
        narrow_to_slices(model, slices)
    model.to_empty(device=ctx.device)
    for name, (dim, _, _) in slices.items():  # as a TP engine holds them: DTensors of the full shape
        owner, _, leaf = name.rpartition(".")
        module = model.get_submodule(owner)
        stride = torch.empty(shapes[name], device="meta").stride()
        dt = DTensor.from_local(getattr(module, leaf).detach(), ctx.mesh, [Shard(dim)], run_check=False,
                                shape=shapes[name], stride=stride)
        setattr(module, leaf, torch.nn.Parameter(dt, requires_grad=False))
    with torch.no_grad():
        for param in model.parameters():
            local_tensor(param).fill_(fill)
    return model, AdapterMerger(model, lora_spec(rank))


def check_merged(merger, *, version: int, value: Callable[[int, int], float]) -> str | None:
    """Why an adapted weight of this rank is not base + scale * B A of ``version``'s adapters
    (``value(index, version)``: adapter ``index`` in sorted-name order), or None (module docstring)."""
    index = {name: i for i, name in enumerate(sorted(merger.tensors))}
    rank, scale = merger.spec.rank, merger.spec.scale
    for module, target in merger.targets.items():
        a = value(index[f"{module}.lora_A.weight"], version)
        b = value(index[f"{module}.lora_B.weight"], version)
        base_low, base_high = (x.item() for x in torch.aminmax(target.base))
        expected = (torch.tensor(base_low, dtype=torch.float32)
                    + torch.tensor(scale * rank * a * b, dtype=torch.float32)).to(target.weight.dtype).item()
        low, high = (x.item() for x in torch.aminmax(target.weight))
        if base_low != base_high or low != expected or high != expected:
            return (f"version {version}: merged {module}.weight holds [{low}, {high}], expected base {base_low} "
                    f"+ {scale} * B A = {expected} everywhere (base in [{base_low}, {base_high}])")
    return None


def add_ratios(rows: list[dict]) -> None:
    """Each LoRA row's bytes and times over the full ``ddma`` row of its layout and size (None
    without one): ``bytes_ratio_to_full``, ``seconds_ratio_to_full`` (the sync alone) and
    ``with_merge_ratio_to_full`` (sync + merge)."""
    full = {(r["layout"], r["size"]): r for r in rows if r["mode"] == "ddma"}
    for row in rows:
        if row["mode"] not in LORA_MODES:
            continue
        ref = full.get((row["layout"], row["size"]))
        both = row["seconds_median"] + row["merge_seconds_median"]
        row["bytes_ratio_to_full"] = row["bytes_per_sync"] / ref["bytes_per_sync"] if ref else None
        row["seconds_ratio_to_full"] = row["seconds_median"] / ref["seconds_median"] if ref else None
        row["with_merge_ratio_to_full"] = both / ref["seconds_median"] if ref else None


def print_table(rows: list[dict]) -> None:
    """One line per LoRA row: sync and merge medians, MB per sync, and the ratios to full ddma."""
    lora = [r for r in rows if r["mode"] in LORA_MODES]
    if not lora:
        return
    print(f"\n{'layout':>8} {'size':>5} {'mode':>21} {'rank':>4} {'sync s':>8} {'merge s':>8} {'MB':>8} "
          f"{'bytes/full':>10} {'s/full':>7} {'+merge/full':>11}")

    def ratio(value, spec):
        return "-" if value is None else f"{value:{spec}}"

    for r in lora:
        print(f"{r['layout']:>8} {r['size']:>5} {r['mode']:>21} {r['lora_rank']:>4} {r['seconds_median']:>8.4f} "
              f"{r['merge_seconds_median']:>8.4f} {r['bytes_per_sync'] / 1e6:>8.2f} "
              f"{ratio(r['bytes_ratio_to_full'], '.4f'):>10} {ratio(r['seconds_ratio_to_full'], '.3f'):>7} "
              f"{ratio(r['with_merge_ratio_to_full'], '.3f'):>11}")
