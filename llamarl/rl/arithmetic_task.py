"""The arithmetic task as a library piece: the configuration and the ``Task`` that the arithmetic
recipes share (``recipes/arithmetic.py``, the default one, and the worked extensions built on it:
``recipes/ref_kl.py``, ``llm_judge.py``, ``dapo_filter.py``), so that no recipe imports another.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from llamarl.data.arithmetic import ArithmeticTask
from llamarl.data.prompts import arithmetic_prompt
from llamarl.executors.config import GeneratorConfig, TrainerConfig
from llamarl.rl.config import RLConfig
from llamarl.rl.task import Task
from llamarl.run.config import RunConfig


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


def arithmetic_task(config: ArithmeticConfig, *, scorer: str = "arithmetic") -> Task:
    """The addition problems of ``--task.num-digits`` (seeded by ``--run.seed``; the held-out ones
    made when asked), the arithmetic prompt (``arithmetic_prompt``), scored by ``scorer`` (the
    registered ``arithmetic`` scorer: the first number of the completion, compared exactly)."""
    sampler = ArithmeticTask(num_digits=config.task.num_digits, seed=config.run.seed)
    return Task(sampler, heldout=sampler.heldout, prompt_fn=arithmetic_prompt, scorer=scorer)
