"""Which process group every point-to-point operation of the channels goes through, in a world
mixing GPU and CPU executors (llamarl/runtime/placement.py: ``p2p_group``), checked on CPU.

A mixed world needs GPUs, so here its ranks are threads of one process and ``dist.P2POp`` /
``dist.batch_isend_irecv`` are replaced by an in-process transport that records each operation's
group: GPU-to-GPU links must send on the world's GPU-only group (on WORLD their first CUDA
``batch_isend_irecv`` would wait for the CPU ranks forever), links touching a CPU executor and
worlds of one kind on WORLD (``group=None``), exactly as before. The batches and weights still
arrive, so the transport is a faithful stand-in for the order both backends keep per pair.
"""

import queue
import sys
import threading
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parent))
from worlds.channels_world import make_batch

from llamarl.channels.base import GATHER, SCATTER, CommunicationChannel
from llamarl.channels.p2p import exchange
from llamarl.channels.weights import WeightsChannel
from llamarl.runtime.batch import TensorBatch
from llamarl.runtime.world import ExecutorContext

GPU_GROUP = SimpleNamespace(name="gpu-only")  # stands for a GPU rank's handle of the GPU-only group
# The docs' 9-ranks-on-8-GPUs layout, shrunk: generator and trainer on GPUs, the reward on the host.
RANKS = {"generator": [0, 1], "reward": [2], "trainer": [3, 4]}
MIXED = {"generator": "cuda", "reward": "cpu", "trainer": "cuda"}


class ThreadTransport:
    """Point-to-point between "ranks" that are threads: an isend queues a copy of its tensor for
    (src, dst), an irecv takes the oldest one of (src, dst), the per-pair order NCCL and gloo keep.
    ``ops`` records ``(rank, op name, peer, group)`` of every operation."""

    def __init__(self, monkeypatch):
        self.local = threading.local()
        self.lock = threading.Lock()
        self.queues: dict[tuple[int, int], queue.Queue] = defaultdict(queue.Queue)
        self.ops: list[tuple[int, str, int, object]] = []
        monkeypatch.setattr(dist, "P2POp", self.P2POp)
        monkeypatch.setattr(dist, "batch_isend_irecv", self.batch_isend_irecv)

    @staticmethod
    def P2POp(op, tensor, peer=None, group=None, tag=0, group_peer=None):  # torch's name and signature
        return SimpleNamespace(op=op, tensor=tensor, peer=peer, group=group)

    def batch_isend_irecv(self, ops):
        assert len({id(o.group) for o in ops}) == 1, "torch refuses a batch over several groups"
        me = self.local.rank
        with self.lock:
            self.ops += [(me, o.op.__name__, o.peer, o.group) for o in ops]
            boxes = {id(o): self.queues[(me, o.peer) if o.op is dist.isend else (o.peer, me)] for o in ops}
        for o in ops:
            if o.op is dist.isend:
                boxes[id(o)].put(o.tensor.clone())
        for o in ops:
            if o.op is dist.irecv:
                o.tensor.copy_(boxes[id(o)].get(timeout=30))
        return []

    def run(self, jobs: dict[int, callable]) -> dict[int, object]:
        """Run ``jobs[rank]()`` for every rank at once, each in a thread that is that rank."""
        def as_rank(rank):
            self.local.rank = rank
            return jobs[rank]()
        with ThreadPoolExecutor(len(jobs)) as pool:
            futures = {rank: pool.submit(as_rank, rank) for rank in jobs}
            return {rank: future.result(timeout=60) for rank, future in futures.items()}

    def groups(self) -> set:
        return {id(group) for *_, group in self.ops}


def context(executor: str, rank: int, kinds: dict[str, str]) -> ExecutorContext:
    """A rank's context in a world of ``kinds``; CPU tensors throughout (no CUDA here), the kinds
    alone deciding links. GPU ranks of a mixed world hold the GPU-only group, as ``create_all`` makes."""
    mixed = len(set(kinds.values())) > 1
    return ExecutorContext(rank=rank, world_size=5, executor=executor, ranks=RANKS, group=None, mesh=None,
                           device=torch.device("cpu"), device_kinds=kinds, world_device=torch.device("cpu"),
                           gpu_group=GPU_GROUP if mixed and kinds[executor] == "cuda" else None)


def executor_of(rank: int) -> str:
    return next(name for name, ranks in RANKS.items() if rank in ranks)


class Endpoint:
    def __init__(self, rank: int):
        self.rank, self.received = rank, None

    def get_output(self, name):
        return make_batch(self.rank - RANKS["trainer"][0], "scatter")

    def set_input(self, name, batch):
        self.received = batch


def test_exchange_sends_every_operation_through_the_group_it_is_given(monkeypatch):
    transport = ThreadTransport(monkeypatch)
    batch = make_batch(0, "scatter")
    got = transport.run({0: lambda: exchange({0: batch}, [0], device=torch.device("cpu"), group=GPU_GROUP)})[0]
    assert torch.equal(got[0]["tokens"], batch["tokens"]) and got[0].get_strings("text") == batch.get_strings("text")
    assert len(transport.ops) == 6 and transport.groups() == {id(GPU_GROUP)}  # sizes, headers, data: both ways


@pytest.mark.parametrize(("kinds", "inbound", "kind", "group"), [
    (MIXED, "generator", SCATTER, GPU_GROUP),  # GPU -> GPU in a mixed world: the GPU-only group
    (MIXED, "reward", GATHER, None),  # GPU -> CPU: host buffers on WORLD's gloo part
    ({name: "cpu" for name in MIXED}, "generator", SCATTER, None),  # a gloo world, as before
    ({name: "cuda" for name in MIXED}, "generator", SCATTER, None),  # an all-GPU world: WORLD's NCCL
], ids=["mixed-gpu-gpu", "mixed-gpu-cpu", "cpu-world", "gpu-world"])
def test_a_data_channel_sends_on_the_group_of_its_link(monkeypatch, kinds, inbound, kind, group):
    transport = ThreadTransport(monkeypatch)
    endpoints = {rank: Endpoint(rank) for rank in RANKS["trainer"] + RANKS[inbound]}

    def job(rank):  # a channel per rank, as each process holds its own
        channel = CommunicationChannel("rollouts", "trainer", inbound, kind)
        return lambda: channel.communicate(context(executor_of(rank), rank, kinds), endpoints[rank])
    transport.run({rank: job(rank) for rank in endpoints})
    full = TensorBatch.concat([make_batch(0, "scatter"), make_batch(1, "scatter")])
    parts = [endpoints[rank].received for rank in RANKS[inbound]]
    assert sum(len(p) for p in parts) == len(full)  # the scatter's two hops, or the gather, arrived
    assert {rank for rank, *_ in transport.ops} == set(endpoints)
    assert transport.groups() == {id(group)}


class WeightsEnd:
    """A trainer (``version``) or generator (``set_weights_version``) holding a tiny plain model."""

    def __init__(self, seed: int | None):
        self.model = torch.nn.Linear(4, 3)
        with torch.no_grad():
            for param in self.model.parameters():
                param.copy_(torch.randn(param.shape, generator=torch.Generator().manual_seed(seed))
                            if seed is not None else torch.zeros(param.shape))
        self.version, self.synced = 7, None

    def get_model(self):
        return self.model

    def set_weights_version(self, version):
        self.synced = version


@pytest.mark.parametrize("mode", ["ddma", "gather_broadcast"])
@pytest.mark.parametrize(("kinds", "group"), [(MIXED, GPU_GROUP), ({name: "cpu" for name in MIXED}, None)],
                         ids=["mixed-gpu-gpu", "cpu-world"])
def test_a_weight_sync_between_gpu_executors_of_a_mixed_world_sends_on_the_gpu_only_group(monkeypatch, mode,
                                                                                          kinds, group):
    """The docs' 9-ranks-on-8-GPUs launch hung at its first weight sync: CUDA P2P on WORLD."""
    transport = ThreadTransport(monkeypatch)
    ends = {0: WeightsEnd(None), 1: WeightsEnd(None), 3: WeightsEnd(1), 4: WeightsEnd(1)}

    def job(rank):  # a channel per rank: its plan and buckets are the rank's own
        channel = WeightsChannel("weights", "trainer", "generator", mode=mode)
        return lambda: channel.communicate(context(executor_of(rank), rank, kinds), ends[rank])
    transport.run({rank: job(rank) for rank in ends})
    for rank in RANKS["generator"]:
        assert ends[rank].synced == 7
        assert all(torch.equal(a, b) for a, b in zip(ends[rank].model.parameters(), ends[3].model.parameters()))
    assert {rank for rank, *_ in transport.ops} == set(ends)  # every rank of both ends took part
    assert transport.groups() == {id(group)}
