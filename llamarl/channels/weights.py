"""WeightsChannel: moves the trainer's policy weights into the generator's model.

Mode ``gather_broadcast`` (what OpenRLHF / verl / PipelineRL do): every trainer rank takes part
in all-gathering each FSDP2 shard into the full parameter, the trainer's first rank packs every
parameter (cast to the generator's dtype) into one contiguous bucket and sends it point-to-point
to every generator rank, which unpacks it into its parameters' storage in place.

At the first communicate both sides agree on a layout: each generator rank sends the trainer's
first rank its parameter names, shapes and dtype (as TensorBatch metadata, no pickle); names are
the HF names of ``named_parameters()`` on both sides, so tied embeddings appear once. A missing
or mis-shaped parameter is a one-line ValueError before any weight moves.

After a sync the generator's ``set_weights_version(version)`` is called with the trainer's
version (its optimizer-step count); ``last_seconds`` holds the sync time on this rank.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from llamarl.batch import DTYPES, TensorBatch
from llamarl.channels.p2p import exchange

_DTYPE_NAMES = {v: k for k, v in DTYPES.items()}


def full_named_parameters(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter materialised whole (collective over the FSDP mesh for DTensors)."""
    return {name: (p.full_tensor() if isinstance(p, DTensor) else p).detach()
            for name, p in model.named_parameters()}


def describe_layout(model: torch.nn.Module) -> dict:
    """JSON-able layout of a (non-sharded) generator model: names, shapes, dtype."""
    params = list(model.named_parameters())
    dtypes = {p.dtype for _, p in params}
    if len(dtypes) != 1:
        raise ValueError(f"generator parameters mix dtypes {sorted(map(str, dtypes))}; cast the model to one dtype")
    return {"names": [n for n, _ in params], "shapes": [list(p.shape) for _, p in params],
            "dtype": _DTYPE_NAMES[dtypes.pop()]}


@dataclass
class WeightsChannel:
    """Trainer -> generator weight sync. See the module docstring for the protocol."""

    name: str = "weights"
    outbound: str = "trainer"
    inbound: str = "generator"
    mode: str = "gather_broadcast"

    def __post_init__(self) -> None:
        if self.mode != "gather_broadcast":
            raise ValueError(f"WeightsChannel mode must be 'gather_broadcast', got {self.mode!r}")
        self.layout: dict | None = None
        self.last_seconds = 0.0
        self.num_syncs = 0

    def involves(self, ctx) -> bool:
        return ctx.executor in (self.outbound, self.inbound)

    def _handshake(self, ctx, executor) -> None:
        leader = ctx.leader(self.outbound)
        label = f"weight channel {self.name!r}"
        if ctx.executor == self.inbound:
            layout = describe_layout(executor.get_model())
            exchange({leader: TensorBatch({}, {"layout": layout})}, [], device=ctx.device, label=label)
            self.layout = layout
        elif ctx.rank == leader:
            got = exchange({}, ctx.ranks[self.inbound], device=ctx.device, label=label)
            layouts = [got[r].metadata.get("layout") for r in ctx.ranks[self.inbound]]
            if any(layout != layouts[0] for layout in layouts):
                raise ValueError(f"{label}: generator ranks disagree on the model layout")
            self.layout = layouts[0]
            ours = {n: list(p.shape) for n, p in executor.get_model().named_parameters()}
            for n, shape in zip(self.layout["names"], self.layout["shapes"]):
                if n not in ours:
                    raise ValueError(f"{label}: generator parameter {n!r} does not exist in the trainer's model")
                if ours[n] != shape:
                    raise ValueError(f"{label}: parameter {n!r} is {ours[n]} on the trainer but {shape} on the generator")
        else:
            self.layout = {}

    def communicate(self, ctx, executor) -> None:
        """One sync; every rank of both executors must call it (a no-op elsewhere)."""
        if not self.involves(ctx):
            return
        start = time.perf_counter()
        if self.layout is None:
            self._handshake(ctx, executor)
        leader = ctx.leader(self.outbound)
        version = torch.zeros(1, dtype=torch.int64, device=ctx.device)
        if ctx.executor == self.outbound:
            full = full_named_parameters(executor.get_model())  # collective over the trainer group
            if ctx.rank == leader:
                dtype = DTYPES[self.layout["dtype"]]
                bucket = torch.cat([full[n].to(ctx.device, dtype).reshape(-1) for n in self.layout["names"]])
                version.fill_(int(executor.version))
                ops = []
                for dst in ctx.ranks[self.inbound]:
                    ops += [dist.P2POp(dist.isend, version, dst), dist.P2POp(dist.isend, bucket, dst)]
                for work in dist.batch_isend_irecv(ops):
                    work.wait()
        else:
            model = executor.get_model()
            params = dict(model.named_parameters())
            numel = sum(params[n].numel() for n in self.layout["names"])
            bucket = torch.empty(numel, dtype=DTYPES[self.layout["dtype"]], device=ctx.device)
            ops = [dist.P2POp(dist.irecv, version, leader), dist.P2POp(dist.irecv, bucket, leader)]
            for work in dist.batch_isend_irecv(ops):
                work.wait()
            offset = 0
            with torch.no_grad():
                for n in self.layout["names"]:
                    p = params[n]
                    p.copy_(bucket[offset : offset + p.numel()].view_as(p))
                    offset += p.numel()
            executor.set_weights_version(int(version.item()))
        self.num_syncs += 1
        self.last_seconds = time.perf_counter() - start
