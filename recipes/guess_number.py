"""Guess the number with "higher" / "lower" answers: an episode of several turns with feedback,
rewarded by the environment for solving in few guesses (llamarl/environments/guess.py).

    torchrun --standalone --nproc-per-node 1 -m recipes.guess_number --run.schedule colocated
    torchrun --standalone --nproc-per-node 3 -m recipes.guess_number                   # async, 3 ranks

The prompt is plain text with one worked game (a binary search), then a new game:

    I am thinking of a number between 1 and 16.
    Guess: 8
    Answer: lower
    Guess: 4
    Answer: higher
    Guess: 6
    ...
    I am thinking of a number between 1 and 16.
    Guess:

Each guess is a policy turn ending with a newline; the environment's answer and the next
``Guess:`` are observations (never trained). The reward is the environment's
(``--reward.trajectory-scorer env``): ``1 - (k - 1) / 8`` for finding the secret at guess ``k``,
0 when not found within ``--env.max-turns`` guesses. The greedy evaluations report the mean reward
(``accuracy`` in the summary is that mean: 1.0 means every game won at the first guess).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import tyro

from llamarl.environments.config import EnvConfig
from llamarl.environments.guess import GuessNumberTask
from llamarl.executors.config import GeneratorConfig, RewardConfig, TrainerConfig
from llamarl.rl.config import RLConfig
from llamarl.rl.standard_pipeline import run_rl
from llamarl.rl.task import Task
from llamarl.run.config import RunConfig
from llamarl.runtime.errors import config_errors, parse_flags

EXAMPLE = (11, [8, 12, 10, 11])
"""The worked game of the prompt: the secret and a binary search's guesses."""


@dataclass
class GuessTaskConfig:
    high: int = 16
    """Secrets are uniform in [1, high]."""

    def __post_init__(self) -> None:
        if self.high < 2:
            raise ValueError(f"--task.high must be >= 2, got {self.high}")


@dataclass
class GuessNumberConfig(RLConfig):
    """RL of a guessing game with feedback (see the module docstring)."""

    task: GuessTaskConfig = field(default_factory=GuessTaskConfig)
    env: EnvConfig = field(default_factory=lambda: EnvConfig(name="guess_number", max_turns=6))
    reward: RewardConfig = field(default_factory=lambda: RewardConfig(trajectory_scorer="env"))
    generator: GeneratorConfig = field(default_factory=lambda: GeneratorConfig(
        num_prompts_per_step=16, samples_per_prompt=4, max_new_tokens=48, temperature=1.0, dtype="bfloat16",
        num_threads=1))
    trainer: TrainerConfig = field(default_factory=lambda: TrainerConfig(full_lr=1.5e-5, param_dtype="bfloat16",
                                                                          num_threads=2))
    run: RunConfig = field(default_factory=lambda: RunConfig(max_steps=30, num_eval_problems=64))


def game_text(high: int, secret: int, guesses: list[int]) -> str:
    """A finished game as the prompt shows it."""
    lines = [f"I am thinking of a number between 1 and {high}."]
    for guess in guesses:
        lines.append(f"Guess: {guess}")
        lines.append("Answer: correct" if guess == secret else f"Answer: {'higher' if guess < secret else 'lower'}")
    return "\n".join(lines) + "\n\n"


def make_prompt_fn(high: int):
    """The worked game, then the question and ``Guess:`` (see the module docstring)."""
    secret, guesses = EXAMPLE
    shots = game_text(high, secret, guesses)

    def prompt_fn(tokenizer, question: str) -> list[int]:
        return list(tokenizer(f"{shots}{question}\nGuess:", add_special_tokens=False)["input_ids"])

    return prompt_fn


def main(config: GuessNumberConfig) -> dict | None:
    if config.env.name is None:
        raise ValueError("recipes.guess_number needs an environment (--env.name, default guess_number): "
                         "the game is its episodes")
    sampler = GuessNumberTask(high=config.task.high, seed=config.run.seed)
    # No text scorer of its own: the environment's reward (--reward.trajectory-scorer env, the default).
    task = Task(sampler, heldout=sampler.heldout, prompt_fn=make_prompt_fn(config.task.high))
    return run_rl(config, task, recipe="guess_number")


if __name__ == "__main__":
    with config_errors():
        main(parse_flags(tyro.cli, GuessNumberConfig))
