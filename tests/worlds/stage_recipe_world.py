"""A recipe with a stage of its own (``recipes/ref_kl.py``, ``llm_judge.py``, ``dapo_filter.py``)
under torchrun for tests, through the recipe's own ``run_variant`` path: the arithmetic task with a
scorer a tiny random model earns reward from (``scorers_for_tests:first_char_even``).

    stage_recipe_world.py --recipe NAME [--tap STAGE ...] -- RECIPE FLAGS...

``--tap STAGE`` records every batch STAGE receives under ``$LLAMARL_TEST_TAPS`` (``taps.py``);
``LLAMARL_TEST_ZERO_LR=1`` freezes the policy after parsing (schedules must then sample alike)."""

import argparse
import os
import sys
from pathlib import Path

import tyro
from scorers_for_tests import first_char_even
from taps import tap_inputs

from recipes.arithmetic import run_variant
from recipes.dapo_filter import DapoFilterConfig, dapo_filter_pipeline
from recipes.llm_judge import LLMJudgeConfig, check_llm_judge, llm_judge_pipeline
from recipes.ref_kl import RefKLConfig, check_ref_kl, ref_kl_pipeline

RECIPES = {"ref_kl": (RefKLConfig, ref_kl_pipeline, check_ref_kl),
           "llm_judge": (LLMJudgeConfig, llm_judge_pipeline, check_llm_judge),
           "dapo_filter": (DapoFilterConfig, dapo_filter_pipeline, None)}

if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--recipe", choices=sorted(RECIPES), required=True)
    parser.add_argument("--tap", action="append", default=[], help="a stage whose inputs are recorded")
    parser.add_argument("flags", nargs=argparse.REMAINDER)
    args = parser.parse_args()
    config_class, build_pipeline, checks = RECIPES[args.recipe]
    config = tyro.cli(config_class, args=[f for f in args.flags if f != "--"])
    # One trainer thread unless the test asks (the recipe's 2 spin beside the other pytest worker and
    # the world's other ranks on a 2-core machine: several times the CPU for the same result).
    if not any(flag.startswith("--trainer.num-threads") for flag in sys.argv):
        config.trainer.num_threads = 1
    if os.environ.get("LLAMARL_TEST_ZERO_LR") == "1":
        config.trainer.lr = 0.0

    def taps(pipeline):
        for stage in args.tap:
            tap_inputs(pipeline, stage, Path(os.environ["LLAMARL_TEST_TAPS"]))

    run_variant(config, recipe=args.recipe, build_pipeline=build_pipeline, checks=checks,
                scorer="scorers_for_tests:first_char_even", score=first_char_even, edit=taps)
