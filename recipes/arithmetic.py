"""Default recipe: learn two-digit addition with SmolLM2-135M-Instruct (GRPO baseline, AIPO, async).

    torchrun --standalone --nproc-per-node 3 -m recipes.arithmetic [--run.max-steps 20 ...]

Ranks: generator 1, reward 1, trainer the rest. Prints the held-out greedy accuracy before and
after training and writes ``summary.json`` into the run directory. The task and its configuration
are the library's (``llamarl/rl/arithmetic_task.py``), shared with the recipes built on it
(``ref_kl``, ``llm_judge``, ``dapo_filter``).
"""

from __future__ import annotations

from dataclasses import dataclass

import tyro

from llamarl.data.prompts import arithmetic_prompt as prompt_fn
from llamarl.rl import arithmetic_task as library
from llamarl.rl.arithmetic_task import ArithmeticTaskConfig, arithmetic_task
from llamarl.rl.standard_pipeline import run_rl
from llamarl.runtime.errors import config_errors, parse_flags

__all__ = ["ArithmeticConfig", "ArithmeticTaskConfig", "main", "prompt_fn"]


@dataclass
class ArithmeticConfig(library.ArithmeticConfig):
    """RL on seeded integer-addition problems (generated on the fly, no download)."""


def main(config: ArithmeticConfig) -> dict | None:
    """The addition problems of ``--task.num-digits``, scored by the ``arithmetic`` scorer."""
    return run_rl(config, arithmetic_task(config), recipe="arithmetic")


if __name__ == "__main__":
    with config_errors():
        main(parse_flags(tyro.cli, ArithmeticConfig))
