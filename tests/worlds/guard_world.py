"""A one-rank world whose executor mixes a tensor made without a device with one on ``ctx.device``.

usage: guard_world.py --out OUT.json --guard on|off  — runs 2 ticks under the controller with the
device guard on or off; rank 0 writes the sums it computed. With the guard on, the first step must fail.
"""

import argparse
import json

import torch

from llamarl.run.controller import ExecutorController, Hooks, Upkeep
from llamarl.runtime.executor import Executor
from llamarl.runtime.world import ExecutorContext, ExecutorSpec


class Careless(Executor):
    """The bug the guard exists for: ``torch.ones(2)`` lands on the default device, not ctx.device."""

    def __init__(self, ctx) -> None:
        super().__init__(ctx)
        self.sums: list[float] = []

    def step(self) -> None:
        on_device = torch.arange(2, dtype=torch.float32, device=self.ctx.device)
        self.sums.append(float((on_device + torch.ones(2)).sum()))


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--out", required=True, help="rank 0's sums (JSON)")
    parser.add_argument("--guard", choices=["on", "off"], required=True, help="the controller's device guard")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    out, guard = args.out, args.guard == "on"
    ctx = ExecutorContext.create([ExecutorSpec("careless", 1)], timeout_s=60)
    executor = Careless(ctx)
    ExecutorController(ctx, executor, [], max_steps=2, executor_order=["careless"],
                       hooks=Hooks(upkeep=Upkeep(device_guard=guard))).run()
    with open(out, "w") as f:
        json.dump(executor.sums, f)
    ctx.destroy()


if __name__ == "__main__":
    main()
