"""Several ``recipes.arithmetic`` runs one after the other in ONE torchrun world (the process start
and the imports paid once), each run making and destroying its own process group.

usage: torchrun --nproc-per-node N schedule_runs.py --plan RUNS.json

RUNS.json: a list of argument lists (each a whole run on the N ranks: any schedule, a resume). Run i
gets a store of its own, hosted by rank 0 on ``MASTER_PORT + 1 + i`` (torchrun's agent store cannot
host a second default group). ``LLAMARL_TEST_SCORER`` swaps the scorer as in ``e2e_arithmetic.py``;
one trainer thread, as there.
"""

import argparse
import json
import os
from pathlib import Path

import tyro

from llamarl.rl.arithmetic_task import arithmetic_task
from llamarl.rl.standard_pipeline import run_rl
from recipes.arithmetic import ArithmeticConfig, main


def run(args: list[str]) -> None:
    config = tyro.cli(ArithmeticConfig, args=args)
    config.trainer.num_threads = 1
    scorer = os.environ.get("LLAMARL_TEST_SCORER")
    if scorer is None:
        main(config)
        return
    run_rl(config, arithmetic_task(config, scorer=scorer), recipe="arithmetic")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--plan", required=True, help="RUNS.json: a JSON list of argument lists, one per run")
    plan = json.loads(Path(parser.parse_args().plan).read_text())
    base = int(os.environ["MASTER_PORT"])
    os.environ.pop("TORCHELASTIC_USE_AGENT_STORE", None)
    for index, arguments in enumerate(plan):
        os.environ["MASTER_PORT"] = str(base + 1 + index)
        run(arguments)
