"""ExecutorContext: splits the torchrun world into executors and owns every process group.

Every process group and DeviceMesh in llamarl is created here, once, in the same order on every
rank (``new_group`` is collective over the world, so order matters). Library code receives the
group / mesh it needs explicitly and never assumes ``torch.distributed.group.WORLD`` is "my
executor". Channels send point-to-point by global rank, on the world group, or in a world
mixing GPU and CPU ranks on the GPU-only group between two GPU executors (``ctx.gpu_group``,
``llamarl/runtime/placement.py``: ``p2p_group``); the context maps executor names to global rank ranges
for them.

Tensor parallelism: an executor declared with ``ExecutorSpec(name, num_ranks, tp=N)`` (N > 1)
lays its ranks out as a 2-D ``(dp, tp)`` grid, tp innermost (consecutive ranks share a TP group),
and its ``ctx.mesh`` is a 2-D DeviceMesh with dim names ``("dp", "tp")`` (``ctx.mesh["tp"]`` is
the TP sub-mesh). Every TP and DP group of every such executor is created on every rank, so no
collective is entered by only some ranks. With ``tp == 1`` (the default) ``ctx.mesh`` stays the
1-D mesh over the executor's ranks (the trainer's FSDP2 relies on it). ``ctx.group`` is always
the whole executor's group.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from llamarl.runtime.placement import DEVICES, MIXED_BACKEND, device_kinds, is_mixed, link_device, p2p_group
from llamarl.runtime.preflight import stop_after_checks

# Set once this process starts to make the world; never reset (llamarl/runtime/errors.py: what counts as a
# configuration error).
_world_made = False


def world_made() -> bool:
    """Whether this process has started to make (or joined) a torch.distributed world: True from
    just before ``ExecutorContext.create`` initialises it, and after the world is destroyed."""
    return _world_made or dist.is_initialized()


@dataclass(frozen=True)
class ExecutorSpec:
    """One executor's name, how many consecutive ranks it owns (in spec order), and its TP degree.

    ``tp > 1`` makes the executor's mesh 2-D ``(dp, tp)`` with ``dp = num_ranks // tp``;
    ``num_ranks`` must then be a multiple of ``tp`` (checked by ``plan_ranks``).
    ``colocate_with`` names another executor, one with ranks of its own, whose ranks this one shares
    (co-resident: both run on each of those ranks, stepping in spec order); ``num_ranks`` is then
    that executor's.
    """

    name: str
    num_ranks: int
    tp: int = 1
    colocate_with: str | None = None
    device: str = "auto"
    """``auto``: the rank's GPU on a CUDA machine (the host beyond the node's GPUs), else the CPU;
    ``cpu``: the host even where GPUs exist (``llamarl/runtime/placement.py``)."""


def plan_ranks(specs: list[ExecutorSpec], world_size: int) -> dict[str, list[int]]:
    """Assign consecutive global rank ranges to the executors with ranks of their own, in the given
    order; a co-resident executor (``colocate_with``) gets its host's range.

    Raises ValueError (before any collective) on an empty executor, a duplicate name, a host that
    is not an executor with ranks of its own, or a split that does not add up to ``world_size``.
    """
    if not specs:
        raise ValueError("at least one executor is needed")
    names = [s.name for s in specs]
    if len(set(names)) != len(names):
        raise ValueError(f"executor names must be unique, got {names}")
    hosts = {s.name: s for s in specs if s.colocate_with is None}
    for spec in specs:
        if spec.colocate_with is not None:
            host = hosts.get(spec.colocate_with)
            if host is None:
                raise ValueError(f"executor {spec.name!r} shares the ranks of {spec.colocate_with!r}, which must be an "
                                 f"executor with ranks of its own; have {list(hosts)}")
            if spec.num_ranks != host.num_ranks:
                raise ValueError(f"executor {spec.name!r} shares the {host.num_ranks} ranks of {host.name!r} but "
                                 f"declares {spec.num_ranks}")
        if spec.num_ranks < 1:
            raise ValueError(f"executor {spec.name!r} has {spec.num_ranks} ranks; every executor needs >= 1")
        if spec.device not in DEVICES:
            raise ValueError(f"executor {spec.name!r}: device must be one of {DEVICES}, got {spec.device!r}")
        if spec.tp < 1 or spec.num_ranks % spec.tp:
            raise ValueError(f"executor {spec.name!r}: num_ranks ({spec.num_ranks}) must be a multiple of tp ({spec.tp})")
    total = sum(s.num_ranks for s in hosts.values())
    if total != world_size:
        split = " + ".join(f"{s.name}={s.num_ranks}" for s in hosts.values())
        raise ValueError(f"rank split {split} = {total} does not match the world size {world_size}")
    own, start = {}, 0
    for spec in hosts.values():
        own[spec.name] = list(range(start, start + spec.num_ranks))
        start += spec.num_ranks
    return {spec.name: own[spec.colocate_with or spec.name] for spec in specs}


def tp_grid(ranks: list[int], tp: int) -> list[list[int]]:
    """The ``(dp, tp)`` grid of ``ranks``: row ``d`` is DP replica ``d``'s TP group (tp innermost).

    Column ``t`` of the grid is the DP group of TP rank ``t``. ValueError when ``len(ranks)`` is
    not a multiple of ``tp``.
    """
    if tp < 1 or len(ranks) % tp:
        raise ValueError(f"{len(ranks)} ranks cannot be split into TP groups of {tp}")
    return [ranks[i : i + tp] for i in range(0, len(ranks), tp)]


def device_type() -> str:
    """``cuda`` when CUDA is available (each rank then uses its own GPU), else ``cpu``."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def default_backend() -> str:
    """``nccl`` on CUDA, else ``gloo``."""
    return "nccl" if device_type() == "cuda" else "gloo"


@dataclass
class ExecutorContext:
    """This rank's view of the split world.

    Attributes: ``rank`` / ``world_size`` (global), ``executor`` (this rank's executor name),
    ``ranks`` (executor name -> global ranks), ``group`` (this executor's process group),
    ``mesh`` (a 1-D DeviceMesh over this executor's ranks, or the 2-D ``("dp", "tp")`` mesh when
    its spec has ``tp > 1``), ``device``, ``tp_sizes`` (executor name -> TP degree; missing
    means 1), ``device_kinds`` (executor name -> ``cuda`` / ``cpu``; missing means this rank's
    kind) and ``world_device``: where WORLD-wide collectives put their tensors, the host when the
    world mixes GPU and CPU executors, else ``device`` (``llamarl/runtime/placement.py``).
    ``gpu_group``: in a mixed world, this GPU rank's handle of the NCCL group over exactly the GPU
    ranks, its communicator already made, through which GPU-to-GPU point-to-point goes
    (``link_group``); None when the world is not mixed, and on a CPU rank (not a member).
    """

    rank: int
    world_size: int
    executor: str
    ranks: dict[str, list[int]]
    group: dist.ProcessGroup | None
    mesh: DeviceMesh | None
    device: torch.device
    tp_sizes: dict[str, int] = field(default_factory=dict)
    device_kinds: dict[str, str] = field(default_factory=dict)
    world_device: torch.device | None = None
    gpu_group: dist.ProcessGroup | None = None

    def __post_init__(self) -> None:
        if self.world_device is None:
            self.world_device = self.device

    @property
    def mixed(self) -> bool:
        """Whether this world's executors mix GPUs and CPUs (``llamarl/runtime/placement.py``)."""
        return is_mixed(self.device_kinds)

    @property
    def kind(self) -> str:
        """This executor's kind of device, ``cuda`` or ``cpu`` (``device_kinds``; missing: the
        device's type). A peer missing from ``device_kinds`` is taken to be of this kind."""
        return self.device_kinds.get(self.executor, self.device.type)

    def link_device(self, peer: str) -> torch.device:
        """Where a batch to or from executor ``peer`` is staged (``placement.link_device``)."""
        return link_device(self.device, self.kind, self.device_kinds.get(peer, self.kind))

    def link_group(self, peer: str) -> dist.ProcessGroup | None:
        """The process group point-to-point to or from executor ``peer`` goes through
        (``placement.p2p_group``): None (WORLD) unless both ends are GPU executors of a mixed world,
        then ``gpu_group``. Both ends of a link compute the same group."""
        return p2p_group(src_kind=self.kind, dst_kind=self.device_kinds.get(peer, self.kind), mixed=self.mixed,
                         gpu_group=self.gpu_group)

    @staticmethod
    def create(specs: list[ExecutorSpec], **options) -> ExecutorContext:
        """``create_all(specs, **options)``'s context of this rank's first executor (the only one
        unless executors are co-resident)."""
        return next(iter(ExecutorContext.create_all(specs, **options).values()))

    @staticmethod
    def create_all(
        specs: list[ExecutorSpec],
        *,
        timeout_s: float = 300.0,
        backend: str | None = None,
    ) -> dict[str, ExecutorContext]:
        """Initialise torch.distributed (from torchrun env vars) and split the world; return the
        context of each executor on this rank (several when executors are co-resident), in spec order.

        Channel endpoints are checked by whoever holds the channels (``Pipeline``, the controller:
        ``channels.base.check_endpoints``), not here. ``timeout_s`` is the
        collective timeout of every group: a peer that died turns into an error, not a hang.
        Co-resident executors share their host's process group.
        """
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
        ranges = plan_ranks(specs, world_size)
        backend = backend or default_backend()
        kinds, gpu_index = device_kinds(specs, ranges, cuda=backend == "nccl", gpus_per_node=_gpus_per_node(),
                                        ranks_per_node=int(os.environ.get("LOCAL_WORLD_SIZE", str(world_size))))
        mixed = is_mixed(kinds)
        stop_after_checks()  # ``python -m llamarl.runtime.preflight``: every pre-world check has passed
        rank = dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", "0"))
        on_gpu = kinds[next(s.name for s in specs if rank in ranges[s.name])] == "cuda"
        if mixed:  # llamarl/runtime/placement.py: both backends in every group, nothing bound to a device
            backend = MIXED_BACKEND
        elif "cuda" not in kinds.values():
            backend = "gloo"  # every executor asked for the host
        timeout = timedelta(seconds=timeout_s)
        global _world_made
        _world_made = True
        if not dist.is_initialized():
            device_id = None
            if on_gpu:
                # The rank's own GPU (its LOCAL_RANK, unless CPU ranks before it on the node left it
                # another: llamarl/runtime/placement.py), set before the group exists and bound to it
                # (device_id), so barriers and collectives never guess the device from the context.
                local = gpu_index[rank] if mixed else int(os.environ.get("LOCAL_RANK", "0"))
                device_id = torch.device("cuda", local)
                torch.cuda.set_device(device_id)
            dist.init_process_group(backend=backend, timeout=timeout, device_id=None if mixed else device_id)
        rank = dist.get_rank()
        device = torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu")
        world_device = torch.device("cpu") if mixed else device
        # NCCL: the device was set before the group was made (above), and one WORLD-wide collective
        # runs before any sub-group or point-to-point traffic, so every rank's communicator exists
        # and a first P2P between a subset of ranks is never the first operation on WORLD (which
        # NCCL documents as undefined). Cheap and harmless under gloo, so it always runs.
        dist.all_reduce(torch.zeros(1, device=world_device))
        groups = {}
        # new_group is collective over WORLD: every rank creates every group, in spec order.
        for spec in specs:
            if spec.colocate_with is None:
                groups[spec.name] = dist.new_group(ranges[spec.name], timeout=timeout, backend=backend)
        for spec in specs:
            if spec.colocate_with is not None:
                groups[spec.name] = groups[spec.colocate_with]
        mine = [spec.name for spec in specs if rank in ranges[spec.name]]
        meshes = {name: DeviceMesh.from_group(groups[name], device.type, mesh=ranges[name]) for name in mine}
        # Then every TP / DP group of every TP executor, again on every rank in spec order.
        for spec in specs:
            if spec.tp == 1:
                continue
            grid = tp_grid(ranges[spec.name], spec.tp)
            tp_group, dp_group = _grid_groups(grid, rank=rank, timeout=timeout, backend=backend)
            if spec.name in mine:
                # from_group takes this rank's group per mesh dim: no further collective.
                meshes[spec.name] = DeviceMesh.from_group([dp_group, tp_group], device.type, mesh=grid,
                                                          mesh_dim_names=("dp", "tp"))
        gpu_group = None
        if mixed:  # last, after every other group: the same order on every rank
            gpu_group = _gpu_only_group(specs, ranges, kinds, on_gpu=on_gpu, device=device, timeout=timeout)
        tp_sizes = {s.name: s.tp for s in specs}
        return {name: ExecutorContext(rank=rank, world_size=world_size, executor=name, ranks=ranges,
                                      group=groups[name], mesh=meshes[name], device=device, tp_sizes=tp_sizes,
                                      device_kinds=kinds, world_device=world_device, gpu_group=gpu_group)
                for name in mine}

    @property
    def local_rank(self) -> int:
        """This rank's index inside its executor."""
        return self.ranks[self.executor].index(self.rank)

    @property
    def local_world_size(self) -> int:
        return len(self.ranks[self.executor])

    @property
    def tp_size(self) -> int:
        """This executor's TP degree (1 without tensor parallelism)."""
        return self.tp_sizes.get(self.executor, 1)

    @property
    def tp_rank(self) -> int:
        """This rank's index inside its TP group (0 without tensor parallelism)."""
        return self.local_rank % self.tp_size

    @property
    def dp_size(self) -> int:
        """Data-parallel replicas of this executor (its ranks without TP)."""
        return self.local_world_size // self.tp_size

    @property
    def dp_rank(self) -> int:
        """This rank's data-parallel replica index (``local_rank`` without TP)."""
        return self.local_rank // self.tp_size

    @property
    def tp_mesh(self) -> DeviceMesh | None:
        """The 1-D TP sub-mesh of this rank's TP group, or None without tensor parallelism."""
        return self.mesh["tp"] if self.tp_size > 1 else None

    def leader(self, executor: str) -> int:
        """Global rank of ``executor``'s first rank."""
        return self.ranks[executor][0]

    def destroy(self) -> None:
        """Tear down the default group (and with it every subgroup)."""
        if dist.is_initialized():
            dist.destroy_process_group()


def _gpus_per_node() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def world_barrier(ctx: ExecutorContext) -> None:
    """A barrier over WORLD: ``dist.barrier()``, or in a world mixing GPU and CPU ranks an
    all-reduce of one host tensor (every rank then takes the same backend, gloo)."""
    if not ctx.mixed:
        dist.barrier()
    else:
        dist.all_reduce(torch.zeros(1, device=ctx.world_device))


def _gpu_only_group(specs: list[ExecutorSpec], ranges: dict[str, list[int]], kinds: dict[str, str], *,
                    on_gpu: bool, device: torch.device, timeout: timedelta) -> dist.ProcessGroup | None:
    """A mixed world's NCCL group over exactly its GPU ranks; this rank's handle, None on a CPU rank.

    Collective over WORLD (``new_group``): every rank calls it, with the same arguments. The GPU
    ranks then run one CUDA all-reduce on it, so its communicator exists before any point-to-point:
    NCCL makes a communicator with every rank of its group taking part, which the CPU ranks never
    would on WORLD, and a first batched P2P over a subset of a group is undefined.
    """
    gpu_ranks = sorted(r for s in specs if s.colocate_with is None and kinds[s.name] == "cuda"
                       for r in ranges[s.name])
    group = dist.new_group(gpu_ranks, timeout=timeout, backend="nccl")
    if not on_gpu:
        return None  # a non-member's handle (GroupMember.NON_GROUP_MEMBER) is no group to send on
    dist.all_reduce(torch.zeros(1, device=device), group=group)
    return group


def _grid_groups(grid: list[list[int]], *, rank: int, timeout: timedelta,
                 backend: str) -> tuple[dist.ProcessGroup | None, dist.ProcessGroup | None]:
    """Create every TP group (grid rows) then every DP group (columns); return this rank's pair.

    Collective over WORLD: every rank must call it with the same grid. A rank outside the grid
    gets ``(None, None)``.
    """
    mine_tp = mine_dp = None
    for row in grid:
        group = dist.new_group(row, timeout=timeout, backend=backend)
        if rank in row:
            mine_tp = group
    for column in zip(*grid):
        group = dist.new_group(list(column), timeout=timeout, backend=backend)
        if rank in column:
            mine_dp = group
    return mine_tp, mine_dp
