"""The clipped losses users reproduce: DAPO's clip-higher (with dual-clip), GSPO (sequence-level
ratio, and GSPO-token), CISPO (clipped importance weight, gradient through every token).

Each is written in the decoupled form of AReaL (arXiv:2505.24298) so that it composes with
asynchronous training: the trust region is around the proximal policy ``pi_prox`` (``u =
pi_theta / pi_prox``), and the off-policy gap between ``pi_prox`` and the behaviour policy ``mu``
that generated the tokens is a constant weight ``w = sg[pi_prox / mu]``, corrected by
``--algo.mismatch`` (``mismatch.py``: none, token / sequence TIS, MIS, IcePop). On-policy and
without mismatch, ``w = 1`` and each reduces to its paper's loss with ``pi_old = pi_prox``. The
aggregation is ``--algo.loss-agg`` (``aggregation.py``). Notation as in ``losses.py``; every
advantage is a constant; padding never reaches an ``exp``.

Metrics: ``losses._behaviour_metrics`` (importance weight vs the behaviour policy, k3), the
fraction clipped, and the mismatch metrics when a correction is on.
"""

from __future__ import annotations

import torch
from torch import Tensor

from llamarl.algorithms.aggregation import Aggregation, aggregate
from llamarl.algorithms.losses import Metrics, _behaviour_metrics, _masked_mean, _prepare
from llamarl.algorithms.mismatch import mismatch_weights

__all__ = ["cispo_loss", "dapo_loss", "gspo_loss"]


def _decoupled(logp: Tensor, prox_logp: Tensor, behav_logp: Tensor, advantages: Tensor, mask: Tensor, *,
               mismatch: str, mismatch_cap: float):
    """Shared set-up: upcast tensors, the behaviour weight ``w`` (0 where the correction masks) and
    its metrics, and the mask of tokens that keep a term."""
    logp, others, adv, mask = _prepare(logp, {"prox_logp": prox_logp, "behav_logp": behav_logp}, advantages, mask)
    prox, behav = others["prox_logp"], others["behav_logp"]
    weight, metrics = mismatch_weights(prox, behav, mask, kind=mismatch, cap=mismatch_cap)
    if mismatch == "none":
        metrics = {}
    keep = mask & (weight > 0)
    with torch.no_grad():
        metrics.update(_behaviour_metrics(torch.where(mask, logp.detach() - behav, 0.0), mask))
    return logp, prox, adv, mask, weight, keep, metrics


def dapo_loss(*, logp: Tensor, prox_logp: Tensor, behav_logp: Tensor, advantages: Tensor, mask: Tensor,
              eps_low: float = 0.2, eps_high: float = 0.28, dual_clip: float | None = None,
              num_loss_tokens: float | Tensor | Aggregation | None = None, mismatch: str = "none",
              mismatch_cap: float = 2.0) -> tuple[Tensor, Metrics]:
    """DAPO's clip-higher (Yu et al., 2025, arXiv:2503.14476, eq. 10), decoupled::

        l_t = -w_t * min(u_t A_t, clip(u_t, 1 - eps_low, 1 + eps_high) A_t)

    with the dual clip (Ye et al., 2020, arXiv:1912.09729) where ``dual_clip`` c is set: for
    ``A_t < 0``, ``l_t = -w_t * max(min(...), c A_t)`` (a hugely negative-advantage token cannot
    dominate the step). DAPO's published values: ``eps_low`` 0.2, ``eps_high`` 0.28; c, when used,
    3. ``clip_fraction``: tokens whose clipped term is strictly smaller than the unclipped one, or
    that the dual clip bounds."""
    if not (0 < eps_low < 1 and eps_high > 0):
        raise ValueError(f"dapo: eps_low must be in (0, 1) and eps_high > 0, got {eps_low}, {eps_high}")
    if dual_clip is not None and not dual_clip > 1:
        raise ValueError(f"dapo: the dual clip c must be > 1, got {dual_clip}")
    logp, prox, adv, mask, weight, keep, metrics = _decoupled(logp, prox_logp, behav_logp, advantages, mask,
                                                              mismatch=mismatch, mismatch_cap=mismatch_cap)
    u = torch.where(keep, logp - prox, 0.0).exp()
    surrogate = torch.minimum(u * adv, u.clamp(1.0 - eps_low, 1.0 + eps_high) * adv)
    if dual_clip is not None:
        surrogate = torch.where(adv < 0, torch.maximum(surrogate, dual_clip * adv), surrogate)
    loss = aggregate(torch.where(keep, -weight * surrogate, 0.0), mask, num_loss_tokens)
    with torch.no_grad():
        u0 = u.detach()
        clipped = u0.clamp(1.0 - eps_low, 1.0 + eps_high) * adv < u0 * adv
        if dual_clip is not None:
            clipped |= (adv < 0) & (torch.minimum(u0 * adv, u0.clamp(1.0 - eps_low, 1.0 + eps_high) * adv)
                                    < dual_clip * adv)
        metrics["clip_fraction"] = _masked_mean(clipped.to(logp.dtype), keep)
    return loss, metrics


def gspo_loss(*, logp: Tensor, prox_logp: Tensor, behav_logp: Tensor, advantages: Tensor, mask: Tensor,
              eps_low: float = 3e-4, eps_high: float = 4e-4, token_level: bool = False,
              num_loss_tokens: float | Tensor | Aggregation | None = None, mismatch: str = "none",
              mismatch_cap: float = 2.0) -> tuple[Tensor, Metrics]:
    """GSPO (Zheng et al., 2025, arXiv:2507.18071, eq. 5-7): one length-normalised ratio per sample,

        s_i = exp( (1 / |y_i|) sum_t log(pi_theta(y_t) / pi_prox(y_t)) ),
        l_i = -w_i * min(s_i A_i, clip(s_i, 1 - eps_low, 1 + eps_high) A_i),

    every token of sample i carrying ``l_i`` (so ``--algo.loss-agg seq-mean-token-mean``, the
    paper's, averages samples; ``token-mean`` weights them by length). ``A_i``: the sample's
    advantage (the mean of its tokens' if per-token). ``w_i``: the sample's mean behaviour weight
    (after the mismatch correction). The paper's clip range: 3e-4 / 4e-4.

    ``token_level`` (GSPO-token, eq. 13): ``s_{i,t} = sg[s_i] pi_theta(y_t) / sg[pi_theta(y_t)]``
    with per-token advantages: the same value as ``s_i``, a per-token gradient; with a per-sample
    advantage its gradient equals GSPO's. ``clip_fraction``: samples' tokens whose sample was
    clipped."""
    if not (0 < eps_low < 1 and eps_high > 0):
        raise ValueError(f"gspo: eps_low must be in (0, 1) and eps_high > 0, got {eps_low}, {eps_high}")
    logp, prox, adv, mask, weight, _keep, metrics = _decoupled(logp, prox_logp, behav_logp, advantages, mask,
                                                              mismatch=mismatch, mismatch_cap=mismatch_cap)
    lengths = mask.sum(dim=1, keepdim=True).clamp_min(1).to(logp.dtype)
    mean_log_ratio = torch.where(mask, logp - prox, 0.0).sum(dim=1, keepdim=True) / lengths
    seq_weight = torch.where(mask, weight, 0.0).sum(dim=1, keepdim=True) / lengths
    if token_level:
        s = (mean_log_ratio.detach() + logp - logp.detach()).exp()  # value s_i, gradient per token
        a = adv
    else:
        s = mean_log_ratio.exp().expand_as(logp)
        a = (torch.where(mask, adv, 0.0).sum(dim=1, keepdim=True) / lengths).expand_as(logp)
    surrogate = torch.minimum(s * a, s.clamp(1.0 - eps_low, 1.0 + eps_high) * a)
    loss = aggregate(torch.where(mask, -seq_weight * surrogate, 0.0), mask, num_loss_tokens)
    with torch.no_grad():
        s0 = s.detach()
        clipped = s0.clamp(1.0 - eps_low, 1.0 + eps_high) * a < s0 * a
        metrics["clip_fraction"] = _masked_mean(clipped.to(logp.dtype), mask)
    return loss, metrics


def cispo_loss(*, logp: Tensor, prox_logp: Tensor, behav_logp: Tensor, advantages: Tensor, mask: Tensor,
               eps_low: float = 1.0, eps_high: float = 0.28,
               num_loss_tokens: float | Tensor | Aggregation | None = None, mismatch: str = "none",
               mismatch_cap: float = 2.0) -> tuple[Tensor, Metrics]:
    """CISPO (MiniMax-M1, arXiv:2506.13585, eq. 4-5): the importance weight is clipped, not the
    update, so every token keeps a gradient::

        l_t = -w_t * sg[clip(u_t, 1 - eps_low, 1 + eps_high)] * A_t * log pi_theta(y_t)

    (``d l_t / d log pi_theta = -w_t clip(u_t) A_t``). The paper sets no lower bound (``eps_low``
    1: the weight's floor is 0) and tunes the upper one; 0.28 as verl / Trinity default.
    ``clip_fraction``: tokens whose weight was clipped."""
    if not (0 < eps_low <= 1 and eps_high > 0):
        raise ValueError(f"cispo: eps_low must be in (0, 1] and eps_high > 0, got {eps_low}, {eps_high}")
    logp, prox, adv, mask, weight, keep, metrics = _decoupled(logp, prox_logp, behav_logp, advantages, mask,
                                                              mismatch=mismatch, mismatch_cap=mismatch_cap)
    u = torch.where(keep, logp.detach() - prox, 0.0).exp()
    clipped_u = u.clamp(1.0 - eps_low, 1.0 + eps_high)
    per_token = -weight * clipped_u * adv * torch.where(keep, logp, 0.0)
    loss = aggregate(torch.where(keep, per_token, 0.0), mask, num_loss_tokens)
    with torch.no_grad():
        metrics["clip_fraction"] = _masked_mean((clipped_u != u).to(logp.dtype), keep)
    return loss, metrics
