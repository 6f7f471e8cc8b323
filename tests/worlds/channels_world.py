"""A 4-rank world (a = ranks 0-1, b = ranks 2-3) that sends every channel kind a -> b.

Each rank of ``a`` builds ``make_batch(rank, case)``; each rank of ``b`` dumps what it received
(encoded with the wire format) to ``<out>/<case>_rank<r>.{header,data}`` for the test to check.

usage: channels_world.py --out OUT_DIR
"""

import argparse
from pathlib import Path

import torch

from llamarl.channels.base import BROADCAST, GATHER, SCATTER, CommunicationChannel
from llamarl.runtime.batch import TensorBatch
from llamarl.runtime.executor import Executor
from llamarl.runtime.world import ExecutorContext, ExecutorSpec

CASES = {"broadcast": BROADCAST, "scatter": SCATTER, "gather": GATHER}


def make_batch(rank: int, case: str) -> TensorBatch:
    """Uneven, typed rows per sending rank; rank 1 sends nothing for the broadcast case."""
    if case == "broadcast" and rank == 1:
        return TensorBatch()
    num_groups = 3 if rank == 0 else 2
    group_size = 2
    rows = num_groups * group_size
    width = 3 + rank
    batch = TensorBatch({
        "group_ids": torch.arange(num_groups).repeat_interleave(group_size) + 100 * rank,
        "num_tokens": torch.arange(rows, dtype=torch.int64) * (rank + 1) + 1,
        "tokens": torch.arange(rows * width, dtype=torch.int32).reshape(rows, width) + 1000 * rank,
        "logp": torch.randn(rows, width, generator=torch.Generator().manual_seed(rank)).to(torch.bfloat16),
        "done": torch.arange(rows) % 2 == 0,
    }, {"sender": rank})
    batch.set_strings("text", [f"rank{rank}-row{i}-é✓" for i in range(rows)])
    return batch


class Probe(Executor):
    def __init__(self, ctx, out: Path):
        super().__init__(ctx)
        self.out = out

    def get_output(self, name):
        return make_batch(self.ctx.rank, name)

    def set_input(self, name, batch):
        header, data = batch.encode()
        (self.out / f"{name}_rank{self.ctx.rank}.header").write_bytes(bytes(header.tolist()))
        (self.out / f"{name}_rank{self.ctx.rank}.data").write_bytes(bytes(data.tolist()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--out", type=Path, required=True, help="where b's ranks dump what they received")
    out = parser.parse_args().out
    ctx = ExecutorContext.create([ExecutorSpec("a", 2), ExecutorSpec("b", 2)], timeout_s=60)
    probe = Probe(ctx, out)
    for case, kind in CASES.items():
        CommunicationChannel(case, "a", "b", kind).communicate(ctx, probe)
    ctx.destroy()


if __name__ == "__main__":
    main()
