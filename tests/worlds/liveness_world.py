"""Two executors of one rank each, stepping forever without talking to each other; the controller's
heartbeat (liveness timeout = argv[2] seconds) is the only thing that can notice a stopped peer.

usage: liveness_world.py PID_DIR TIMEOUT_S — each rank writes ``PID_DIR/rank<r>.pid`` once stepping.
"""

import os
import sys
import time
from pathlib import Path

from llamarl.controller import ExecutorController, Upkeep
from llamarl.executor import Executor
from llamarl.world import ExecutorContext, ExecutorSpec


class Idle(Executor):
    def step(self) -> None:
        if self.current_step == 1:
            (Path(sys.argv[1]) / f"rank{self.ctx.rank}.pid").write_text(str(os.getpid()))
        time.sleep(0.1)


def main() -> None:
    ctx = ExecutorContext.create([ExecutorSpec("a", 1), ExecutorSpec("b", 1)], timeout_s=3600)
    ExecutorController(ctx, Idle(ctx), [], max_steps=3000, executor_order=["a", "b"],
                       upkeep=Upkeep(liveness_timeout_s=float(sys.argv[2]))).run()
    ctx.destroy()


if __name__ == "__main__":
    main()
