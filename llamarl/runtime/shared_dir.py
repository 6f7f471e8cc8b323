"""A start-up check that every rank of the job sees the same run directory.

Checkpoints, metrics, timelines and the final export are written by some ranks and read by others
(rank 0 reads every rank's timeline; a resume reads the shards every rank wrote), so the run
directory must be one filesystem that every node mounts (NFS, Lustre, a cluster's shared home).
On a multi-node job whose ``--run.output-dir`` is node-local (``/tmp``, a local SSD), each node
would write its own partial run and the first resume would fail far from the cause. This check
runs once, right after the world is made: global rank 0 writes a marker file named by a random
number it broadcasts (a tensor: nothing is unpickled), every rank looks for it, and the ranks that
cannot see it are gathered (a tensor of flags) so that every rank raises the same one-line error
naming them, before any work is done. The marker is removed afterwards.
"""

from __future__ import annotations

import random
from pathlib import Path

import torch
import torch.distributed as dist


def check_shared_run_dir(run_dir: Path, *, device: torch.device, group: dist.ProcessGroup | None = None) -> None:
    """Raise ``ValueError`` on every rank of ``group`` (default: the world) unless all of them see
    the same ``run_dir`` (module docstring). ``run_dir`` must exist on every rank; ``device`` is the
    rank's own (``ctx.device``), where the collectives' tensors live."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    first = dist.get_global_rank(group, 0) if group is not None else 0
    nonce = torch.tensor([random.SystemRandom().getrandbits(62) if rank == 0 else 0], dtype=torch.int64,
                         device=device)
    dist.broadcast(nonce, src=first, group=group)
    marker = run_dir / f".shared-check-{int(nonce.item())}"
    if rank == 0:
        marker.write_text("written by rank 0 to check that every rank sees this directory\n")
    dist.barrier(group=group)
    sees = torch.zeros(size, dtype=torch.int64, device=device)
    sees[rank] = int(marker.exists())
    dist.all_reduce(sees, group=group)  # each rank filled its own slot: the sum is the gather
    dist.barrier(group=group)
    if rank == 0:
        marker.unlink(missing_ok=True)
    blind = [r for r, seen in enumerate(sees.tolist()) if not seen]
    if blind:
        ranks = blind if group is None else [dist.get_global_rank(group, r) for r in blind]
        raise ValueError(
            f"the run directory {run_dir} is not shared: ranks {ranks} do not see the file rank {first} wrote "
            f"there; put --run.output-dir on a filesystem every node mounts (NFS, Lustre, a shared home)")
