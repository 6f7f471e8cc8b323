"""Toy gen -> rew -> train -> gen pipeline on 4 ranks (gen 1, rew 1, train 2) through the controller.

usage: controller_world.py OUT_DIR async|async1|sync MAX_STEPS [FAIL_RANK FAIL_STEP]
Each rank writes ``OUT_DIR/rank<r>.json`` with what its executor saw at every tick.
"""

import json
import sys
from pathlib import Path

import torch

from llamarl.batch import TensorBatch
from llamarl.channels.base import BROADCAST, SCATTER, CommunicationChannel
from llamarl.controller import ExecutorController
from llamarl.executor import Executor
from llamarl.world import ExecutorContext, ExecutorSpec

FAIL_RANK = int(sys.argv[4]) if len(sys.argv) > 4 else -1
FAIL_STEP = int(sys.argv[5]) if len(sys.argv) > 5 else -1


class Toy(Executor):
    def __init__(self, ctx):
        super().__init__(ctx)
        self.version = 0
        self.seen = []

    def step(self):
        if self.ctx.rank == FAIL_RANK and self.current_step == FAIL_STEP:
            raise RuntimeError("boom from a toy executor")
        self.work()


class Gen(Toy):
    def set_input(self, name, batch):
        if len(batch):
            self.version = batch.metadata["version"]

    def work(self):
        self.seen.append({"step": self.current_step, "version": self.version})
        rows = 4
        self.outputs["rollouts"] = TensorBatch({
            "gen_step": torch.full((rows,), self.current_step),
            "version": torch.full((rows,), self.version),
            "group_ids": torch.arange(rows) // 2 + 10 * self.current_step,
        })


class Rew(Toy):
    def work(self):
        batch = self.inputs.pop("rollouts", TensorBatch())
        self.seen.append({"step": self.current_step, "gen_steps": sorted(set(batch["gen_step"].tolist()))
                          if len(batch) else []})
        if len(batch):
            self.outputs["scored"] = batch


class Train(Toy):
    def work(self):
        batch = self.inputs.pop("scored", TensorBatch())
        self.seen.append({"step": self.current_step,
                          "gen_steps": sorted(set(batch["gen_step"].tolist())) if len(batch) else [],
                          "versions": sorted(set(batch["version"].tolist())) if len(batch) else [],
                          "rows": len(batch)})
        self.outputs["weights"] = TensorBatch({"step": torch.tensor([self.current_step])},
                                              {"version": self.current_step + 1})


def main() -> None:
    out, schedule, max_steps = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3])
    specs = [ExecutorSpec("gen", 1), ExecutorSpec("rew", 1), ExecutorSpec("train", 2)]
    # The three schedules differ only in which channels deliver within the tick.
    same_tick = {"async": (), "async1": ("rollouts",), "sync": ("rollouts", "scored")}[schedule]
    channels = [CommunicationChannel("rollouts", "gen", "rew", BROADCAST, same_tick="rollouts" in same_tick),
                CommunicationChannel("scored", "rew", "train", SCATTER, same_tick="scored" in same_tick),
                CommunicationChannel("weights", "train", "gen", BROADCAST)]
    ctx = ExecutorContext.create(specs, timeout_s=30, channel_endpoints=[(c.outbound, c.inbound) for c in channels])
    executor = {"gen": Gen, "rew": Rew, "train": Train}[ctx.executor](ctx)
    ExecutorController(ctx, executor, channels, max_steps=max_steps, executor_order=["gen", "rew", "train"]).run()
    (out / f"rank{ctx.rank}.json").write_text(json.dumps(executor.seen))
    ctx.destroy()


if __name__ == "__main__":
    main()
