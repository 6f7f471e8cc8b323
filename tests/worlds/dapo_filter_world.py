"""recipes/dapo_filter.py under torchrun for tests: the arithmetic task with a scorer a tiny random
model earns reward from (``scorers_for_tests:first_char_even``), so that some groups carry signal
and some do not. ``LLAMARL_TEST_TAPS=<dir>`` records what the filter and the trainer receive."""

import os
from pathlib import Path

import tyro
from scorers_for_tests import first_char_even
from taps import tap_inputs

from llamarl.data.arithmetic import ArithmeticTask
from llamarl.executors.validate import validate_config
from llamarl.runner import run_pipeline
from recipes.dapo_filter import DapoFilterConfig, dapo_filter_pipeline

SCORER = "scorers_for_tests:first_char_even"

if __name__ == "__main__":
    config = tyro.cli(DapoFilterConfig)
    if os.environ.get("LLAMARL_TEST_ZERO_LR") == "1":  # a frozen policy: schedules must sample alike
        config.trainer.lr = 0.0
    validate_config(config, world_size=int(os.environ["WORLD_SIZE"]),
                    extra_ranks={"--filter.num-ranks": config.filter.num_ranks})
    task = ArithmeticTask(num_digits=config.task.num_digits, seed=config.run.seed)
    pipeline = dapo_filter_pipeline(config, task=task, scorer=SCORER)
    if os.environ.get("LLAMARL_TEST_TAPS"):
        tap_inputs(pipeline, "filter", Path(os.environ["LLAMARL_TEST_TAPS"]))
        tap_inputs(pipeline, "trainer", Path(os.environ["LLAMARL_TEST_TAPS"]))
    run_pipeline(pipeline, config, recipe="dapo_filter", heldout=task.heldout(config.run.num_eval_problems),
                 score=first_char_even)
