"""The arithmetic recipe under torchrun for tests; ``LLAMARL_TEST_SCORER`` swaps the scorer
(a ``module:function`` path, e.g. one a tiny random model can actually earn reward from).
``LLAMARL_TEST_ZERO_LR=1`` sets the learning rate to 0 after parsing (users cannot: the flag must be
> 0), which freezes the policy so that two schedules must produce exactly the same samples.
``LLAMARL_TEST_PID_DIR`` makes each rank write its pid to ``<dir>/rank<RANK>.pid``."""

import os
import sys

import tyro

from llamarl.rl.arithmetic_task import arithmetic_task
from llamarl.rl.standard_pipeline import run_rl
from recipes.arithmetic import ArithmeticConfig, main

if __name__ == "__main__":
    if os.environ.get("LLAMARL_TEST_PID_DIR"):  # so a test can SIGKILL a chosen rank
        with open(os.path.join(os.environ["LLAMARL_TEST_PID_DIR"], f"rank{os.environ['RANK']}.pid"), "w") as f:
            f.write(str(os.getpid()))
    config = tyro.cli(ArithmeticConfig)
    # One trainer thread unless the test asks (the recipe's 2 spin beside the other pytest worker and
    # the world's other ranks on a 2-core machine: several times the CPU for the same result).
    if not any(flag.startswith("--trainer.num-threads") for flag in sys.argv):
        config.trainer.num_threads = 1
    if os.environ.get("LLAMARL_TEST_ZERO_LR") == "1":
        config.trainer.lr = 0.0
    scorer = os.environ.get("LLAMARL_TEST_SCORER")
    if scorer is None:
        main(config)
    else:
        run_rl(config, arithmetic_task(config, scorer=scorer), recipe="arithmetic")
