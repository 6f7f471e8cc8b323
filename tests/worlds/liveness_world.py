"""Two executors of one rank each, stepping forever without talking to each other; the controller's
heartbeat (liveness timeout = ``--timeout-s`` seconds) is the only thing that can notice a stopped peer.

usage: liveness_world.py --pid-dir PID_DIR --timeout-s TIMEOUT_S — each rank writes ``PID_DIR/rank<r>.pid``
once stepping.
"""

import argparse
import os
import time
from pathlib import Path

from llamarl.controller import ExecutorController, Upkeep
from llamarl.executor import Executor
from llamarl.world import ExecutorContext, ExecutorSpec


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
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    ctx = ExecutorContext.create([ExecutorSpec("a", 1), ExecutorSpec("b", 1)], timeout_s=3600)
    ExecutorController(ctx, Idle(ctx, args.pid_dir), [], max_steps=3000, executor_order=["a", "b"],
                       upkeep=Upkeep(liveness_timeout_s=args.timeout_s)).run()
    ctx.destroy()


if __name__ == "__main__":
    main()
