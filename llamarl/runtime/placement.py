"""Which device each executor runs on: a GPU of its rank's own, or the host's CPU.

On a CUDA machine every rank gets a GPU of its node and NCCL, except the ranks of an executor
asked to run on CPU (``ExecutorSpec(device="cpu")``, e.g. ``--reward.device cpu``: a reward
executor scores on the host and need not hold a GPU) and the ranks left without a GPU. The ranks
that may hold one take the node's GPUs in local-rank order, so a CPU rank does not use up a GPU:
``torchrun --nproc-per-node 9`` on 8 GPUs with ``--generator.num-ranks 2 --reward.num-ranks 1
--reward.device cpu`` puts the generator on GPUs 0-1, the reward on the host and the six trainer
ranks on GPUs 2-7. Without a CPU stage the same launch leaves local rank 8 without a GPU, and
whichever executor owns it runs on the host if all its ranks do. An executor runs on one kind of
device: one whose ranks would straddle GPUs and the host is a one-line ValueError saying how to
fix the launch.

A world whose ranks mix the two (``mixed``) is built differently (``llamarl/runtime/world.py``): every
process group gets both backends (``cpu:gloo,cuda:nccl``: CUDA tensors go through NCCL, host
tensors through gloo), no group is bound to a device (NCCL's eager set-up is a collective the CPU
ranks would never join), and whatever crosses from one kind of executor to the other is staged on
the host: WORLD-wide collectives (barriers, the metrics of every stage, the run directory's
checks) use CPU tensors on every rank (``ExecutorContext.world_device``), and a data channel
between a GPU and a CPU executor sends host buffers both ways (``ExecutorContext.link_device``),
the receiving GPU executor moving the batch to its GPU. A weights channel needs both ends on the
same kind of device (one-line ValueError otherwise). A world of one kind is built exactly as
before: NCCL bound to each rank's GPU, or gloo on CPU.

Point-to-point in a mixed world (``p2p_group``): NCCL creates a group's communicator on the first
operation that needs it, with every rank of the group taking part; WORLD's NCCL part would need
the CPU ranks, which never send CUDA tensors, so a first CUDA ``batch_isend_irecv`` on WORLD would
hang. The world therefore also holds one NCCL group over exactly the GPU ranks, warmed by one
collective on them (``ExecutorContext.gpu_group``), and a link between two GPU executors sends
through it; a link touching a CPU executor sends host buffers through WORLD's gloo part.

The layout is decided without communication, the same way on every rank, from the specs, the
world size and each node's GPU count (``torch.cuda.device_count()``) and ranks per node
(torchrun's ``LOCAL_WORLD_SIZE``), assuming nodes alike (torchrun's ``--nproc-per-node`` is one
number). Decision recorded: no GPU sharing between ranks of one node (two NCCL ranks on one GPU
are not supported), so a rank beyond the GPUs gets the host, never a GPU already taken.
"""

from __future__ import annotations

import torch

MIXED_BACKEND = "cpu:gloo,cuda:nccl"
DEVICES = ("auto", "cpu")
KINDS = ("cuda", "cpu")  # what device_kinds decides for each executor


def device_kinds(specs, ranges: dict[str, list[int]], *, cuda: bool, gpus_per_node: int,
                 ranks_per_node: int) -> tuple[dict[str, str], dict[int, int]]:
    """``(executor name -> "cuda" or "cpu", global rank -> its GPU's index on its node)`` (module
    docstring). On each node the ranks that may hold a GPU (those of executors not asked for CPU)
    take the node's GPUs in local-rank order, so a CPU rank frees its GPU for the next rank; ranks
    left without one run on the host. ``ranges``: ``plan_ranks``'s. ValueError for an executor
    whose ranks would straddle GPUs and the host, or a co-resident executor asked for CPU on GPU
    ranks."""
    if not cuda:
        return {spec.name: "cpu" for spec in specs}, {}
    wants_cpu = {r for spec in specs if spec.colocate_with is None and spec.device == "cpu" for r in ranges[spec.name]}
    world_size = sum(len(ranges[s.name]) for s in specs if s.colocate_with is None)
    gpu_index: dict[int, int] = {}
    for node_start in range(0, world_size, ranks_per_node):
        eligible = [r for r in range(node_start, min(node_start + ranks_per_node, world_size)) if r not in wants_cpu]
        gpu_index |= {r: i for i, r in enumerate(eligible[:gpus_per_node])}
    kinds: dict[str, str] = {}
    for spec in specs:
        if spec.colocate_with is not None:
            continue
        ranks = ranges[spec.name]
        on_gpu = [r for r in ranks if r in gpu_index]
        if len(on_gpu) == len(ranks):
            kinds[spec.name] = "cuda"
        elif not on_gpu:
            kinds[spec.name] = "cpu"
        else:
            raise ValueError(
                f"executor {spec.name!r} has ranks {on_gpu} on GPUs and ranks {[r for r in ranks if r not in on_gpu]} "
                f"left without one ({gpus_per_node} GPUs, {ranks_per_node} ranks per node): an executor runs on one "
                "kind of device; run fewer ranks per node, or put a stage that needs no GPU on the host "
                "(e.g. --reward.device cpu) to free its GPUs")
    for spec in specs:
        if spec.colocate_with is not None:
            host = kinds[spec.colocate_with]
            if spec.device == "cpu" and host != "cpu":
                raise ValueError(f"executor {spec.name!r} shares the GPU ranks of {spec.colocate_with!r}, so it runs "
                                 f"on their GPUs; to run it on CPU give it ranks of its own")
            kinds[spec.name] = host
    return kinds, gpu_index


def is_mixed(kinds: dict[str, str]) -> bool:
    """Whether the world's ranks mix GPUs and CPUs."""
    return len(set(kinds.values())) > 1


def link_device(own: torch.device, own_kind: str, peer_kind: str) -> torch.device:
    """Where a batch between an executor on ``own`` (of kind ``own_kind``) and one of
    ``peer_kind`` is staged: its own device between alike executors, the host between a GPU and
    a CPU one (the two ends agree: both compute the host)."""
    return own if own_kind == peer_kind else torch.device("cpu")


def p2p_group(*, src_kind: str, dst_kind: str, mixed: bool, gpu_group):
    """The process group a point-to-point link between an executor of ``src_kind`` and one of
    ``dst_kind`` sends through (module docstring); pure, the same answer at both ends.

    ``None`` (WORLD) in a world of one kind, and for a link touching a CPU executor in a mixed
    world (its buffers are on the host: ``link_device``; WORLD's gloo part moves them). A link
    between two GPU executors in a mixed world gets ``gpu_group``, the world's GPU-only NCCL group
    (this rank's handle of it). ValueError for a kind not in ``KINDS``, or for such a link without a
    GPU-only group (a world built elsewhere than ``ExecutorContext.create_all``).
    """
    for end, kind in (("source", src_kind), ("destination", dst_kind)):
        if kind not in KINDS:
            raise ValueError(f"point-to-point link: the {end} kind must be one of {KINDS}, got {kind!r}")
    if not mixed or "cpu" in (src_kind, dst_kind):
        return None
    if gpu_group is None:
        raise ValueError("point-to-point link between two GPU executors in a mixed world without its GPU-only "
                         "group: CUDA tensors on WORLD would wait for the CPU ranks forever (llamarl/runtime/placement.py)")
    return gpu_group
