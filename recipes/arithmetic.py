"""Default recipe: learn two-digit addition with SmolLM2-135M-Instruct (GRPO baseline, AIPO, async).

    torchrun --standalone --nproc-per-node 3 -m recipes.arithmetic [--run.max-steps 20 ...]

Ranks: generator 1, reward 1, trainer the rest. Prints the held-out greedy accuracy before and
after training and writes ``summary.json`` into the run directory.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import tyro

from llamarl.config import GeneratorConfig, RLConfig, RunConfig, TrainerConfig
from llamarl.config_checks import validate_config
from llamarl.data.arithmetic import ArithmeticTask
from llamarl.data.prompts import ARITHMETIC_INSTRUCTION, build_chat_prompt
from llamarl.errors import config_errors, parse_flags
from llamarl.pipeline import Pipeline
from llamarl.rewards.arithmetic import score
from llamarl.rl_pipeline import evaluation_score, run_rl
from llamarl.run_identity import dataset_fingerprint
from llamarl.runner import run_pipeline


@dataclass
class ArithmeticTaskConfig:
    num_digits: int = 2
    """Digits per operand of the addition problems."""


@dataclass
class ArithmeticConfig(RLConfig):
    """RL on seeded integer-addition problems (generated on the fly, no download)."""

    task: ArithmeticTaskConfig = field(default_factory=ArithmeticTaskConfig)
    # Defaults tuned for `make run` on 2 CPU cores (see docs/benchmarks.md): bf16 compute on both sides, the
    # trainer (the bottleneck) gets 2 threads, small frequent batches.
    generator: GeneratorConfig = field(default_factory=lambda: GeneratorConfig(
        num_prompts_per_step=16, samples_per_prompt=4, max_new_tokens=12, temperature=0.8, dtype="bfloat16",
        num_threads=1))
    trainer: TrainerConfig = field(default_factory=lambda: TrainerConfig(full_lr=1.5e-5, param_dtype="bfloat16",
                                                                          num_threads=2))
    run: RunConfig = field(default_factory=lambda: RunConfig(max_steps=40))


def prompt_fn(tokenizer, question: str) -> list[int]:
    return build_chat_prompt(tokenizer, question, instruction_suffix=ARITHMETIC_INSTRUCTION)


def run_variant(config: ArithmeticConfig, *, recipe: str, build_pipeline: Callable[..., Pipeline],
                checks: Callable[[ArithmeticConfig], None] | None = None, scorer: str = "arithmetic",
                score: Callable[[str, str], float] = score, edit: Callable[[Pipeline], None] | None = None) -> dict | None:
    """An arithmetic recipe with a pipeline of its own (``recipes/ref_kl.py``, ``llm_judge.py``,
    ``dapo_filter.py``): ``validate_config`` and the recipe's own ``checks(config)`` on every rank
    before any process group (the rank split, its stages included, is checked by the pipeline),
    ``build_pipeline(config, task=..., scorer=..., prompt_fn=...)``, ``edit(pipeline)`` if given (a
    test's taps), then ``run_pipeline``. Returns the summary on global rank 0, else None."""
    validate_config(config)
    if checks is not None:
        checks(config)
    task = ArithmeticTask(num_digits=config.task.num_digits, seed=config.run.seed)
    pipeline = build_pipeline(config, task=task, scorer=scorer, prompt_fn=prompt_fn)
    if edit is not None:
        edit(pipeline)
    return run_pipeline(pipeline, config, recipe=recipe, heldout=task.heldout(config.run.num_eval_problems),
                        score=evaluation_score(config, score), dataset=lambda: dataset_fingerprint(task))


def main(config: ArithmeticConfig) -> None:
    task = ArithmeticTask(num_digits=config.task.num_digits, seed=config.run.seed)
    run_rl(config, recipe="arithmetic", task=task, heldout=task.heldout(config.run.num_eval_problems),
           score=score, scorer="arithmetic", prompt_fn=prompt_fn)


if __name__ == "__main__":
    with config_errors():
        main(parse_flags(tyro.cli, ArithmeticConfig))
