"""A recipe with a stage of its own (``recipes/ref_kl.py``, ``llm_judge.py``, ``dapo_filter.py``)
under torchrun for tests, through ``run_rl`` with the recipe's own ``stages``: the arithmetic task with a
scorer a tiny random model earns reward from (``scorers_for_tests:first_char_even``).

    stage_recipe_world.py --recipe NAME [--tap STAGE ...] -- RECIPE FLAGS...

``--tap STAGE`` records every batch STAGE receives under ``$LLAMARL_TEST_TAPS`` (``taps.py``);
``LLAMARL_TEST_ZERO_LR=1`` freezes the policy after parsing (schedules must then sample alike)."""

import argparse
import os
import sys
from pathlib import Path

import tyro
from taps import tap_inputs

from llamarl.rl.arithmetic_task import arithmetic_task
from llamarl.rl.standard_pipeline import run_rl
from recipes.dapo_filter import DapoFilterConfig, dapo_filter_pipeline
from recipes.llm_judge import LLMJudgeConfig, llm_judge_pipeline
from recipes.ref_kl import RefKLConfig, ref_kl_pipeline

RECIPES = {"ref_kl": (RefKLConfig, ref_kl_pipeline),
           "llm_judge": (LLMJudgeConfig, llm_judge_pipeline),
           "dapo_filter": (DapoFilterConfig, dapo_filter_pipeline)}

if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--recipe", choices=sorted(RECIPES), required=True)
    parser.add_argument("--tap", action="append", default=[], help="a stage whose inputs are recorded")
    parser.add_argument("flags", nargs=argparse.REMAINDER)
    args = parser.parse_args()
    config_class, build_pipeline = RECIPES[args.recipe]
    config = tyro.cli(config_class, args=[f for f in args.flags if f != "--"])
    # One trainer thread unless the test asks (the recipe's 2 spin beside the other pytest worker and
    # the world's other ranks on a 2-core machine: several times the CPU for the same result).
    if not any(flag.startswith("--trainer.num-threads") for flag in sys.argv):
        config.trainer.num_threads = 1
    if os.environ.get("LLAMARL_TEST_ZERO_LR") == "1":
        config.trainer.lr = 0.0

    def tapped(config, task):
        pipeline = build_pipeline(config, task)
        for stage in args.tap:
            tap_inputs(pipeline, stage, Path(os.environ["LLAMARL_TEST_TAPS"]))
        return pipeline

    run_rl(config, arithmetic_task(config, scorer="scorers_for_tests:first_char_even"), recipe=args.recipe,
           stages=tapped)
