"""Token-level policy-gradient losses for (asynchronous) RL on LLMs.

Three losses share one calling convention and one aggregation contract:

* ``aipo_loss``          -- LlamaRL §6, AIPO (Wu et al., 2025, arXiv:2505.24034).
* ``decoupled_ppo_loss`` -- AReaL eq. 3, decoupled PPO (Fu et al., 2025, arXiv:2505.24298).
* ``ppo_loss``           -- PPO clip (Schulman et al., 2017, arXiv:1707.06347), i.e. the
  decoupled loss with the proximal policy equal to the behaviour policy.

Notation, per token (all ``[B, T]`` unless stated):

* ``logp``        log pi_theta of the sampled token, from the trainer, carries grad.
* ``behav_logp``  log mu, the behaviour policy that generated the token (the generator).
* ``prox_logp``   log pi_prox, the proximal (trust-region anchor) policy.
* ``advantages``  ``[B, T]`` per token, or ``[B]`` per sample (broadcast over T).
* ``mask``        bool or 0/1 float; nonzero marks completion (loss) tokens.

Aggregation contract: every loss returns ``sum_{masked tokens} l_t / num_loss_tokens`` where
``num_loss_tokens`` is the GLOBAL number of loss tokens of the optimizer step (over all
micro-batches and data-parallel ranks), computed once by the caller. Summing the gradients of
all micro-batches and all-reducing them with SUM then gives exactly the global token mean. With
``num_loss_tokens=None`` the local ``mask.sum()`` is used (clamped to >= 1, so an all-zero mask
gives loss 0 with zero grad instead of NaN). ``num_loss_tokens`` may instead be an
``aggregation.Aggregation`` (``--algo.loss-agg``: the per-sample means of GRPO and Dr. GRPO), which
every loss here honours through ``aggregation.aggregate``.

Metrics are local (this call only) masked means/maxes, 0-d detached tensors, and are 0 when the
mask is empty. ``approx_kl`` is the k3 estimator of KL(mu || pi_theta) (Schulman, "Approximating
KL Divergence", 2020): with r = pi_theta / mu on tokens sampled from mu, ``k3 = (r - 1) - log r``,
which is unbiased and non-negative.

Padding positions never reach an ``exp``: log-ratios are zeroed there first, so garbage or -inf
log-probs on padding cannot produce inf/NaN in the loss or its gradient.
"""

from __future__ import annotations

import torch
from torch import Tensor

from llamarl.algorithms.aggregation import Aggregation, aggregate
from llamarl.algorithms.mismatch import mismatch_weights

__all__ = ["aipo_loss", "decoupled_ppo_loss", "ppo_loss"]

Metrics = dict[str, Tensor]


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    # exp/ratio arithmetic in bf16 is too coarse for clip decisions; compute in >= fp32.
    return torch.promote_types(dtype, torch.float32)


def _prepare(
    logp: Tensor, others: dict[str, Tensor], advantages: Tensor, mask: Tensor
) -> tuple[Tensor, dict[str, Tensor], Tensor, Tensor]:
    """Validate shapes; return (logp, detached others, [B, T] advantages, bool mask), upcast."""
    if logp.dim() != 2:
        raise ValueError(f"logp must be 2-D [B, T], got shape {tuple(logp.shape)}")
    shape = logp.shape
    for name, x in {**others, "mask": mask}.items():
        if x.shape != shape:
            raise ValueError(f"{name} must have the shape of logp {tuple(shape)}, got {tuple(x.shape)}")
    dtype = _compute_dtype(logp.dtype)
    if advantages.shape == shape:
        adv = advantages
    elif advantages.shape == shape[:1]:
        adv = advantages.unsqueeze(-1).expand(shape)
    else:
        raise ValueError(
            f"advantages must have shape [B, T]={tuple(shape)} or [B]={tuple(shape[:1])}, "
            f"got {tuple(advantages.shape)}"
        )
    mask = mask.to(torch.bool)
    # Advantages, behaviour and proximal log-probs are constants of the objective. Zeroing the
    # advantages off the mask keeps an inf/NaN there out of the backward pass (0 * inf = NaN).
    adv = torch.where(mask, adv.detach().to(dtype), 0.0)
    others = {k: v.detach().to(dtype) for k, v in others.items()}
    return logp.to(dtype), others, adv, mask


def _masked_mean(x: Tensor, mask: Tensor) -> Tensor:
    return torch.where(mask, x, 0.0).sum() / mask.sum().clamp_min(1)


def _masked_max(x: Tensor, mask: Tensor) -> Tensor:
    # Only used on non-negative quantities, so 0 is a neutral fill and the empty-mask value.
    if x.numel() == 0:
        return x.new_zeros(())
    return torch.where(mask, x, 0.0).max()


def _behaviour_metrics(log_ratio: Tensor, mask: Tensor) -> Metrics:
    """Importance-weight and k3 KL(mu || pi_theta) metrics; log_ratio = logp - behav_logp, detached."""
    ratio = log_ratio.exp()
    return {
        "importance_weight_mean": _masked_mean(ratio, mask),
        "importance_weight_max": _masked_max(ratio, mask),
        "approx_kl": _masked_mean(ratio - 1.0 - log_ratio, mask),
    }


def aipo_loss(
    *,
    logp: Tensor,
    behav_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    rho: float = 4.0,
    num_loss_tokens: float | Tensor | Aggregation | None = None,
) -> tuple[Tensor, Metrics]:
    """AIPO loss, LlamaRL §6 (Wu et al., 2025, arXiv:2505.24034).

    Per masked token ``l_t = -sg[min(pi_theta/mu, rho)] * A_t * log pi_theta``: a REINFORCE
    gradient with a one-sided, truncated importance weight (sg = stop-gradient). The weight is
    never clipped from below, so tokens the trainer now finds unlikely are down-weighted, and
    capped at ``rho`` so a stale generator cannot blow up the step.

    Returns ``(sum_t l_t / num_loss_tokens, metrics)``; see the module docstring for the
    aggregation contract. ``clip_fraction`` is the fraction of masked tokens with ratio > rho.
    Raises ValueError on shape mismatches or ``rho <= 0``.
    """
    if not rho > 0:
        raise ValueError(f"rho must be > 0, got {rho}")
    logp, others, adv, mask = _prepare(logp, {"behav_logp": behav_logp}, advantages, mask)
    log_ratio = torch.where(mask, logp.detach() - others["behav_logp"], 0.0)
    ratio = log_ratio.exp()
    weight = ratio.clamp(max=rho)
    per_token = -weight * adv * torch.where(mask, logp, 0.0)
    loss = aggregate(per_token, mask, num_loss_tokens)

    with torch.no_grad():
        metrics = _behaviour_metrics(log_ratio, mask)
        metrics["clip_fraction"] = _masked_mean((ratio > rho).to(logp.dtype), mask)
    return loss, metrics


def decoupled_ppo_loss(
    *,
    logp: Tensor,
    prox_logp: Tensor,
    behav_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    eps_clip: float = 0.2,
    behav_weight_cap: float | None = None,
    num_loss_tokens: float | Tensor | Aggregation | None = None,
    mismatch: str = "none",
    mismatch_cap: float = 2.0,
) -> tuple[Tensor, Metrics]:
    """Decoupled PPO loss, AReaL eq. 3 (Fu et al., 2025, arXiv:2505.24298).

    With ``w_t = sg[pi_prox / mu]`` (off-policy correction) and ``u_t = pi_theta / pi_prox``
    (trust-region ratio), per masked token::

        l_t = -w_t * min(u_t * A_t, clip(u_t, 1 - eps, 1 + eps) * A_t)

    ``behav_weight_cap``: as in AReaL, tokens whose ``w_t`` exceeds the cap are dropped from the
    numerator (their loss and gradient are 0) but stay in the denominator, i.e. they still count
    in ``num_loss_tokens``: the caller computes that count before any weight is known, and
    keeping it fixed keeps micro-batch gradients summable. ``prox_logp``/``behav_logp`` and the
    advantages are treated as constants.

    Returns ``(sum_t l_t / num_loss_tokens, metrics)``. ``clip_fraction`` is the fraction of
    masked tokens where the clipped term is strictly smaller than the unclipped one (so the token
    has zero gradient); ``behav_weight_mean``/``behav_capped_fraction`` describe ``w`` before
    capping. ``mismatch`` (``--algo.mismatch``, ``mismatch.py``): ``w_t`` replaced by its
    truncated / masked form (token or sequence TIS, MIS, IcePop) with ``mismatch_cap`` C, its
    metrics added. Raises ValueError on shape mismatches, ``eps_clip`` outside (0, 1) or a cap <= 0.
    """
    if not 0.0 < eps_clip < 1.0:
        raise ValueError(f"eps_clip must be in (0, 1), got {eps_clip}")
    if behav_weight_cap is not None and not behav_weight_cap > 0:
        raise ValueError(f"behav_weight_cap must be > 0 or None, got {behav_weight_cap}")
    logp, others, adv, mask = _prepare(
        logp, {"prox_logp": prox_logp, "behav_logp": behav_logp}, advantages, mask
    )
    prox, behav = others["prox_logp"], others["behav_logp"]

    behav_weight = torch.where(mask, prox - behav, 0.0).exp()
    keep = mask if behav_weight_cap is None else mask & (behav_weight <= behav_weight_cap)
    weight = torch.where(keep, behav_weight, 0.0)
    mismatch_metrics: Metrics = {}
    if mismatch != "none":  # the behaviour weight corrected for the generator / trainer mismatch
        weight, mismatch_metrics = mismatch_weights(prox, behav, keep, kind=mismatch, cap=mismatch_cap)
        keep = keep & (weight > 0)
    # Zero the log-ratio on dropped tokens *before* exp: a huge u there would otherwise make
    # 0 * inf = NaN in the backward pass.
    ratio = torch.where(keep, logp - prox, 0.0).exp()
    surr = ratio * adv
    surr_clipped = ratio.clamp(1.0 - eps_clip, 1.0 + eps_clip) * adv
    per_token = -weight * torch.minimum(surr, surr_clipped)
    loss = aggregate(torch.where(keep, per_token, 0.0), mask, num_loss_tokens)

    with torch.no_grad():
        # Recompute u on every masked token (incl. capped ones) for honest clip statistics.
        u = torch.where(mask, logp.detach() - prox, 0.0).exp()
        clipped = (u.clamp(1.0 - eps_clip, 1.0 + eps_clip) * adv) < (u * adv)
        metrics = _behaviour_metrics(torch.where(mask, logp.detach() - behav, 0.0), mask)
        metrics["clip_fraction"] = _masked_mean(clipped.to(logp.dtype), mask)
        metrics["behav_weight_mean"] = _masked_mean(behav_weight, mask)
        metrics["behav_capped_fraction"] = _masked_mean((mask & ~keep).to(logp.dtype), mask)
        metrics.update(mismatch_metrics)
    return loss, metrics


def ppo_loss(
    *,
    logp: Tensor,
    behav_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    eps_clip: float = 0.2,
    num_loss_tokens: float | Tensor | Aggregation | None = None,
) -> tuple[Tensor, Metrics]:
    """Coupled PPO clip loss (Schulman et al., 2017, arXiv:1707.06347).

    Per masked token ``l_t = -min(r_t * A_t, clip(r_t, 1 - eps, 1 + eps) * A_t)`` with
    ``r_t = pi_theta / mu``: exactly ``decoupled_ppo_loss`` with ``prox_logp = behav_logp``
    (so ``w_t = 1``). Same return value, aggregation and metrics (minus the behaviour-weight
    ones, which are trivially 1 / 0 here). Raises ValueError like ``decoupled_ppo_loss``.
    """
    loss, metrics = decoupled_ppo_loss(logp=logp, prox_logp=behav_logp, behav_logp=behav_logp, advantages=advantages,
                                       mask=mask, eps_clip=eps_clip, num_loss_tokens=num_loss_tokens)
    metrics.pop("behav_weight_mean")
    metrics.pop("behav_capped_fraction")
    return loss, metrics
