"""recipes/llm_judge.py under torchrun for tests: the arithmetic task, audited by a scorer a tiny
random model earns reward from (``scorers_for_tests:first_char_even``, inline or in the pool as
the flags say). ``LLAMARL_TEST_TAPS=<dir>`` records every batch the trainer receives (``taps.py``)."""

import os
from pathlib import Path

import tyro
from scorers_for_tests import first_char_even
from taps import tap_inputs

from llamarl.data.arithmetic import ArithmeticTask
from llamarl.runner import run_pipeline
from recipes.arithmetic import prompt_fn
from recipes.llm_judge import LLMJudgeConfig, llm_judge_pipeline, validate_llm_judge

SCORER = "scorers_for_tests:first_char_even"

if __name__ == "__main__":
    config = tyro.cli(LLMJudgeConfig)
    validate_llm_judge(config, world_size=int(os.environ["WORLD_SIZE"]))
    task = ArithmeticTask(num_digits=config.task.num_digits, seed=config.run.seed)
    pipeline = llm_judge_pipeline(config, task=task, scorer=SCORER, prompt_fn=prompt_fn)
    if os.environ.get("LLAMARL_TEST_TAPS"):
        tap_inputs(pipeline, "trainer", Path(os.environ["LLAMARL_TEST_TAPS"]))
    run_pipeline(pipeline, config, recipe="llm_judge", heldout=task.heldout(config.run.num_eval_problems),
                 score=first_char_even)
