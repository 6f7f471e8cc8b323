"""Several one-process colocated recipe runs in one Python process (the imports paid once).

usage: colocated_runs.py --plan RUNS.json

RUNS.json: a list of argument lists for ``recipes.arithmetic`` (each a whole run; ``STRAIGHT`` style
placeholders must already be resolved), or of ``{"args": [...], "env": {...}}`` (environment
variables set for that run alone, e.g. ``LLAMARL_FAULT``). Each run gets a world of its own: RANK 0 of WORLD_SIZE 1 on
a fresh ``MASTER_PORT``, made and destroyed by the run itself, as under ``torchrun
--nproc-per-node 1``. ``LLAMARL_TEST_SCORER`` swaps the scorer as in ``e2e_arithmetic.py``.
"""

import argparse
import json
import os
import socket

import tyro

from llamarl.rl.arithmetic_task import arithmetic_task
from llamarl.rl.standard_pipeline import run_rl
from recipes.arithmetic import ArithmeticConfig, main


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(args: list[str]) -> None:
    os.environ.update({"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1",
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())})
    config = tyro.cli(ArithmeticConfig, args=args)
    scorer = os.environ.get("LLAMARL_TEST_SCORER")
    if scorer is None:
        main(config)
        return
    run_rl(config, arithmetic_task(config, scorer=scorer), recipe="arithmetic")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--plan", required=True, help="RUNS.json: a JSON list of argument lists, one per run")
    with open(parser.parse_args().plan) as f:
        for arguments in json.load(f):
            if isinstance(arguments, dict):  # {"args": [...], "env": {...}}: this run's own environment
                saved = {k: os.environ.get(k) for k in arguments.get("env", {})}
                os.environ.update(arguments.get("env", {}))
                run(arguments["args"])
                for key, value in saved.items():
                    os.environ.pop(key, None) if value is None else os.environ.__setitem__(key, value)
            else:
                run(arguments)
