"""Arithmetic RL with a KL penalty to the initial policy, applied by a reference-policy executor.

    torchrun --standalone --nproc-per-node 4 -m recipes.ref_kl \
        [--ref.kl-coef 0.05 --ref.kl-estimator k1 --ref.num-ranks 1 --run.max-steps 40 ...]

A worked extension of the RL pipeline built from the library's public pieces only (``Stage``,
``ChannelSpec``, the stage builders of ``llamarl/rl/standard_pipeline.py``, ``shard_model``,
``sequence_logprobs`` and ``kl_penalty``); its executor and stage live in the library
(``llamarl/executors/reference.py``, ``llamarl/rl/reference_stage.py``) because ``recipes.task
--ref.kl-coef`` runs them too. Four executors, in rank order::

    generator --rollouts--> reward --scored--> ref --shaped--> trainer
        ^                                                         |
        +------------------------- weights -----------------------+

The reference executor (``RefPolicyExecutor``, ``--ref.num-ranks`` ranks, default 1) holds the
frozen initial policy, sharded with FSDP2 over its ranks and never updated (no optimizer, no
weight channel). For every scored sample it computes the reference log-probs of the completion
tokens and shapes the reward::

    reward_i <- reward_i - beta * sum_t kl_t          (t over the completion tokens of sample i)

with ``beta = --ref.kl-coef`` and ``kl_t`` the ``--ref.kl-estimator`` of KL(pi || pi_ref) on the
sampled token (``llamarl.algorithms.advantages.kl_penalty``): ``k1 = behav_logp - ref_logp``
(unbiased, can be negative), ``k2 = (ref - behav)^2 / 2`` or ``k3 = exp(ref - behav) - (ref - behav)
- 1`` (unbiased, >= 0). The behaviour log-probs the generator recorded stand in for the current
policy's (as verl's ``use_kl_in_reward`` uses the old log-probs): the KL is that of the policy that
*sampled* the tokens, which under the async schedule is a version or two behind the trainer. Both
sides use the generator's ``--generator.temperature``, so the KL is between the tempered
distributions the trainer's ratios also use, and is ~0 while the weights still equal the reference
(|kl_mean| ~1e-8 with ``--generator.dtype float32`` and ``--ref.param-dtype float32``: the
generator's KV-cached decoding and the reference's full forward round differently; in bf16 it is
bf16 noise).

Under LoRA (``--trainer.lora.rank``) there is no second model: the reference is the trainer's own
model with its adapters disabled (``llamarl.models.lora.adapters_disabled``), i.e. the frozen base
it started from, so the stage runs on the trainer's ranks (``colocate_with="trainer"``; its
``--ref.num-ranks`` and ``--ref.param-dtype`` then do not apply: it forwards in the trainer's
precision), reading the trainer's model when it steps, before the trainer in each tick.

Schedules: ``async`` (default) and ``sync`` deliver as ``standard_pipeline`` does, with the extra hop
``scored`` (reward -> ref) always same-tick, so the lag of every trained token is the standard
pipeline's (``--run.async-lag``) and ``--algo.stale-policy wait`` plans with the right one.
``colocated`` runs every stage, the reference included, on every rank (one process suffices).

With ``--algo.advantage grpo`` (the default) the group's std divides the shaped rewards: in a
group whose raw rewards tie, the advantage comes from the KL alone and is rescaled to unit size,
so ``--ref.kl-coef`` acts relative to the reward's spread; ``--algo.advantage mean`` keeps beta's
absolute scale.

Metrics (``metrics/ref.jsonl``): ``kl_mean`` (per completion token), ``kl_penalty_mean`` (beta
times the per-sample KL sum, per sample), ``reward_raw_mean`` / ``reward_shaped_mean`` (per
sample), ``ref_samples``, ``ref_tokens``, ``ref_seconds``. Each shaped batch also carries
``reward_raw`` and ``kl_sum`` [N] so that whatever comes after can audit the shaping.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import tyro

from llamarl.executors.reference import REF_METRICS, RefConfig, RefPolicyExecutor, shape_rewards
from llamarl.rl.arithmetic_task import ArithmeticConfig, arithmetic_task
from llamarl.rl.reference_stage import REF_HEADLINE, check_ref_kl, ref_kl_pipeline, ref_stage
from llamarl.rl.standard_pipeline import run_rl
from llamarl.runtime.errors import config_errors, parse_flags

__all__ = ["REF_HEADLINE", "REF_METRICS", "RefConfig", "RefKLConfig", "RefPolicyExecutor", "check_ref_kl", "main",
           "ref_kl_pipeline", "ref_stage", "shape_rewards"]


@dataclass
class RefKLConfig(ArithmeticConfig):
    """Arithmetic RL with a KL-to-reference reward penalty from a reference-policy executor."""

    ref: RefConfig = field(default_factory=RefConfig)


def main(config: RefKLConfig) -> dict | None:
    """The arithmetic task with the rule-based scorer and the KL penalty (``check_ref_kl`` first)."""
    return run_rl(config, arithmetic_task(config), recipe="ref_kl", stages=ref_kl_pipeline)


if __name__ == "__main__":
    with config_errors():
        main(parse_flags(tyro.cli, RefKLConfig))
