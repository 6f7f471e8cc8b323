"""Outcome-reward advantages for grouped sampling, and KL-to-reference estimators.

* ``group_advantages`` -- critic-free advantages from G completions per prompt: GRPO
  (Shao et al., 2024, DeepSeekMath, arXiv:2402.03300), RLOO (Ahmadian et al., 2024,
  arXiv:2402.14740; Kool et al., 2019) and plain mean-baseline (Dr. GRPO, Liu et al., 2025,
  arXiv:2503.20783, drops the std division).
* ``kl_penalty`` -- per-token KL estimators k1/k2/k3 (Schulman, "Approximating KL
  Divergence", 2020) for an optional KL-to-reference reward penalty.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["ADVANTAGE_MODES", "KL_KINDS", "check_groups", "group_advantages", "kl_penalty"]

ADVANTAGE_MODES = ("grpo", "rloo", "mean")
KL_KINDS = ("k1", "k2", "k3")


def group_advantages(
    rewards: Tensor,
    group_size: int,
    mode: str = "grpo",
    *,
    eps: float = 1e-6,
) -> Tensor:
    """Per-sample advantages ``[N]`` from rewards ``[N]`` grouped by prompt.

    ``rewards`` is ordered so that each run of ``group_size`` consecutive rows shares a prompt.
    With ``mean_g`` / ``std_g`` the group mean / population std (``unbiased=False``, so a group of
    identical rewards gives exactly 0 in any dtype, and group_size 1 is allowed):

    * ``"grpo"``: ``(r - mean_g) / (std_g + eps)``                  (GRPO, arXiv:2402.03300;
      TRL divides by the unbiased std instead, a factor sqrt((G-1)/G) on every advantage, which
      gradient clipping and AdamW make immaterial: docs/benchmarks.md, "Side by side with TRL")
    * ``"rloo"``: ``r_i - mean_{j != i} r_j = G / (G - 1) * (r_i - mean_g)``
      (RLOO leave-one-out baseline, arXiv:2402.14740; needs ``group_size >= 2``)
    * ``"mean"``: ``r - mean_g``                                      (Dr. GRPO, arXiv:2503.20783)

    (``--algo.normalize-batch`` rescales these over the whole batch on every trainer rank:
    ``normalize_advantages`` in ``update.py``.) Returns a detached tensor in rewards' floating
    dtype (float32 for integer rewards). Raises ValueError for non-1-D rewards, ``group_size < 1``,
    N not divisible by ``group_size``, an unknown mode, or ``"rloo"`` with ``group_size < 2``.
    """
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be 1-D [N], got shape {tuple(rewards.shape)}")
    if group_size < 1:
        raise ValueError(f"group_size must be >= 1, got {group_size}")
    if rewards.numel() % group_size != 0:
        raise ValueError(f"number of rewards {rewards.numel()} is not divisible by group_size {group_size}")
    if mode not in ADVANTAGE_MODES:
        raise ValueError(f"unknown advantage mode {mode!r}; expected one of {ADVANTAGE_MODES}")
    if mode == "rloo" and group_size < 2:
        raise ValueError(f"rloo needs group_size >= 2, got {group_size}")

    r = rewards.detach()
    r = r.to(torch.promote_types(r.dtype, torch.float32) if r.is_floating_point() else torch.float32)
    groups = r.reshape(-1, group_size)
    mean = groups.mean(dim=1, keepdim=True)
    if mode == "grpo":
        adv = (groups - mean) / (groups.std(dim=1, unbiased=False, keepdim=True) + eps)
    elif mode == "rloo":
        # Leave-one-out mean of the others: (sum - r_i) / (G - 1); same as G/(G-1) * (r_i - mean).
        adv = groups - (groups.sum(dim=1, keepdim=True) - groups) / (group_size - 1)
    else:
        adv = groups - mean
    # A group whose rewards are all equal carries no signal: its advantages are exactly 0. The
    # arithmetic does not guarantee it (the fp32 mean of eight 0.9s is an ulp off 0.9, and GRPO
    # divides that ulp by std + eps into -0.056), so graded rewards would push tied groups.
    tied = (groups == groups[:, :1]).all(dim=1, keepdim=True)
    return torch.where(tied, torch.zeros_like(adv), adv).reshape(-1)


def check_groups(sorted_group_ids: Tensor, group_size: int, *, where: str) -> None:
    """Raise ValueError unless every group id in ``sorted_group_ids`` (ascending) has exactly
    ``group_size`` rows: ``group_advantages`` groups rows by position, so a batch with a partial or
    merged group would silently compare samples of different prompts."""
    if sorted_group_ids.numel() == 0:
        return
    ids, counts = torch.unique_consecutive(sorted_group_ids, return_counts=True)
    wrong = (counts != group_size).nonzero()
    if wrong.numel():
        i = int(wrong[0, 0])
        raise ValueError(f"{where}: group {int(ids[i])} has {int(counts[i])} rows, but the batch's group_size "
                         f"is {group_size} (a stage dropped or duplicated samples of a group; drop whole "
                         f"groups, or set metadata['group_size'])")


def kl_penalty(logp: Tensor, ref_logp: Tensor, mask: Tensor, *, kind: str = "k1") -> Tensor:
    """Per-token estimate ``[B, T]`` of KL(pi_theta || pi_ref) on tokens sampled from pi_theta.

    With ``log_r = ref_logp - logp`` (Schulman, "Approximating KL Divergence", 2020):

    * ``"k1"``: ``-log_r = logp - ref_logp``  (unbiased, can be negative per token)
    * ``"k2"``: ``0.5 * log_r ** 2``           (biased, low variance, >= 0)
    * ``"k3"``: ``exp(log_r) - 1 - log_r``     (unbiased, >= 0)

    Returns 0 where ``mask`` is 0; the log-ratio is zeroed there before any ``exp`` so padding
    cannot produce inf/NaN. Gradients flow through both inputs (detach as needed: a reward
    penalty wants ``.detach()``, a KL loss term wants the grad of ``logp``). Raises ValueError
    on shape mismatches or an unknown ``kind``.
    """
    if kind not in KL_KINDS:
        raise ValueError(f"unknown KL estimator {kind!r}; expected one of {KL_KINDS}")
    for name, x in {"ref_logp": ref_logp, "mask": mask}.items():
        if x.shape != logp.shape:
            raise ValueError(f"{name} must have the shape of logp {tuple(logp.shape)}, got {tuple(x.shape)}")
    mask = mask.to(torch.bool)
    log_r = torch.where(mask, ref_logp - logp, 0.0)
    if kind == "k1":
        kl = -log_r
    elif kind == "k2":
        kl = 0.5 * log_r.square()
    else:
        kl = log_r.exp() - 1.0 - log_r
    return torch.where(mask, kl, 0.0)
