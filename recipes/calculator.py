"""Multiplication with a calculator tool: 3-digit x 2-digit products, which SmolLM2-135M cannot do
in its head, learned as a two-turn episode (llamarl/environments/calculator.py).

    torchrun --standalone --nproc-per-node 1 -m recipes.calculator --run.schedule colocated
    torchrun --standalone --nproc-per-node 3 -m recipes.calculator                   # async, 3 ranks
    torchrun ... -m recipes.calculator --env.name None                               # no tool (baseline)

The prompt is plain text with two worked examples (no chat template: measured with SmolLM2, the
same examples in the chat template gave 4/64 well-formed calls, as plain text 32/64):

    Q: What is 123 * 45?
    A: 123*45= 5535
    ...
    Q: What is 347 * 23?
    A:

The policy writes the expression and ``=``, the tool appends the value (an observation: never
trained), the policy ends the line; the reward is the arithmetic scorer on the transcript (the first
number after the last ``=``), so a well-formed call is rewarded and a wrong expression is not. The
run's greedy evaluations (before and after training) use the tool too; ``--env.name None`` measures
the model alone.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import tyro

from llamarl.data.arithmetic import ArithmeticTask
from llamarl.data.prompts import build_chat_prompt
from llamarl.environments.config import EnvConfig
from llamarl.executors.config import GeneratorConfig, TrainerConfig
from llamarl.rl.config import RLConfig
from llamarl.rl.standard_pipeline import run_rl
from llamarl.rl.task import Task
from llamarl.run.config import RunConfig
from llamarl.runtime.errors import config_errors, parse_flags

EXAMPLES = (("123", "45"), ("307", "62"))


@dataclass
class MultiplicationConfig:
    num_digits: int = 3
    """Digits of the first operand."""
    second_num_digits: int = 2
    """Digits of the second operand."""
    prompt: str = "plain"
    """``plain``: the worked examples as plain text; ``chat``: the same examples as the user turn of
    the model's chat template (SmolLM2 then calls the tool far less often: what RL has to learn)."""

    def __post_init__(self) -> None:
        if self.prompt not in ("plain", "chat"):
            raise ValueError(f"--task.prompt must be plain or chat, got {self.prompt!r}")


@dataclass
class CalculatorConfig(RLConfig):
    """RL of multiplication with a calculator tool (see the module docstring)."""

    task: MultiplicationConfig = field(default_factory=MultiplicationConfig)
    env: EnvConfig = field(default_factory=lambda: EnvConfig(name="calculator", max_turns=3))
    generator: GeneratorConfig = field(default_factory=lambda: GeneratorConfig(
        num_prompts_per_step=16, samples_per_prompt=4, max_new_tokens=24, temperature=0.8, dtype="bfloat16",
        num_threads=1))
    trainer: TrainerConfig = field(default_factory=lambda: TrainerConfig(full_lr=1.5e-5, param_dtype="bfloat16",
                                                                          num_threads=2))
    run: RunConfig = field(default_factory=lambda: RunConfig(max_steps=30, num_eval_problems=64))


def prompt_fn(tokenizer, question: str) -> list[int]:
    """Two worked examples, then the question, as plain text (see the module docstring)."""
    shots = "".join(f"Q: What is {a} * {b}?\nA: {a}*{b}= {int(a) * int(b)}\n" for a, b in EXAMPLES)
    return list(tokenizer(f"{shots}Q: {question}\nA:", add_special_tokens=False)["input_ids"])


def chat_prompt_fn(tokenizer, question: str) -> list[int]:
    """The same examples as the user turn of the chat template, the answer left to the assistant."""
    shots = "".join(f"Q: What is {a} * {b}?\nA: {a}*{b}= {int(a) * int(b)}\n" for a, b in EXAMPLES)
    return build_chat_prompt(tokenizer, f"Use the calculator: write the product and '='.\n{shots}Q: {question}")


def main(config: CalculatorConfig) -> dict | None:
    sampler = ArithmeticTask(num_digits=config.task.num_digits, second_num_digits=config.task.second_num_digits,
                             operation="*", seed=config.run.seed)
    task = Task(sampler, heldout=sampler.heldout, prompt_fn=prompt_fn if config.task.prompt == "plain" else chat_prompt_fn,
                scorer="arithmetic")
    return run_rl(config, task, recipe="calculator")


if __name__ == "__main__":
    with config_errors():
        main(parse_flags(tyro.cli, CalculatorConfig))
