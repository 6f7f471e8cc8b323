"""WeightsChannel: moves the trainer's policy weights into the generator's model.

Mode ``ddma`` (the default; DESIGN.md section 4) never assembles the full model on any rank. At
the first communicate every rank of both executors describes what it holds of each parameter
(``ddma_plan.describe_local_layout``: the trainer's FSDP2 ``Shard(0)`` DTensors describe
themselves; a generator rank is a replica, a DTensor on a TP mesh, or a plain module whose
executor returns an explicit ``get_weight_slices()`` spec ``{name: (dim, start, length)}``) and
sends it to every other rank as TensorBatch metadata. Every rank builds the same static plan
(``ddma_plan.build_plan``). Each sync, a trainer rank packs what each generator rank needs from it
into one pre-allocated bucket, cast to that rank's dtype (buckets with identical contents, as for
generator replicas, are packed once and sent to each), all pairs exchange in one
``batch_isend_irecv`` and generator ranks ``copy_`` the pieces into views of their parameters.
fp8 is not supported: a plain cast without per-tensor scales is not what fp8 engines load.

Mode ``gather_broadcast`` (what OpenRLHF / verl / PipelineRL do; kept for comparison and as a
fallback): every trainer rank takes part in all-gathering each FSDP2 shard into the full
parameter, the trainer's first rank packs every parameter (cast to the generator's dtype) into one
contiguous bucket and sends it point-to-point to every generator rank, which copies into its
parameters' storage in place (a TP rank keeps just its slice of each full parameter, as verl does).
Its handshake is the DDMA one (layouts + plan, for the same validation and errors).

In both modes names are the HF names of ``named_parameters()``, so tied embeddings appear once; a
missing or mis-shaped parameter is a one-line ValueError before any weight moves. After a sync the
generator's ``set_weights_version(version)`` is called with the trainer's version (its
optimizer-step count, sent by the trainer's first rank); ``last_seconds`` holds the sync time on
this rank, ``bytes_sent`` / ``bytes_received`` the weight bytes of the last sync per
(source global rank, destination global rank) on this rank (the 8-byte version is not counted).
Each communicate first announces the trainer's version; when it equals the version last synced (no
optimizer step since), nothing else moves and ``last_skipped`` is True.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from llamarl.batch import DTYPES, TensorBatch, WireFormatError
from llamarl.channels.ddma_plan import Piece, box_index, build_plan, describe_local_layout, local_tensor
from llamarl.channels.p2p import exchange
from llamarl.models.sharding import full_named_parameters

MODES = ("ddma", "gather_broadcast")


@dataclass
class _Bucket:
    """One pre-allocated byte buffer and the pieces packed into / unpacked from it."""

    buffer: torch.Tensor
    dtype: torch.dtype
    pieces: list[Piece]
    peers: list[int]  # destination global ranks (send) or the one source (receive)

    def view(self, piece: Piece) -> torch.Tensor:
        flat = self.buffer.view(self.dtype)
        return flat[piece.offset : piece.offset + piece.numel].view(piece.shape)


def _wait(ops: list[dist.P2POp]) -> None:
    if ops:
        for work in dist.batch_isend_irecv(ops):
            work.wait()


@dataclass
class WeightsChannel:
    """Trainer -> generator weight sync. See the module docstring for both modes."""

    name: str
    outbound: str
    inbound: str
    mode: str = "ddma"
    same_tick: bool = False
    """Delivery (see CommunicationChannel); the pipelines here always send weights next tick."""

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"WeightsChannel mode must be one of {MODES}, got {self.mode!r}")
        self.layout: dict | None = None
        self.plan = None
        self.last_seconds = 0.0
        self.bytes_sent: dict[tuple[int, int], int] = {}
        self.bytes_received: dict[tuple[int, int], int] = {}
        self._buckets: list[_Bucket] = []
        self._synced_version: int | None = None
        self.last_skipped = False

    @property
    def last_bytes_received(self) -> int:
        """Weight bytes this rank received in the last sync (0 when skipped, or on a trainer rank)."""
        return 0 if self.last_skipped else sum(self.bytes_received.values())

    def involves(self, ctx) -> bool:
        return ctx.executor in (self.outbound, self.inbound)

    def communicate(self, ctx, executor) -> None:
        """One sync; every rank of both executors must call it (a no-op elsewhere)."""
        if not self.involves(ctx):
            return
        start = time.perf_counter()
        # The trainer's version first (8 bytes to each generator rank): when it is the version
        # already synced (a tick without an optimizer step), no weight moves at all.
        version = self._announce_version(ctx, executor)
        self.last_skipped = version == self._synced_version
        if not self.last_skipped:
            if self.mode == "ddma":
                if self.plan is None:
                    self._ddma_handshake(ctx, executor)
                self._ddma_sync(ctx, executor)
            else:
                self._gather_broadcast(ctx, executor)
            self._synced_version = version
        self.last_seconds = time.perf_counter() - start

    def _announce_version(self, ctx, executor) -> int:
        """The trainer's version on every rank of both executors (trainer ranks agree already)."""
        if ctx.executor == self.outbound:
            version = int(executor.version)
            if ctx.rank == ctx.leader(self.outbound):
                message = torch.tensor([version], dtype=torch.int64, device=ctx.device)
                _wait([dist.P2POp(dist.isend, message, g) for g in ctx.ranks[self.inbound]])
            return version
        message = torch.zeros(1, dtype=torch.int64, device=ctx.device)
        _wait([dist.P2POp(dist.irecv, message, ctx.leader(self.outbound))])
        return int(message.item())

    # ----- ddma -----
    def _exchange_layouts(self, ctx, executor) -> dict[int, dict]:
        """Every rank of both executors learns every rank's local layout; errors raise everywhere."""
        label = f"weight channel {self.name!r}"
        trainers, generators = ctx.ranks[self.outbound], ctx.ranks[self.inbound]
        try:
            if ctx.executor == self.inbound:
                slices_fn = getattr(executor, "get_weight_slices", None)
                mine = describe_local_layout(executor.get_model(), slices=slices_fn() if slices_fn else None,
                                             single_dtype=True)
            else:
                mine = describe_local_layout(executor.get_model())
        except ValueError as err:
            # Still take part in the exchange, so every peer raises too instead of waiting forever.
            mine = {"error": f"rank {ctx.rank}: {err}"}
        peers = [r for r in trainers + generators if r != ctx.rank]
        got = exchange({r: TensorBatch({}, {"layout": mine}) for r in peers}, peers, device=ctx.device, label=label)
        layouts = {r: got[r].metadata.get("layout") for r in peers} | {ctx.rank: mine}
        for rank in trainers + generators:
            if not isinstance(layouts[rank], dict):
                raise WireFormatError(f"{label}: rank {rank} sent no layout")
            if "error" in layouts[rank]:
                raise ValueError(f"{label}: {layouts[rank]['error']}")
        return layouts

    def _ddma_handshake(self, ctx, executor) -> None:
        label = f"weight channel {self.name!r}"
        trainers, generators = ctx.ranks[self.outbound], ctx.ranks[self.inbound]
        layouts = self._exchange_layouts(ctx, executor)
        self.plan = build_plan([layouts[r] for r in trainers], [layouts[r] for r in generators], label=label)
        self._buckets = self._make_buckets(ctx, trainers, generators)

    def _make_buckets(self, ctx, trainers: list[int], generators: list[int]) -> list[_Bucket]:
        """Allocate this rank's send (trainer) or receive (generator) buckets, once."""
        buckets: dict[tuple, _Bucket] = {}
        for (t, g), pieces in self.plan.pieces.items():
            if not pieces or ctx.rank not in (trainers[t], generators[g]):
                continue
            dtype = DTYPES[self.plan.dtypes[g]]
            if ctx.executor == self.outbound:
                # Bucket bytes depend only on the source boxes and dtype: replicas share one bucket.
                key = (dtype, tuple((p.name, p.src) for p in pieces))
                peer = generators[g]
            else:
                key, peer = (t,), trainers[t]
            if key not in buckets:
                numel = sum(p.numel for p in pieces)
                buffer = torch.empty(numel * dtype.itemsize, dtype=torch.uint8, device=ctx.device)
                buckets[key] = _Bucket(buffer, dtype, pieces, [])
            buckets[key].peers.append(peer)
        return list(buckets.values())

    def _ddma_sync(self, ctx, executor) -> None:
        leader = ctx.leader(self.outbound)
        version = torch.zeros(1, dtype=torch.int64, device=ctx.device)
        params = dict(executor.get_model().named_parameters())
        if ctx.executor == self.outbound:
            ops = []
            if ctx.rank == leader:
                version.fill_(int(executor.version))
                ops += [dist.P2POp(dist.isend, version, g) for g in ctx.ranks[self.inbound]]
            with torch.no_grad():
                for bucket in self._buckets:
                    for piece in bucket.pieces:
                        bucket.view(piece).copy_(local_tensor(params[piece.name])[box_index(piece.src)])
            ops += [dist.P2POp(dist.isend, b.buffer, dst) for b in self._buckets for dst in b.peers]
            _wait(ops)
            self.bytes_sent = {(ctx.rank, dst): b.buffer.numel() for b in self._buckets for dst in b.peers}
        else:
            ops = [dist.P2POp(dist.irecv, version, leader)]
            ops += [dist.P2POp(dist.irecv, b.buffer, b.peers[0]) for b in self._buckets]
            _wait(ops)
            with torch.no_grad():
                for bucket in self._buckets:
                    for piece in bucket.pieces:
                        local_tensor(params[piece.name])[box_index(piece.dst)].copy_(bucket.view(piece))
            self.bytes_received = {(b.peers[0], ctx.rank): b.buffer.numel() for b in self._buckets}
            executor.set_weights_version(int(version.item()))

    # ----- gather_broadcast -----
    def _handshake(self, ctx, executor) -> None:
        """Agree on the bucket order (generator names), full shapes and this rank's boxes.

        The DDMA layout exchange and plan are reused only to validate (same errors either way).
        """
        trainers, generators = ctx.ranks[self.outbound], ctx.ranks[self.inbound]
        layouts = self._exchange_layouts(ctx, executor)
        build_plan([layouts[r] for r in trainers], [layouts[r] for r in generators], label=f"weight channel {self.name!r}")
        full_shapes = {p["name"]: p["shape"] for p in layouts[trainers[0]]["params"]}
        reference = layouts[generators[0]]
        mine = layouts[ctx.rank]["params"] if ctx.executor == self.inbound else []
        self.layout = {"names": [p["name"] for p in reference["params"]],
                       "shapes": [full_shapes[p["name"]] for p in reference["params"]],
                       "dtype": reference["dtype"], "boxes": {p["name"]: p["box"] for p in mine}}

    def _gather_broadcast(self, ctx, executor) -> None:
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
                _wait(ops)
                nbytes = bucket.numel() * bucket.element_size()
                self.bytes_sent = {(ctx.rank, dst): nbytes for dst in ctx.ranks[self.inbound]}
        else:
            # Every generator rank receives every full parameter; a TP rank keeps its box of each
            # (what verl / OpenRLHF do for TP engines), a replica keeps all of it.
            params = dict(executor.get_model().named_parameters())
            boxes = self.layout["boxes"]
            shapes = dict(zip(self.layout["names"], self.layout["shapes"]))
            numel = sum(math.prod(shapes[n]) for n in self.layout["names"])
            bucket = torch.empty(numel, dtype=DTYPES[self.layout["dtype"]], device=ctx.device)
            _wait([dist.P2POp(dist.irecv, version, leader), dist.P2POp(dist.irecv, bucket, leader)])
            offset = 0
            with torch.no_grad():
                for n in self.layout["names"]:
                    size = math.prod(shapes[n])
                    full = bucket[offset : offset + size].view(shapes[n])
                    local_tensor(params[n]).copy_(full[box_index(boxes[n])])
                    offset += size
            self.bytes_received = {(leader, ctx.rank): bucket.numel() * bucket.element_size()}
            executor.set_weights_version(int(version.item()))
