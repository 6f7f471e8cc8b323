"""MATH (the LlamaRL paper's training set): competition problems, symbolic-equivalence ("sympy score") reward.

    torchrun --standalone --nproc-per-node 3 -m recipes.math default --data.path train.jsonl \\
        --data.test-path math500.jsonl
    torchrun --standalone --nproc-per-node 1 -m recipes.math qwen2.5-0.5b-1gpu     # one GPU, colocated
    torchrun --standalone --nproc-per-node 8 -m recipes.math qwen2.5-1.5b-8gpu     # one 8-GPU node, split

Same pipeline as ``recipes.gsm8k``; the reward is ``llamarl.rewards.math`` (the last ``\\boxed{}``,
"the answer is", or the last expression, checked for symbolic equivalence: math-verify where
installed, else the built-in LaTeX -> sympy rules, with a per-sample timeout). Data: JSONL with
``problem`` (or ``question``) and ``answer`` (MATH-500) or ``solution`` (Hendrycks MATH: the
answer is its last ``\\boxed{}``), or, with no path, the hub datasets ``--data.hub-train``
(default the 7,500 MATH training problems) and ``--data.hub-test`` (default MATH-500), which need
``pip install datasets`` and network.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import tyro

from llamarl.algorithms.config import AlgoConfig
from llamarl.data.hub import load_hub_problems
from llamarl.data.math import load_math_jsonl, row_to_problem
from llamarl.data.prompts import Problem, build_chat_prompt
from llamarl.executors.config import GeneratorConfig, RewardConfig, TrainerConfig
from llamarl.rewards.math import score  # noqa: F401  the scorer registered as "math": the task's
from llamarl.rl.dataset_recipes import (
    DatasetConfig,
    DatasetRecipeConfig,
    prepare_pass_k,
    qwen_1gpu,
    qwen_8gpu,
    run_pass_k,
    split_task,
)
from llamarl.rl.standard_pipeline import run_rl
from llamarl.run.config import RunConfig
from llamarl.runtime.errors import config_errors, parse_flags

# The Qwen2.5-Math / DeepSeek instruction; the scorer reads the last \boxed{} first.
MATH_INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."


@dataclass
class MathDataConfig(DatasetConfig):
    hub_train: str = "DigitalLearningGmbH/MATH-lighteval"
    """Hub dataset (``train`` split) used when ``--data.path`` is not given."""
    hub_test: str = "HuggingFaceH4/MATH-500"
    """Hub dataset (``test`` split) used when ``--data.test-path`` is not given."""

    def load_local(self, path: str) -> list[Problem]:
        return load_math_jsonl(path)

    def load_hub(self, split: str) -> list[Problem]:
        hub = self.hub_train if split == "train" else self.hub_test
        return load_hub_problems(hub, config=None, split=split,
                                 to_problem=lambda row: row_to_problem(row, where=f"{hub} {split}"))


@dataclass
class MathConfig(DatasetRecipeConfig):
    """RL on MATH (see the module docstring)."""

    data: MathDataConfig = field(default_factory=MathDataConfig)


def prompt_fn(tokenizer, question: str) -> list[int]:
    return build_chat_prompt(tokenizer, question, instruction_suffix=MATH_INSTRUCTION)


PRESETS: dict[str, tuple[str, MathConfig]] = {
    "default": ("Library defaults (SmolLM2-135M-Instruct, 3 ranks, async AIPO); pass --data.path / --data.test-path.",
                MathConfig(generator=GeneratorConfig(max_new_tokens=512, temperature=1.0),
                           run=RunConfig(num_eval_problems=100))),
    "qwen2.5-0.5b-1gpu": ("Qwen2.5-0.5B-Instruct on one GPU, colocated, vLLM, 1024 new tokens.",
                          qwen_1gpu(MathConfig, max_new_tokens=1024, lr=1e-6, max_steps=300, num_test_problems=500)),
    "qwen2.5-1.5b-8gpu": ("Qwen2.5-1.5B-Instruct, one 8-GPU node: 4 vLLM generators, 4 FSDP trainers (the reward on their ranks), AIPO.",
                          qwen_8gpu(MathConfig, samples_per_prompt=8, max_new_tokens=2048,
                                    reward=RewardConfig(num_workers=4, timeout_s=10.0),  # on each trainer rank
                                    trainer=TrainerConfig(full_lr=1e-6), algo=AlgoConfig(loss="aipo", rho=4.0),
                                    num_test_problems=500)),
}


def main(config: MathConfig) -> dict | None:
    """Load the data, run RL, then pass@k if asked; returns the summary on global rank 0."""
    task = split_task(config, train=config.data.load_split("train"), test=config.data.load_split("test"),
                      scorer="math", prompt_fn=prompt_fn)
    prepare_pass_k(config, config.eval, "math")
    summary = run_rl(config, task, recipe="math")
    return run_pass_k(config, config.eval, summary=summary, task=task)


if __name__ == "__main__":
    with config_errors():
        main(parse_flags(tyro.extras.overridable_config_cli, PRESETS))
