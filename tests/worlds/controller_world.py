"""Toy gen -> rew -> train -> gen pipeline on 4 ranks (gen 1, rew 1, train 2) through the controller.

usage: controller_world.py --out OUT_DIR --schedule async|async1|sync [...] --max-steps N
                          [--fail-rank R --fail-step S]
Each rank writes ``OUT_DIR/rank<r>.json`` with what its executor saw at every tick. With
``--fail-rank`` / ``--fail-step``, that rank's executor raises at that step. Several schedules run
one after the other in this one world, each with fresh executors and its own controller, and
write ``OUT_DIR/<schedule>/rank<r>.json``.
"""

import argparse
import json
from pathlib import Path

import torch

from llamarl.channels.base import BROADCAST, SCATTER, CommunicationChannel
from llamarl.run.controller import ExecutorController
from llamarl.runtime.batch import TensorBatch
from llamarl.runtime.executor import Executor
from llamarl.runtime.world import ExecutorContext, ExecutorSpec


class Toy(Executor):
    def __init__(self, ctx, *, fail_rank: int = -1, fail_step: int = -1):
        super().__init__(ctx)
        self.fail_rank, self.fail_step = fail_rank, fail_step
        self.version = 0
        self.seen = []

    def step(self):
        if self.ctx.rank == self.fail_rank and self.current_step == self.fail_step:
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


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--out", type=Path, required=True, help="directory for rank<r>.json")
    parser.add_argument("--schedule", choices=["async", "async1", "sync"], nargs="+", required=True)
    parser.add_argument("--max-steps", type=int, required=True)
    parser.add_argument("--fail-rank", type=int, default=-1, help="the rank whose executor raises (-1: none)")
    parser.add_argument("--fail-step", type=int, default=-1, help="the step at which it raises")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    ctx = ExecutorContext.create([ExecutorSpec("gen", 1), ExecutorSpec("rew", 1), ExecutorSpec("train", 2)],
                                 timeout_s=30)
    for schedule in args.schedule:
        out = args.out if len(args.schedule) == 1 else args.out / schedule
        out.mkdir(parents=True, exist_ok=True)
        run(ctx, args, schedule, out)
    ctx.destroy()


def run(ctx: ExecutorContext, args: argparse.Namespace, schedule: str, out: Path) -> None:
    """One schedule through a controller of its own; this rank's ``seen`` to ``out/rank<r>.json``."""
    # The three schedules differ only in which channels deliver within the tick.
    same_tick = {"async": (), "async1": ("rollouts",), "sync": ("rollouts", "scored")}[schedule]
    channels = [CommunicationChannel("rollouts", "gen", "rew", BROADCAST, same_tick="rollouts" in same_tick),
                CommunicationChannel("scored", "rew", "train", SCATTER, same_tick="scored" in same_tick),
                CommunicationChannel("weights", "train", "gen", BROADCAST)]
    executor = {"gen": Gen, "rew": Rew, "train": Train}[ctx.executor](ctx, fail_rank=args.fail_rank,
                                                                      fail_step=args.fail_step)
    ExecutorController(ctx, executor, channels, max_steps=args.max_steps,
                       executor_order=["gen", "rew", "train"]).run()
    (out / f"rank{ctx.rank}.json").write_text(json.dumps(executor.seen))


if __name__ == "__main__":
    main()
