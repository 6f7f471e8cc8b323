"""WeightsChannel: moves the trainer's policy weights into the generator's model.

Mode ``ddma`` (the default; DESIGN.md section 4) never assembles the full model on any rank. At
the first communicate every rank of both executors describes what it holds of each parameter
(``ddma_plan.describe_local_layout``: the trainer's FSDP2 ``Shard(0)`` DTensors describe
themselves; a generator rank is a replica, a DTensor on a TP mesh, or a plain module whose
executor returns an explicit ``get_weight_slices()`` spec ``{name: (dim, start, length)}``) and
sends it to every other rank as TensorBatch metadata. Every rank builds the same static plan
(``ddma_plan.build_plan``). Each sync, a trainer rank packs what each generator rank needs from it
into pre-allocated buckets, cast to that rank's dtype (buckets with identical contents, as for
generator replicas, are packed once and sent to each), all pairs exchange in ``batch_isend_irecv``
and generator ranks ``copy_`` the pieces into views of their parameters. ``bucket_mb`` bounds the
buckets: a pair's pieces (in plan order) are cut into chunks of at most that many MiB (a single
piece larger than that is a chunk of its own), and the sync runs in rounds, chunk ``k`` of every
pair in round ``k``, each pair's one buffer reused from round to round; so each rank holds at most
one bucket of about ``bucket_mb`` per peer instead of everything it sends or receives (slime's
``--update-weight-buffer-size``, verl's ``update_weights_bucket_megabytes``). ``bucket_mb=0``: one
bucket per pair, one round.
fp8 is not supported: a plain cast without per-tensor scales is not what fp8 engines load.

Mode ``gather_broadcast`` (what OpenRLHF / verl / PipelineRL do; kept for comparison and as a
fallback): every trainer rank takes part in all-gathering each FSDP2 shard into the full
parameter, the trainer's first rank packs the parameters (cast to the generator's dtype) into a
contiguous bucket and sends it point-to-point to every generator rank, which copies into its
parameters' storage in place (a TP rank keeps just its slice of each full parameter, as verl does).
With ``bucket_mb`` it runs in rounds: the parameters of one bucket are gathered, sent and dropped
before the next are gathered, so no rank holds more than a bucket of gathered weights.
Its handshake is the DDMA one (layouts + plan, for the same validation and errors).

Streaming into an engine (either mode): a generator whose ``weight_sink()`` returns a callable (a
vLLM generator, which keeps no HF copy of the model: its ``get_model()`` is on the meta device and
only describes the layout) is handed an iterator of ``(name, full tensor)`` instead of having its
parameters written: each parameter is yielded in the round that completes it, from a staging tensor
of its own, and the next round is received as the consumer asks for more, so the engine loads
weights while they arrive and no rank ever holds a second model (``_ddma_receive``). The iterator is
run to its end after the sink returns (``feed``), so no peer waits on a consumer that stopped.

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
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from llamarl.channels.ddma_plan import Piece, box_index, build_plan, describe_local_layout, local_tensor
from llamarl.channels.p2p import exchange
from llamarl.channels.sinks import feed, weight_sink_of
from llamarl.runtime.batch import DTYPES, TensorBatch, WireFormatError

MODES = ("ddma", "gather_broadcast")


@dataclass
class _Bucket:
    """One pre-allocated byte buffer and the pieces packed into / unpacked from it."""

    buffer: torch.Tensor  # shared by this peer's buckets of every round; this round uses nbytes of it
    dtype: torch.dtype
    pieces: list[Piece]  # offsets from the start of this round's chunk
    peers: list[int]  # destination global ranks (send) or the one source (receive)
    nbytes: int = 0

    @property
    def payload(self) -> torch.Tensor:
        return self.buffer[: self.nbytes]

    def view(self, piece: Piece) -> torch.Tensor:
        flat = self.payload.view(self.dtype)
        return flat[piece.offset : piece.offset + piece.numel].view(piece.shape)


def chunk_pieces(pieces: list[Piece], *, itemsize: int, max_bytes: int) -> list[list[Piece]]:
    """``pieces`` (in order) cut into consecutive chunks of at most ``max_bytes`` each (a piece
    larger than that alone in its chunk; ``max_bytes <= 0``: one chunk), offsets re-based to each
    chunk's start. Deterministic, so the two ends of a pair cut alike."""
    chunks: list[list[Piece]] = []
    current: list[Piece] = []
    size = 0
    for piece in pieces:
        nbytes = piece.numel * itemsize
        if current and max_bytes > 0 and size + nbytes > max_bytes:
            chunks.append(current)
            current, size = [], 0
        current.append(replace(piece, offset=size // itemsize))
        size += nbytes
    if current:
        chunks.append(current)
    return chunks


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
    bucket_mb: float = 0.0
    """The most MiB one bucket holds (module docstring): per (trainer, generator) pair under
    ``ddma``, the gathered parameters of one round under ``gather_broadcast``; 0: no bound."""

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"WeightsChannel mode must be one of {MODES}, got {self.mode!r}")
        if self.bucket_mb < 0:
            raise ValueError(f"WeightsChannel bucket_mb must be >= 0 (0: one bucket per pair), got {self.bucket_mb}")
        self.layout: dict | None = None
        self.plan = None
        self.last_seconds = 0.0
        self.bytes_sent: dict[tuple[int, int], int] = {}
        self.bytes_received: dict[tuple[int, int], int] = {}
        self._rounds: list[list[_Bucket]] = []
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
        kinds = {name: ctx.device_kinds.get(name, ctx.device.type) for name in (self.outbound, self.inbound)}
        if kinds[self.outbound] != kinds[self.inbound]:  # every rank of both ends decides alike: all raise
            raise ValueError(f"weight channel {self.name!r}: {self.outbound!r} runs on {kinds[self.outbound]} and "
                             f"{self.inbound!r} on {kinds[self.inbound]}; weights move between executors on the "
                             "same kind of device (llamarl/runtime/placement.py)")
        # Every message of the sync goes through one group, the same at both ends: WORLD, or the
        # GPU-only group of a mixed world (CUDA tensors on WORLD would wait for its CPU ranks).
        group = ctx.link_group(self.inbound if ctx.executor == self.outbound else self.outbound)
        start = time.perf_counter()
        # The trainer's version first (8 bytes to each generator rank): when it is the version
        # already synced (a tick without an optimizer step), no weight moves at all.
        version = self._announce_version(ctx, executor, group=group)
        self.last_skipped = version == self._synced_version
        if not self.last_skipped:
            if self.mode == "ddma":
                if self.plan is None:
                    self._ddma_handshake(ctx, executor, group=group)
                self._ddma_sync(ctx, executor, group=group)
            else:
                self._gather_broadcast(ctx, executor, group=group)
            self._synced_version = version
        self.last_seconds = time.perf_counter() - start

    def _announce_version(self, ctx, executor, *, group) -> int:
        """The trainer's version on every rank of both executors (trainer ranks agree already)."""
        if ctx.executor == self.outbound:
            version = int(executor.version)
            if ctx.rank == ctx.leader(self.outbound):
                message = torch.tensor([version], dtype=torch.int64, device=ctx.device)
                _wait([dist.P2POp(dist.isend, message, g, group=group) for g in ctx.ranks[self.inbound]])
            return version
        message = torch.zeros(1, dtype=torch.int64, device=ctx.device)
        _wait([dist.P2POp(dist.irecv, message, ctx.leader(self.outbound), group=group)])
        return int(message.item())

    # ----- ddma -----
    def _exchange_layouts(self, ctx, executor, *, group) -> dict[int, dict]:
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
        got = exchange({r: TensorBatch({}, {"layout": mine}) for r in peers}, peers, device=ctx.device, group=group,
                       label=label)
        layouts = {r: got[r].metadata.get("layout") for r in peers} | {ctx.rank: mine}
        for rank in trainers + generators:
            if not isinstance(layouts[rank], dict):
                raise WireFormatError(f"{label}: rank {rank} sent no layout")
            if "error" in layouts[rank]:
                raise ValueError(f"{label}: {layouts[rank]['error']}")
        return layouts

    def _ddma_handshake(self, ctx, executor, *, group) -> None:
        label = f"weight channel {self.name!r}"
        trainers, generators = ctx.ranks[self.outbound], ctx.ranks[self.inbound]
        layouts = self._exchange_layouts(ctx, executor, group=group)
        self.plan = build_plan([layouts[r] for r in trainers], [layouts[r] for r in generators], label=label)
        self._rounds = self._make_rounds(ctx, trainers, generators)

    def _make_rounds(self, ctx, trainers: list[int], generators: list[int]) -> list[list[_Bucket]]:
        """This rank's send (trainer) or receive (generator) buckets of every round; each peer's
        buffer is allocated once, at its largest chunk, and reused by its later rounds."""
        max_bytes = int(self.bucket_mb * 2**20)
        rounds: list[dict[tuple, _Bucket]] = []
        buffers: dict[tuple, torch.Tensor] = {}
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
            chunks = chunk_pieces(pieces, itemsize=dtype.itemsize, max_bytes=max_bytes)
            if key not in buffers:
                largest = max(sum(p.numel for p in chunk) for chunk in chunks) * dtype.itemsize
                buffers[key] = torch.empty(largest, dtype=torch.uint8, device=ctx.device)
            for index, chunk in enumerate(chunks):
                if index == len(rounds):
                    rounds.append({})
                if key not in rounds[index]:
                    nbytes = sum(p.numel for p in chunk) * dtype.itemsize
                    rounds[index][key] = _Bucket(buffers[key], dtype, chunk, [], nbytes)
                rounds[index][key].peers.append(peer)
        return [list(buckets.values()) for buckets in rounds]

    def _ddma_sync(self, ctx, executor, *, group) -> None:
        leader = ctx.leader(self.outbound)
        version = torch.zeros(1, dtype=torch.int64, device=ctx.device)
        params = dict(executor.get_model().named_parameters())
        # Every rank of both executors runs the same number of rounds (the plan is the same everywhere);
        # a rank with nothing to move in a round takes no part in it.
        num_rounds = self.plan_rounds
        sent: dict[tuple[int, int], int] = {}
        received: dict[tuple[int, int], int] = {}
        if ctx.executor == self.outbound:
            ops = []
            if ctx.rank == leader:
                version.fill_(int(executor.version))
                ops += [dist.P2POp(dist.isend, version, g, group=group) for g in ctx.ranks[self.inbound]]
            for index in range(num_rounds):
                buckets = self._rounds[index] if index < len(self._rounds) else []
                with torch.no_grad():
                    for bucket in buckets:
                        for piece in bucket.pieces:
                            bucket.view(piece).copy_(local_tensor(params[piece.name])[box_index(piece.src)])
                ops += [dist.P2POp(dist.isend, b.payload, dst, group=group) for b in buckets for dst in b.peers]
                _wait(ops)
                ops = []
                for bucket in buckets:
                    for dst in bucket.peers:
                        sent[(ctx.rank, dst)] = sent.get((ctx.rank, dst), 0) + bucket.nbytes
            _wait(ops)  # the version alone, when no rank has a piece to move
            self.bytes_sent = sent
        else:
            sink = weight_sink_of(executor)
            rounds = self._ddma_receive(ctx, params, version=version, received=received, stream=sink is not None,
                                        group=group)
            feed(sink, rounds, label=f"weight channel {self.name!r}")
            self.bytes_received = received
            executor.set_weights_version(int(version.item()))

    def _ddma_receive(self, ctx, params: dict, *, version: torch.Tensor, received: dict, stream: bool, group):
        """A generator rank's side of the DDMA rounds, as an iterator. Without ``stream`` each piece
        is copied into its parameter's view and nothing is yielded. With ``stream`` (a weight sink:
        ``params`` only describe the layout) each piece is copied into a staging tensor of its
        parameter, and the parameter is yielded, ``(name, tensor)`` on ``ctx.device``, in the round
        that completes it; the next round's receive starts when the consumer asks for more. Staging
        holds only the parameters of the rounds in flight, never the whole model."""
        leader = ctx.leader(self.outbound)
        staging: dict[str, torch.Tensor] = {}
        left: dict[str, int] = {}
        ops = [dist.P2POp(dist.irecv, version, leader, group=group)]
        for index in range(self.plan_rounds):
            buckets = self._rounds[index] if index < len(self._rounds) else []
            ops += [dist.P2POp(dist.irecv, b.payload, b.peers[0], group=group) for b in buckets]
            _wait(ops)
            ops = []
            done = []
            with torch.no_grad():
                for bucket in buckets:
                    for piece in bucket.pieces:
                        if not stream:
                            local_tensor(params[piece.name])[box_index(piece.dst)].copy_(bucket.view(piece))
                            continue
                        name = piece.name
                        if name not in staging:
                            staging[name] = torch.empty(params[name].shape, dtype=bucket.dtype, device=ctx.device)
                            left[name] = staging[name].numel()
                        staging[name][box_index(piece.dst)].copy_(bucket.view(piece))
                        left[name] -= piece.numel
                        if left[name] == 0:
                            done.append(name)
                    src = (bucket.peers[0], ctx.rank)
                    received[src] = received.get(src, 0) + bucket.nbytes
            for name in done:
                del left[name]
                yield name, staging.pop(name)
        _wait(ops)
        assert not staging, f"parameters never completed by the plan: {sorted(staging)[:3]}"

    @property
    def plan_rounds(self) -> int:
        """Rounds of a DDMA sync (the most chunks of any pair; 0 before the handshake)."""
        if self.plan is None:
            return 0
        max_bytes = int(self.bucket_mb * 2**20)
        return max((len(chunk_pieces(pieces, itemsize=DTYPES[self.plan.dtypes[g]].itemsize, max_bytes=max_bytes))
                    for (_, g), pieces in self.plan.pieces.items() if pieces), default=0)

    # ----- gather_broadcast -----
    def _handshake(self, ctx, executor, *, group) -> None:
        """Agree on the bucket order (generator names), full shapes and this rank's boxes.

        The DDMA layout exchange and plan are reused only to validate (same errors either way).
        """
        trainers, generators = ctx.ranks[self.outbound], ctx.ranks[self.inbound]
        layouts = self._exchange_layouts(ctx, executor, group=group)
        build_plan([layouts[r] for r in trainers], [layouts[r] for r in generators], label=f"weight channel {self.name!r}")
        full_shapes = {p["name"]: p["shape"] for p in layouts[trainers[0]]["params"]}
        reference = layouts[generators[0]]
        mine = layouts[ctx.rank]["params"] if ctx.executor == self.inbound else []
        self.layout = {"names": [p["name"] for p in reference["params"]],
                       "shapes": [full_shapes[p["name"]] for p in reference["params"]],
                       "dtype": reference["dtype"], "boxes": {p["name"]: p["box"] for p in mine}}

    def _gather_broadcast_chunks(self) -> list[list[str]]:
        """Parameter names in bucket order, cut into chunks of at most ``bucket_mb`` (a parameter
        larger than that alone in its chunk): one round each, the same on every rank."""
        itemsize = DTYPES[self.layout["dtype"]].itemsize
        max_bytes = int(self.bucket_mb * 2**20)
        chunks: list[list[str]] = []
        current: list[str] = []
        size = 0
        for name, shape in zip(self.layout["names"], self.layout["shapes"]):
            nbytes = math.prod(shape) * itemsize
            if current and max_bytes > 0 and size + nbytes > max_bytes:
                chunks.append(current)
                current, size = [], 0
            current.append(name)
            size += nbytes
        return [*chunks, current] if current else chunks

    def _gather_broadcast(self, ctx, executor, *, group) -> None:
        """One sync in rounds of ``_gather_broadcast_chunks``: per round the trainer ranks gather
        that chunk's parameters whole (collective), the first packs them into its one reused bucket
        and sends it to every generator rank, which copies its box of each out of its own bucket."""
        if self.layout is None:
            self._handshake(ctx, executor, group=group)
        leader = ctx.leader(self.outbound)
        version = torch.zeros(1, dtype=torch.int64, device=ctx.device)
        dtype = DTYPES[self.layout["dtype"]]
        shapes = dict(zip(self.layout["names"], self.layout["shapes"]))
        chunks = self._gather_broadcast_chunks()
        largest = max((sum(math.prod(shapes[n]) for n in chunk) for chunk in chunks), default=0)
        params = dict(executor.get_model().named_parameters())
        moved = 0
        if ctx.executor == self.outbound:
            bucket = torch.empty(largest, dtype=dtype, device=ctx.device) if ctx.rank == leader else None
            ops = []
            if ctx.rank == leader:
                version.fill_(int(executor.version))
                ops = [dist.P2POp(dist.isend, version, dst, group=group) for dst in ctx.ranks[self.inbound]]
            for chunk in chunks:
                offset = 0
                for name in chunk:
                    param = params[name]
                    full = (param.full_tensor() if isinstance(param, DTensor) else param).detach()  # collective
                    if bucket is not None:
                        size = full.numel()
                        bucket[offset : offset + size].copy_(full.reshape(-1))
                        offset += size
                    del full
                if bucket is not None:
                    ops += [dist.P2POp(dist.isend, bucket[:offset], dst, group=group) for dst in ctx.ranks[self.inbound]]
                    _wait(ops)
                    ops = []
                    moved += offset * dtype.itemsize
            _wait(ops)
            if ctx.rank == leader:
                self.bytes_sent = {(ctx.rank, dst): moved for dst in ctx.ranks[self.inbound]}
        else:
            # Every generator rank receives every full parameter; a TP rank keeps its box of each
            # (what verl / OpenRLHF do for TP engines), a replica keeps all of it.
            sink = weight_sink_of(executor)
            rounds = self._gather_broadcast_receive(ctx, params, chunks=chunks, shapes=shapes, dtype=dtype,
                                                    largest=largest, version=version, stream=sink is not None,
                                                    group=group)
            feed(sink, rounds, label=f"weight channel {self.name!r}")
            moved = sum(math.prod(shapes[n]) for chunk in chunks for n in chunk) * dtype.itemsize
            self.bytes_received = {(leader, ctx.rank): moved}
            executor.set_weights_version(int(version.item()))

    def _gather_broadcast_receive(self, ctx, params: dict, *, chunks, shapes, dtype, largest, version, stream: bool,
                                  group):
        """A generator rank's side of the gather-broadcast rounds, as an iterator: each round's
        bucket copied into the parameters (nothing yielded), or with ``stream`` each parameter's
        box of it yielded as a tensor of its own (the bucket is reused by the next round)."""
        leader = ctx.leader(self.outbound)
        boxes = self.layout["boxes"]
        bucket = torch.empty(largest, dtype=dtype, device=ctx.device)
        ops = [dist.P2POp(dist.irecv, version, leader, group=group)]
        for chunk in chunks:
            numel = sum(math.prod(shapes[n]) for n in chunk)
            _wait([*ops, dist.P2POp(dist.irecv, bucket[:numel], leader, group=group)])
            ops = []
            offset = 0
            for n in chunk:
                size = math.prod(shapes[n])
                box = bucket[offset : offset + size].view(shapes[n])[box_index(boxes[n])]
                offset += size
                if stream:
                    yield n, box.clone()
                else:
                    with torch.no_grad():
                        local_tensor(params[n]).copy_(box)
        _wait(ops)
