"""The reference-policy stage in a pipeline: ``ref_stage`` (``RefPolicyExecutor`` of
``llamarl/executors/reference.py`` on ``--ref.num-ranks`` ranks, or on the trainer's) and
``ref_kl_pipeline`` (generator -> reward -> ref -> trainer), the KL penalty to the initial policy
of ``recipes.ref_kl`` and of ``recipes.task --ref.kl-coef``. A config with a ``ref`` section
(``RefConfig``) runs it: ``run_rl(config, task, recipe=..., stages=ref_kl_pipeline)``."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import torch

from llamarl.executors.reference import RefPolicyExecutor
from llamarl.executors.trainer import TrainerExecutor
from llamarl.rl.config import RLConfig
from llamarl.rl.standard_pipeline import stage_before_trainer
from llamarl.rl.task import Task
from llamarl.run.stages import Pipeline, Stage

REF_HEADLINE = ("kl_mean", "reward_shaped_mean")


def ref_stage(config: RLConfig, *, name: str = "ref", input_name: str = "scored", output: str = "shaped",
              policy: Callable[[], torch.nn.Module] | None = None) -> Stage:
    """The reference policy on ``--ref.num-ranks`` ranks (``config.ref``: a ``RefConfig``): reads
    ``input_name``, sends ``output``.
    With ``policy`` (LoRA: the trainer's model on this rank), or ``--ref.num-ranks 0``, it runs on
    the trainer's ranks."""
    budget = config.ref.max_tokens_per_microbatch or config.trainer.max_tokens_per_microbatch

    def build(ctx) -> RefPolicyExecutor:
        return RefPolicyExecutor(ctx, model_config=config.model, config=config.ref,
                                 temperature=config.generator.temperature, max_tokens_per_microbatch=budget,
                                 input_name=input_name, output_name=output, policy=policy)
    on_trainer = policy is not None or config.ref.num_ranks == 0
    return Stage(name, build=build, num_ranks=None if on_trainer else config.ref.num_ranks, ranks_flag="--ref.num-ranks",
                 headline=REF_HEADLINE, colocate_with="trainer" if on_trainer else None)


def ref_kl_pipeline(config: RLConfig, task: Task) -> Pipeline:
    """generator -> reward ("scored") -> ref ("shaped") -> trainer, weights trainer -> generator, for
    a ``config`` with a ``ref`` section (``RefConfig``), after ``check_ref_kl``: ``run_rl``'s ``stages``.

    Delivery follows ``--run.schedule`` like ``standard_pipeline``: ``rollouts`` same-tick under sync or
    ``--run.async-lag 1``, ``shaped`` same-tick under sync, ``scored`` always same-tick (the
    reference adds no lag); colocated puts every stage, the reference included, on every rank.
    """
    check_ref_kl(config)
    trainers: dict[str, TrainerExecutor] = {}  # this rank's trainer, once built (LoRA's reference reads it)
    policy = (lambda: trainers["trainer"].model) if config.trainer.lora.enabled else None
    pipeline = stage_before_trainer(config, ref_stage(config, input_name="scored", output="shaped", policy=policy),
                                    task=task, reward_output="scored",
                                    output="shaped", title="KL to reference",
                                    summary={"kl_coef": config.ref.kl_coef, "kl_estimator": config.ref.kl_estimator})
    if policy is None:
        return pipeline

    def remembered(build):
        def build_trainer(ctx):
            trainers["trainer"] = build(ctx)
            return trainers["trainer"]
        return build_trainer
    pipeline.stages = [replace(s, build=remembered(s.build)) if s.name == "trainer" else s for s in pipeline.stages]
    return pipeline


def check_ref_kl(config: RLConfig) -> None:
    """The reference stage's check across sections: one line naming the flag."""
    budget = config.ref.max_tokens_per_microbatch
    if budget is not None and budget < config.trainer.max_tokens_per_microbatch:
        raise ValueError(f"--ref.max-tokens-per-microbatch {budget} is below --trainer.max-tokens-per-microbatch "
                         f"{config.trainer.max_tokens_per_microbatch}: a sample the trainer admits would not fit")

