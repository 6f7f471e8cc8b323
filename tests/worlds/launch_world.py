"""A trivial world for the launch-script tests: all-reduce over gloo, write what this rank saw.

Writes ``$LAUNCH_OUT/rank<r>.json`` with the rank, world size, local rank, node (torchrun's
``GROUP_RANK``) and the all-reduced sum of ``rank + 1``.
"""

import json
import os
from pathlib import Path

import torch
import torch.distributed as dist

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
value = torch.tensor([rank + 1.0], device="cpu")
dist.all_reduce(value)
Path(os.environ["LAUNCH_OUT"], f"rank{rank}.json").write_text(json.dumps({
    "rank": rank, "world_size": world, "local_rank": int(os.environ["LOCAL_RANK"]),
    "node": int(os.environ["GROUP_RANK"]), "sum": value.item()}))
dist.barrier()
dist.destroy_process_group()
