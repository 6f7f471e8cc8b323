"""ColocatedExecutor: generator, scorer and trainer on the same ranks (the colocated schedule).

What a user with one GPU runs (TRL, DeepSpeed-Chat, verl's hybrid engine), and the on-policy
baseline every asynchronous speed-up is measured against. Every rank of the world is one
``colocated`` executor holding:

- a ``GeneratorExecutor`` (its own full generation model in ``--generator.dtype``, data-parallel
  replica ``ctx.dp_rank``: with N ranks each generates its own ``num_prompts_per_step`` prompts);
- a ``RewardPool`` scoring its own rollouts (worker processes, or inline with ``num_workers=0``);
- a ``TrainerExecutor`` (FSDP2 over all N ranks) training on this rank's scored rollouts, so the
  loss is the global token mean over every rank's samples;

and one tick is: generate (version t) -> score -> train (version t+1) -> write the trainer's
weights into the generation model in place (``copy_weights_in_place``: one parameter gathered at a
time, never a second full copy; a local copy on one rank). Generation at tick t therefore always
uses the weights after t updates: strictly on-policy, the same data flow as the ``sync`` schedule
of the split pipeline, which the tests check sample for sample at learning rate 0.

Threads: the phases never overlap, so each runs with every thread the rank was given: the larger of
``--generator.num-threads`` and ``--trainer.num-threads`` (a split pipeline's recipe typically gives
the trainer more; colocated, generation gets them too while the trainer is idle).

Metrics come in three sections (``metric_sections``: generator, reward, trainer) with the same
keys as the split pipeline's executors, so logs, ``summary.json`` and plots read the same. Reward
metrics are reduced over all ranks (the reward executor of the split pipeline sees every sample);
trainer metrics already are; generator metrics are this rank's, as in the split pipeline.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import torch

from llamarl.batch import TensorBatch
from llamarl.checkpoint import read_json, write_json
from llamarl.config import RewardConfig
from llamarl.data.prompts import Problem
from llamarl.executors.base import Executor
from llamarl.executors.generator import GeneratorExecutor
from llamarl.executors.reward import REWARD_METRICS, score_rollouts
from llamarl.executors.trainer import TrainerExecutor
from llamarl.models.weight_copy import copy_weights_in_place
from llamarl.rewards.pool import RewardPool


class ColocatedExecutor(Executor):
    """One rank's generator + scorer + trainer; see the module docstring for the tick."""

    name = "colocated"

    @property
    def metric_specs(self):
        """The declared metrics of the three roles (their keys are distinct)."""
        return {**getattr(self.generator, "metric_specs", {}), **REWARD_METRICS,
                **getattr(self.trainer, "metric_specs", {})}

    def __init__(self, ctx, *, generator: GeneratorExecutor, trainer: TrainerExecutor, reward: RewardConfig,
                 scorer: str) -> None:
        super().__init__(ctx)
        if generator.ctx is not ctx or trainer.ctx is not ctx:
            raise ValueError("the colocated generator and trainer must share the colocated executor's context")
        if generator.config.tp != 1:
            raise ValueError(f"--run.schedule colocated runs with --generator.tp 1, got {generator.config.tp}")
        self.generator, self.trainer = generator, trainer
        self.reward_config, self.scorer = reward, scorer
        self.pool: RewardPool | None = None
        self.metric_sections: dict[str, dict[str, float]] = {}
        self.weight_sync_seconds = 0.0

    def init(self) -> None:
        self.generator.init()
        self.trainer.init()
        self.pool = RewardPool(self.scorer, num_workers=self.reward_config.num_workers,
                               timeout_s=self.reward_config.timeout_s)
        # Both models were loaded from the same checkpoint, but the generator's may be in another
        # dtype: start from exactly the trainer's weights, cast, as the split pipeline does.
        self.sync_weights()

    @property
    def version(self) -> int:
        """The generation model's weight version (= the trainer's optimizer steps)."""
        return self.generator.version

    def get_model(self) -> torch.nn.Module:
        return self.trainer.get_model()

    def sync_weights(self) -> None:
        """Write the trainer's weights into the generation model in place; set its version."""
        start = time.perf_counter()
        copy_weights_in_place(self.trainer.get_model(), self.generator.get_model())
        self.generator.set_weights_version(self.trainer.version)
        self.weight_sync_seconds = time.perf_counter() - start

    @property
    def num_threads(self) -> int:
        return max(self.generator.config.num_threads, self.trainer.config.num_threads)

    def step(self) -> None:
        torch.set_num_threads(self.num_threads)
        self.generator.set_step(self.current_step)
        self.generator.step()
        rollouts = self.generator.outputs.pop(self.generator.output_name, TensorBatch())

        torch.set_num_threads(1)  # scoring runs in the pool's processes (or inline, pure Python)
        reward_metrics: dict[str, float] = {}
        if len(rollouts):  # reduced over the ranks by the runner, as REWARD_METRICS declares
            rollouts, reward_metrics = score_rollouts(self.pool, rollouts)

        torch.set_num_threads(self.num_threads)
        self.trainer.set_step(self.current_step)
        self.trainer.inputs[self.trainer.input_name] = rollouts
        version_before = self.trainer.version
        self.trainer.step()
        if self.trainer.version != version_before:  # no update, nothing to send
            self.sync_weights()
        self.metric_sections = {"generator": {**self.generator.metrics, "weight_sync_seconds": self.weight_sync_seconds},
                                "reward": reward_metrics, "trainer": self.trainer.metrics}
        self.metrics = {k: v for section in self.metric_sections.values() for k, v in section.items()}

    def evaluate(self, problems: list[Problem], score: Callable[[str, str], float], *,
                 samples_path: Path | None = None) -> float:
        """Greedy held-out accuracy of the current policy (the generation model holds it)."""
        torch.set_num_threads(self.num_threads)
        return self.generator.evaluate(problems, score, samples_path=samples_path)

    def save_checkpoint(self, directory: Path) -> None:
        """The generator's and the trainer's own checkpoints, side by side, and the reward counters."""
        for name, part in (("generator", self.generator), ("trainer", self.trainer)):
            (directory / name).mkdir(parents=True, exist_ok=True)
            part.save_checkpoint(directory / name)
        write_json(directory / f"reward_rank{self.ctx.local_rank}.json", {"counters": self.pool.stats()})

    def export(self, directory: Path) -> None:
        self.trainer.export(directory)

    def load_checkpoint(self, directory: Path) -> None:
        self.generator.load_checkpoint(directory / "generator")
        self.trainer.load_checkpoint(directory / "trainer")
        self.pool.restore_stats(read_json(directory / f"reward_rank{self.ctx.local_rank}.json")["counters"])
        self.sync_weights()  # the generation model is not saved: it is the trainer's, cast

    def close(self) -> None:
        self.generator.close()
        if self.pool is not None:
            self.pool.close()
