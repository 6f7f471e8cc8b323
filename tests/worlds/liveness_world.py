"""Two executors of one rank each, stepping forever without talking to each other; the controller's
heartbeat (liveness timeout = ``--timeout-s`` seconds) is the only thing that can notice a stopped peer.

usage: liveness_world.py --pid-dir PID_DIR --timeout-s TIMEOUT_S [--die-in-on-tick-at STEP] — each rank
writes ``PID_DIR/rank<r>.pid`` once stepping. With ``--die-in-on-tick-at``, every tick's ``on_tick``
all-reduces over WORLD (as the runner's metrics do) and rank 1 exits there at that step, so rank 0's
all-reduce fails with gloo's "Connection closed by peer" outside any channel or barrier.
"""

import argparse
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist

from llamarl.run.controller import ExecutorController, Hooks, Upkeep
from llamarl.runtime.executor import Executor
from llamarl.runtime.world import ExecutorContext, ExecutorSpec


class Idle(Executor):
    def __init__(self, ctx, pid_dir: Path) -> None:
        super().__init__(ctx)
        self.pid_dir = pid_dir

    def step(self) -> None:
        if self.current_step == 1:
            (self.pid_dir / f"rank{self.ctx.rank}.pid").write_text(str(os.getpid()))
        time.sleep(0.1)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--pid-dir", type=Path, required=True, help="where each rank writes rank<r>.pid")
    parser.add_argument("--timeout-s", type=float, required=True, help="the controller's liveness timeout")
    parser.add_argument("--die-in-on-tick-at", type=int, default=None,
                        help="rank 1 exits inside on_tick's WORLD all-reduce at this step")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    ctx = ExecutorContext.create([ExecutorSpec("a", 1), ExecutorSpec("b", 1)], timeout_s=3600)

    def on_tick(step, ticked) -> None:
        if step == args.die_in_on_tick_at and ctx.rank == 1:
            os._exit(3)
        dist.all_reduce(torch.ones(1, device=ctx.device))

    ExecutorController(ctx, Idle(ctx, args.pid_dir), [], max_steps=3000, executor_order=["a", "b"],
                       hooks=Hooks(upkeep=Upkeep(liveness_timeout_s=args.timeout_s),
                                   tick=on_tick if args.die_in_on_tick_at is not None else None)).run()
    ctx.destroy()


if __name__ == "__main__":
    main()
