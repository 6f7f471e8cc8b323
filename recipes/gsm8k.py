"""GSM8K: grade-school math word problems, rule-based reward, greedy accuracy + pass@k on the test split.

    torchrun --standalone --nproc-per-node 3 -m recipes.gsm8k cpu-smoke           # this machine, minutes
    torchrun --standalone --nproc-per-node 1 -m recipes.gsm8k qwen2.5-0.5b-1gpu   # one GPU, colocated
    torchrun --standalone --nproc-per-node 8 -m recipes.gsm8k qwen2.5-1.5b-8gpu   # one 8-GPU node, split
    torchrun ... -m recipes.gsm8k <preset> --help                                 # every flag

Pipeline (``llamarl.rl.standard_pipeline.run_rl``): generator (native engine, or vLLM with ``--generator.engine
vllm``) -> ``rollouts`` SCATTER -> reward (``llamarl.rewards.gsm8k``: ``#### N`` / ``\\boxed{N}`` /
"the answer is N" / last number, compared exactly) -> ``scored`` SCATTER -> trainer (FSDP2; AIPO or
``--algo.loss decoupled_ppo``) -> ``weights`` (DDMA) -> generator. ``--run.schedule colocated`` runs
all three on every rank (one GPU). Data: ``--data.path`` (GSM8K JSONL: ``{"question", "answer"}``
a line, the answer ending in ``#### N``), else the hub dataset ``openai/gsm8k`` (needs ``datasets``
and network; a one-line error otherwise). The greedy accuracy before / after training uses the
first ``--run.num-eval-problems`` test problems; ``--eval.pass-k 1 4 8`` adds pass@k.

Presets, and the reference numbers to compare with:

- ``cpu-smoke``: SmolLM2-135M-Instruct, a handful of ticks on 3 CPU ranks; checks the pipeline,
  not the learning (a 135M model scores a few % on GSM8K).
- ``qwen2.5-0.5b-1gpu``: Qwen2.5-0.5B-Instruct, colocated on one GPU, vLLM, from verl's GSM8K
  quick-start (prompt 512 / response 256 tokens there; lr 1e-6; batch 256). verl reports
  36.4 -> 56.7 test accuracy with PPO (critic) after 15 epochs; here GRPO (no critic).
- ``qwen2.5-1.5b-8gpu``: Qwen2.5-1.5B-Instruct on one 8-GPU node, split: 4 vLLM generator
  replicas (TP 1), FSDP2 over 4 trainer ranks which also score (4 scoring processes each);
  decoupled PPO with staleness 2, from
  AReaL's ``gsm8k_grpo`` example (256 prompts x 4 samples, 1024 new tokens, lr 1.7e-5, weight
  decay 0.017, behaviour importance weight capped at 5, one minibatch), whose eval reward reaches
  ~0.78-0.80.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import tyro

from llamarl.algorithms.config import AlgoConfig
from llamarl.data.gsm8k import load_gsm8k_jsonl
from llamarl.data.hub import load_hub_problems
from llamarl.data.prompts import Problem, build_chat_prompt
from llamarl.executors.config import GeneratorConfig, RewardConfig, TrainerConfig
from llamarl.models.config import ModelConfig
from llamarl.rewards.gsm8k import score  # noqa: F401  the scorer registered as "gsm8k": the task's
from llamarl.rl.dataset_recipes import (
    DatasetConfig,
    DatasetRecipeConfig,
    EvalConfig,
    prepare_pass_k,
    qwen_1gpu,
    qwen_8gpu,
    run_pass_k,
    split_task,
)
from llamarl.rl.standard_pipeline import run_rl
from llamarl.run.config import RunConfig
from llamarl.runtime.errors import config_errors, parse_flags

# verl's GSM8K instruction; the scorer reads "#### N" first (then \boxed, "the answer is", last number).
GSM8K_INSTRUCTION = "Let's think step by step and output the final answer after \"####\"."
SHARED_GSM8K = "../shared/data/gsm8k/train.jsonl"


@dataclass
class GSM8KDataConfig(DatasetConfig):
    hub_dataset: str = "openai/gsm8k"
    """Hugging Face dataset used when no path is given (needs ``pip install datasets`` and network)."""
    hub_config: str = "main"
    """Subset of the hub dataset."""

    def load_local(self, path: str) -> list[Problem]:
        return load_gsm8k_jsonl(path)

    def load_hub(self, split: str) -> list[Problem]:
        return load_hub_problems(self.hub_dataset, config=self.hub_config, split=split,
                                 to_problem=lambda row: Problem(question=row["question"], answer=row["answer"]))

    def default_test_path(self) -> str | None:
        return str(Path(self.path).with_name("test.jsonl")) if self.path else None


@dataclass
class GSM8KConfig(DatasetRecipeConfig):
    """RL on GSM8K (see the module docstring for the pipeline and presets)."""

    data: GSM8KDataConfig = field(default_factory=GSM8KDataConfig)


def prompt_fn(tokenizer, question: str) -> list[int]:
    return build_chat_prompt(tokenizer, question, instruction_suffix=GSM8K_INSTRUCTION)


PRESETS: dict[str, tuple[str, GSM8KConfig]] = {
    "cpu-smoke": ("SmolLM2-135M-Instruct, 3 CPU ranks (async), a few minutes: checks the pipeline end to end.",
                  GSM8KConfig(
                      model=ModelConfig(name="smollm2-135m-instruct"),
                      generator=GeneratorConfig(num_prompts_per_step=4, samples_per_prompt=4, max_new_tokens=128,
                                                temperature=0.8, dtype="bfloat16", num_threads=1),
                      reward=RewardConfig(num_workers=1),
                      trainer=TrainerConfig(full_lr=1e-5, param_dtype="bfloat16", num_threads=1),
                      run=RunConfig(max_steps=4, num_eval_problems=24),
                      data=GSM8KDataConfig(path=SHARED_GSM8K),
                      eval=EvalConfig(pass_k=[1, 4], pass_k_problems=8, chunk=64))),
    "qwen2.5-0.5b-1gpu": ("Qwen2.5-0.5B-Instruct on one GPU, colocated, vLLM (from verl's GSM8K quick-start).",
                          qwen_1gpu(GSM8KConfig, max_new_tokens=512, lr=2e-6, max_steps=350, num_test_problems=1319)),
    "qwen2.5-1.5b-8gpu": ("Qwen2.5-1.5B-Instruct, one 8-GPU node: 4 vLLM generators, 4 FSDP trainers (the reward on their ranks).",
                          qwen_8gpu(GSM8KConfig, samples_per_prompt=4, max_new_tokens=1024,
                                    reward=RewardConfig(num_workers=4),  # on each trainer rank: 16 scorers
                                    trainer=TrainerConfig(full_lr=1.7e-5, weight_decay=0.017),
                                    # AReaL caps the behaviour importance weight at 5 (behav_imp_weight_cap: 5.0).
                                    algo=AlgoConfig(loss="decoupled_ppo", prox="recompute", max_staleness=2,
                                                    behav_weight_cap=5.0),
                                    num_test_problems=1319)),
}


def main(config: GSM8KConfig) -> dict | None:
    """Load the data, run RL, then pass@k if asked; returns the summary on global rank 0."""
    task = split_task(config, train=config.data.load_split("train"), test=config.data.load_split("test"),
                      scorer="gsm8k", prompt_fn=prompt_fn)
    prepare_pass_k(config, config.eval, "gsm8k")
    summary = run_rl(config, task, recipe="gsm8k")
    return run_pass_k(config, config.eval, summary=summary, task=task)


if __name__ == "__main__":
    with config_errors():
        main(parse_flags(tyro.extras.overridable_config_cli, PRESETS))
