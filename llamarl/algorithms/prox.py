"""Approximate proximal log-probs for decoupled PPO without an extra forward pass.

A-3PO (Li, Wu & Shen, 2025, arXiv:2512.06547, eq. 3-4) replaces the proximal policy's forward
pass by a staleness-aware log-linear interpolation between the behaviour policy mu (which
generated the token) and the current policy pi_theta.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["loglinear_prox_logp"]

# Version stamped on prompt / padding tokens, which no policy generated.
PROMPT_VERSION = -1


def loglinear_prox_logp(
    behav_logp: Tensor,
    logp: Tensor,
    versions: Tensor,
    current_version: int | Tensor,
    *,
    mask: Tensor | None = None,
) -> Tensor:
    """Log-linear proximal log-probs, A-3PO eq. 3-4 (arXiv:2512.06547).

    Per token, with staleness ``d = current_version - versions``::

        alpha = 1 / d  if d >= 1  else 0          (d == 0: the token is on-policy)
        prox  = alpha * behav_logp + (1 - alpha) * sg[logp]

    so a one-step-stale token anchors at its behaviour policy and staler tokens are pulled
    progressively toward the current policy.

    ``versions`` is an integer ``[B, T]`` tensor: the policy version that generated each token,
    ``-1`` on prompt / padding tokens. Tokens with version ``-1`` or ``mask == 0`` are not
    interpolated: ``behav_logp`` is returned there (so the decoupled importance weight is exactly
    1 and nothing non-finite leaks out of padding). The result is detached, in the promoted
    dtype of ``behav_logp`` and ``logp``.

    Raises ValueError on shape mismatches, non-integer versions, a negative ``current_version``,
    or an included token whose version is < -1 or newer than ``current_version`` (d < 0).
    """
    shape = behav_logp.shape
    for name, x in {"logp": logp, "versions": versions, "mask": mask}.items():
        if x is not None and x.shape != shape:
            raise ValueError(f"{name} must have the shape of behav_logp {tuple(shape)}, got {tuple(x.shape)}")
    if versions.dtype.is_floating_point or versions.dtype == torch.bool:
        raise ValueError(f"versions must be an integer tensor, got {versions.dtype}")
    current = int(current_version)
    if current < 0:
        raise ValueError(f"current_version must be >= 0, got {current}")

    include = versions != PROMPT_VERSION
    if mask is not None:
        include = include & mask.to(torch.bool)
    if bool((include & (versions < 0)).any()):
        raise ValueError(f"versions must be >= 0 on loss tokens (or {PROMPT_VERSION} for prompt tokens)")
    staleness = current - versions
    if bool((include & (staleness < 0)).any()):
        newest = int(versions[include].max())
        raise ValueError(f"token version {newest} is newer than current_version {current}")

    dtype = torch.promote_types(behav_logp.dtype, logp.dtype)
    behav = behav_logp.detach().to(dtype)
    # clamp_min(1) only keeps the division finite; d == 0 is then zeroed by the where.
    alpha = torch.where(staleness >= 1, 1.0 / staleness.clamp_min(1).to(dtype), 0.0)
    prox = alpha * behav + (1.0 - alpha) * logp.detach().to(dtype)
    return torch.where(include, prox, behav)
