"""Arithmetic with a DAPO-style dynamic-sampling filter: a user's own stage between reward and trainer.

    torchrun --standalone --nproc-per-node 1 -m recipes.dapo_filter --run.schedule colocated   # one process
    torchrun --standalone --nproc-per-node 4 -m recipes.dapo_filter --run.schedule sync        # a rank each

generator -> reward ("scored") -> filter ("filtered") -> trainer, weights trainer -> generator.
The filter drops every prompt group whose samples all scored alike (DAPO's dynamic sampling, Yu et
al. 2025, §3.2: such a group has zero GRPO advantage and no gradient) and passes the rest on. It
is the third worked example of ``docs/write_your_own_executor.md``: ~40 lines of executor, one
``Stage``, and it runs in every schedule, on ranks of its own or, colocated, on every rank.

What dropping changes (decision, documented because it is easy to miss): the trainer's loss is the
global token mean over the completion tokens of the batch it receives. A group with zero advantage
adds no gradient but counts in that mean's denominator, so removing it scales the loss and the
gradient of the remaining tokens up by (all tokens) / (kept tokens), as DAPO intends (the kept
groups are what the step learns from); the logged ``loss`` on the same data changes by that
factor. The filter does not top the batch up with new prompts (DAPO oversamples until the batch is
full): ``filter_groups_kept`` reports how many groups each tick trains on. ``--algo.max-refill N``
does, in any recipe whose reward the generator can compute (llamarl/executors/dynamic_sampling.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import torch
import tyro

from llamarl.rl.arithmetic_task import ArithmeticConfig, arithmetic_task
from llamarl.rl.standard_pipeline import run_rl, stage_before_trainer
from llamarl.rl.task import Task
from llamarl.run.stages import Pipeline, Stage
from llamarl.runtime.batch import TensorBatch, set_balance_tokens
from llamarl.runtime.errors import config_errors, parse_flags
from llamarl.runtime.executor import Executor
from llamarl.runtime.metrics import MetricSpec


@dataclass
class FilterConfig:
    num_ranks: int = 1
    """Ranks of the filter stage (ignored under ``--run.schedule colocated``: every stage on every rank)."""

    def __post_init__(self) -> None:
        if self.num_ranks < 1:
            raise ValueError(f"--filter.num-ranks must be >= 1, got {self.num_ranks}")


@dataclass
class DapoFilterConfig(ArithmeticConfig):
    """Arithmetic RL with a stage that drops prompt groups whose samples all scored alike."""

    filter: FilterConfig = field(default_factory=FilterConfig)


def zero_signal_groups(batch: TensorBatch) -> set[int]:
    """The ``group_ids`` of the groups whose rows all have the same reward."""
    group_ids, rewards = batch["group_ids"], batch["rewards"]
    return {gid for gid in group_ids.unique().tolist() if bool((rewards[group_ids == gid] == rewards[group_ids == gid][0]).all())}


class FilterExecutor(Executor):
    """Reads ``input_name`` (scored rollouts: ``rewards``, ``group_ids``, ``group_size``), keeps
    the groups with a reward signal, sends them on ``output_name``."""

    metric_specs: ClassVar[dict] = {"filter_groups_kept": MetricSpec("filter", "sum"),
                                    "filter_groups_dropped": MetricSpec("filter", "sum")}
    num_threads = 1

    def __init__(self, ctx, *, input_name: str = "scored", output_name: str = "filtered") -> None:
        super().__init__(ctx)
        self.input_name, self.output_name = input_name, output_name

    def step(self) -> None:
        batch = self.inputs.pop(self.input_name, TensorBatch())
        self.metrics = {}
        if not len(batch):
            return
        dropped = zero_signal_groups(batch)
        keep = [row for row, gid in enumerate(batch["group_ids"].tolist()) if gid not in dropped]
        kept = batch.select(torch.tensor(keep, dtype=torch.long, device=batch.device))
        if len(kept):
            set_balance_tokens(kept)  # rows changed: what SCATTER balances on must follow them
        self.outputs[self.output_name] = kept
        num_groups = len(batch["group_ids"].unique())
        self.metrics = {"filter_groups_kept": float(num_groups - len(dropped)),
                        "filter_groups_dropped": float(len(dropped))}


def filter_stage(config: DapoFilterConfig) -> Stage:
    return Stage("filter", build=lambda ctx: FilterExecutor(ctx), num_ranks=config.filter.num_ranks,
                 ranks_flag="--filter.num-ranks",
                 headline=("filter_groups_kept",))


def dapo_filter_pipeline(config: DapoFilterConfig, task: Task) -> Pipeline:
    """The pipeline for ``--run.schedule`` (``filtered`` same-tick under sync and colocated, as
    ``scored`` in ``standard_pipeline``; ``scored`` always same-tick: the filter adds no lag): ``run_rl``'s
    ``stages``."""
    return stage_before_trainer(config, filter_stage(config), task=task, reward_output="scored", output="filtered",
                                title="DAPO filter", summary={})


def main(config: DapoFilterConfig) -> dict | None:
    """The arithmetic task with the rule-based scorer and the filter."""
    return run_rl(config, arithmetic_task(config), recipe="dapo_filter", stages=dapo_filter_pipeline)


if __name__ == "__main__":
    with config_errors():
        main(parse_flags(tyro.cli, DapoFilterConfig))
