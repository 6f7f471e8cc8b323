"""The reference-policy executor: the frozen initial policy, shaping each scored sample's reward by
its KL to it (``reward - beta * sum_t kl_t``). ``recipes/ref_kl.py`` describes it in full (the
estimators, the behaviour log-probs standing in for the policy's, LoRA's reference, the metrics);
``llamarl/rl/reference_stage.py`` puts it into a pipeline (``ref_kl_pipeline``), as ``recipes.ref_kl``
and ``recipes.task --ref.kl-coef`` run it."""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar, Literal

import torch

from llamarl.algorithms.advantages import KL_KINDS, kl_penalty
from llamarl.models.config import ModelConfig
from llamarl.models.loading import load_causal_lm
from llamarl.models.lora import adapters_disabled
from llamarl.models.microbatch import sequence_logprobs
from llamarl.models.sharding import shard_model
from llamarl.runtime.batch import TensorBatch, set_balance_tokens
from llamarl.runtime.executor import Executor
from llamarl.runtime.metrics import MetricSpec

logger = logging.getLogger("llamarl.ref_kl")


@dataclass
class RefConfig:
    """The reference-policy executor: its ranks, the KL estimator and its coefficient."""

    num_ranks: int = 1
    """Ranks given to the reference policy (after the reward's); its frozen copy of the initial
    policy is sharded with FSDP2 over them. 0: on the trainer's ranks, its frozen copy sharded over
    them beside the trainer's model (what ``recipes.task`` does)."""
    kl_coef: float = 0.05
    """beta: each sample's reward becomes ``reward - beta * sum over its completion tokens of kl_t``
    (0 reports the KL without shaping)."""
    kl_estimator: Literal["k1", "k2", "k3"] = "k1"
    """Per-token estimator of KL(pi || pi_ref) on the sampled token, with pi the behaviour policy:
    ``k1`` = log pi - log pi_ref (unbiased, can be negative), ``k2`` = (log ratio)^2 / 2,
    ``k3`` = exp(log pi_ref - log pi) - (log pi_ref - log pi) - 1 (unbiased, >= 0)."""
    param_dtype: Literal["float32", "bfloat16"] = "float32"
    """Compute dtype of the reference forward (FSDP2 MixedPrecisionPolicy); the frozen weights are
    kept in ``--model.dtype``. With float32 (and ``--generator.dtype float32``) the KL is ~0 (about
    1e-8 per token) while the policy still equals the reference."""
    max_tokens_per_microbatch: int | None = None
    """Token budget of one reference forward (first-fit decreasing packing); None: the trainer's
    ``--trainer.max-tokens-per-microbatch`` (the longest sample the generator admits)."""
    num_threads: int = 1
    """torch intra-op threads on each reference rank."""

    def __post_init__(self) -> None:
        if self.num_ranks < 0:
            raise ValueError(f"--ref.num-ranks must be >= 0 (0: on the trainer's ranks), got {self.num_ranks}")
        if not self.kl_coef >= 0:  # also refuses NaN
            raise ValueError(f"--ref.kl-coef must be >= 0, got {self.kl_coef}")
        if self.kl_estimator not in KL_KINDS:
            raise ValueError(f"--ref.kl-estimator must be one of {KL_KINDS}, got {self.kl_estimator!r}")
        if self.param_dtype not in ("float32", "bfloat16"):
            raise ValueError(f"--ref.param-dtype must be float32 or bfloat16, got {self.param_dtype!r}")
        if self.max_tokens_per_microbatch is not None and self.max_tokens_per_microbatch < 1:
            raise ValueError(f"--ref.max-tokens-per-microbatch must be >= 1, got {self.max_tokens_per_microbatch}")
        if self.num_threads < 1:
            raise ValueError(f"--ref.num-threads must be >= 1, got {self.num_threads}")



REF_METRICS = {
    "kl_mean": MetricSpec("kl", "mean", weight="ref_tokens"),
    "kl_penalty_mean": MetricSpec("kl", "mean", weight="ref_samples"),
    "reward_raw_mean": MetricSpec("reward", "mean", weight="ref_samples"),
    "reward_shaped_mean": MetricSpec("reward", "mean", weight="ref_samples"),
    "ref_samples": MetricSpec("data", "sum"),
    "ref_tokens": MetricSpec("data", "sum"),
    "ref_seconds": MetricSpec("time", "max"),
}
"""The reference executor's metrics and their reduction over its ranks (token- or sample-weighted)."""


def shape_rewards(batch: TensorBatch, ref_logp: torch.Tensor, *, kl_coef: float,
                  kl_estimator: str) -> tuple[TensorBatch, dict[str, float]]:
    """Apply the KL penalty to a non-empty scored batch; return it and its metrics.

    ``batch`` holds ``rewards`` [N], ``behav_logp`` / ``loss_mask`` [N, L] and ``group_ids`` [N];
    ``ref_logp`` [N, L] the reference log-probs at the same positions (any value off the loss
    mask). Sets ``rewards`` to ``reward_raw - kl_coef * kl_sum`` (float32; exactly ``reward_raw``
    when ``kl_coef`` is 0), adds ``reward_raw`` and ``kl_sum`` (the per-sample sum of the per-token
    estimates over the completion tokens) and recomputes ``balance_tokens`` (0 for the rows of a
    group whose shaped rewards all tie: the trainer forwards nothing for them, see
    llamarl/executors/reward.py). Raises RuntimeError on a non-finite KL (it would poison the
    rewards silently).
    """
    mask = batch["loss_mask"].bool()
    kl = kl_penalty(batch["behav_logp"].float(), ref_logp.float(), mask, kind=kl_estimator)
    kl_sum = kl.sum(dim=1)
    if not bool(torch.isfinite(kl_sum).all()):
        rows = (~torch.isfinite(kl_sum)).nonzero().squeeze(1).tolist()
        raise RuntimeError(f"non-finite KL to the reference policy in rows {rows} (group ids "
                           f"{batch['group_ids'][rows].tolist()})")
    raw = batch["rewards"].float()
    shaped = raw.clone() if kl_coef == 0 else raw - kl_coef * kl_sum
    batch.fields["reward_raw"] = raw
    batch.fields["kl_sum"] = kl_sum
    batch.fields["rewards"] = shaped
    set_balance_tokens(batch)
    tokens = float(mask.sum())
    samples = float(len(batch))
    metrics = {"kl_mean": float(kl.sum()) / max(tokens, 1.0),
               "kl_penalty_mean": float((kl_coef * kl_sum).sum()) / samples,
               "reward_raw_mean": float(raw.sum()) / samples, "reward_shaped_mean": float(shaped.sum()) / samples,
               "ref_samples": samples, "ref_tokens": tokens}
    return batch, metrics


class RefPolicyExecutor(Executor):
    """The frozen initial policy on its own ranks; shapes each scored sample's reward by its KL.

    Input ``input_name`` (SCATTERed, so prompt groups arrive whole; the shaping is per sample
    anyway): a scored rollout batch (``input_ids``, ``loss_mask``, ``behav_logp``, ``num_tokens``,
    ``rewards``, ``group_ids``, ...). Output ``output_name``: the same batch with ``rewards``
    shaped, plus ``reward_raw`` and ``kl_sum`` (``shape_rewards``). Every step is collective over
    the executor's ranks (FSDP2 forwards): each rank runs the same number of forwards, a rank with
    fewer or no rows running 2-token dummies (``llamarl.models.microbatch.sequence_logprobs``).
    The model is loaded from ``--model.name``, i.e. the weights the trainer starts from; it has no
    optimizer and no weight channel, and its state is the file itself (nothing to checkpoint
    beyond the pending outputs the base class saves).
    """

    metric_specs: ClassVar[dict] = REF_METRICS

    def __init__(self, ctx, *, model_config: ModelConfig, config: RefConfig, temperature: float,
                 max_tokens_per_microbatch: int, input_name: str = "scored", output_name: str = "shaped",
                 policy: Callable[[], torch.nn.Module] | None = None) -> None:
        """``policy``: under LoRA, returns the trainer's adapted model on this rank (the reference is
        it with the adapters disabled: module docstring); None: load the initial policy."""
        super().__init__(ctx)
        self.model_config, self.config, self.temperature = model_config, config, temperature
        self.max_tokens_per_microbatch = max_tokens_per_microbatch
        self.input_name, self.output_name = input_name, output_name
        self.model = None
        self.policy = policy

    def init(self) -> None:
        torch.set_num_threads(self.config.num_threads)
        if self.policy is not None:
            if self.ctx.local_rank == 0:
                logger.info("reference policy: the trainer's base (its LoRA adapters disabled); KL %s, beta %g",
                            self.config.kl_estimator, self.config.kl_coef)
            return
        # On the host, then fully_shard moves each rank's shards to the mesh's device (as the trainer).
        model, _ = load_causal_lm(self.model_config.name, dtype=getattr(torch, self.model_config.dtype), device="cpu")
        model.requires_grad_(False)
        self.model = shard_model(model, self.ctx.mesh, param_dtype=getattr(torch, self.config.param_dtype))
        self.model.eval()
        if self.ctx.local_rank == 0:
            logger.info("reference policy %s frozen on %d rank(s) (%s compute); KL %s, beta %g",
                        self.model_config.name, self.ctx.local_world_size, self.config.param_dtype,
                        self.config.kl_estimator, self.config.kl_coef)

    def step(self) -> None:
        batch = self.inputs.pop(self.input_name, TensorBatch())
        start = time.perf_counter()
        if len(batch):
            batch = batch.to(self.ctx.device)
        # Collective: every reference rank calls it, an empty one included (dummy forwards).
        model = self.model if self.policy is None else self.policy()
        with adapters_disabled(model) if self.policy is not None else contextlib.nullcontext():
            ref_logp = sequence_logprobs(model, batch, temperature=self.temperature,
                                         max_tokens_per_microbatch=self.max_tokens_per_microbatch,
                                         group=self.ctx.group, device=self.ctx.device)
        if not len(batch):
            self.metrics = {}
            return
        self.outputs[self.output_name], metrics = shape_rewards(batch, ref_logp, kl_coef=self.config.kl_coef,
                                                                kl_estimator=self.config.kl_estimator)
        self.metrics = {**metrics, "ref_seconds": time.perf_counter() - start}

