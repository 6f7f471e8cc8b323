"""Corrections for the mismatch between the generator's and the trainer's probabilities
(``--algo.mismatch``, with ``--algo.mismatch-cap`` C), and the mismatch's per-tick report.

The generator samples with its own numerics (vLLM's kernels, a bf16 KV cache, another attention),
so even at the same weights its log-probs ``log mu`` differ from the trainer's ``log pi_prox``
(the proximal policy, which ``--algo.prox recompute`` computes with the trainer's own forward).
Left alone, tokens the generator over-sampled are trained as if on-policy; verl #2996 / #6780 and
NeMo-RL #3743 trace training collapses to it. With ``r_t = pi_prox(y_t) / mu(y_t)`` and a sample's
``r_i = prod_t r_t`` (in log space), the behaviour weight ``w`` of the decoupled losses (AReaL's
``pi_prox / mu``; DAPO, GSPO, CISPO here too) becomes:

* ``none``: ``w_t = r_t`` (AReaL's decoupled PPO as published);
* ``token-tis``: ``w_t = min(r_t, C)``: truncated importance sampling per token (Yao et al., 2025,
  "Your efficient RL framework secretly brings you off-policy RL training"; verl's TIS);
* ``seq-tis``: ``w_t = min(r_i, C)`` for every token of sample i;
* ``token-mis``: ``w_t = r_t`` if ``1/C <= r_t <= C`` else 0: masked importance sampling, the
  outlier tokens dropped (their terms 0; they still count in the aggregation's denominators);
* ``seq-mis``: ``w_t = r_i`` if ``1/C <= r_i <= C`` else 0 for the whole sample;
* ``icepop``: ``w_t = 1`` if ``1/C <= r_t <= C`` else 0: IcePop (Ring-1T, arXiv:2510.18855)
  masks the mismatched tokens and does not reweight the rest.

All weights are constants of the objective (no gradient). AIPO is LlamaRL's loss with its own
one-sided truncation (``--algo.rho``) and takes no correction; the corrections need the proximal
log-probs the trainer recomputed (``--algo.prox recompute``: A-3PO's log-linear approximation
equals the behaviour policy at staleness 0, so it would measure no mismatch).

Metrics (per tick, over the loss tokens): ``mismatch_k3`` (k3 estimate of KL(mu || pi_prox)),
``mismatch_ratio_max`` and ``mismatch_inv_ratio_max`` (the largest ``r`` and ``1/r``: the ratio's
range), ``mismatch_corrected_fraction`` (tokens the correction truncated or masked).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

MISMATCH_KINDS = ("none", "token-tis", "seq-tis", "token-mis", "seq-mis", "icepop")


def mismatch_weights(prox_logp: Tensor, behav_logp: Tensor, mask: Tensor, *, kind: str,
                     cap: float) -> tuple[Tensor, dict[str, Tensor]]:
    """``(w, metrics)``: the corrected behaviour weights ``[B, T]`` (0 off ``mask``; detached) and
    the mismatch metrics (module docstring), from the proximal and behaviour log-probs ``[B, T]``.
    Raises ValueError for an unknown ``kind`` or ``cap <= 1``."""
    if kind not in MISMATCH_KINDS:
        raise ValueError(f"unknown mismatch correction {kind!r}; expected one of {MISMATCH_KINDS}")
    if not cap > 1.0:
        raise ValueError(f"the mismatch cap C must be > 1, got {cap}")
    mask = mask.to(torch.bool)
    dtype = torch.promote_types(prox_logp.dtype, torch.float32)
    log_r = torch.where(mask, prox_logp.detach().to(dtype) - behav_logp.detach().to(dtype), 0.0)
    r = log_r.exp()
    log_cap = math.log(cap)
    inside = (log_r >= -log_cap) & (log_r <= log_cap)
    if kind == "none":
        w = r
    elif kind == "token-tis":
        w = r.clamp(max=cap)
    elif kind == "token-mis":
        w = torch.where(inside, r, 0.0)
    elif kind == "icepop":
        w = inside.to(dtype)
    else:
        seq_log = log_r.sum(dim=1, keepdim=True)  # log prod_t r_t of each sample
        seq_r = seq_log.exp().expand_as(r)
        if kind == "seq-tis":
            w = seq_r.clamp(max=cap)
        else:
            w = torch.where((seq_log >= -log_cap) & (seq_log <= log_cap), seq_r, 0.0).expand_as(r)
    w = torch.where(mask, w, 0.0)
    with torch.no_grad():
        count = mask.sum().clamp_min(1)
        neg_log = torch.where(mask, -log_r, 0.0)
        metrics = {
            "mismatch_k3": torch.where(mask, r - 1.0 - log_r, 0.0).sum() / count,
            "mismatch_ratio_max": torch.where(mask, r, 0.0).max() if r.numel() else r.new_zeros(()),
            "mismatch_inv_ratio_max": torch.where(mask, neg_log.exp(), 0.0).max() if r.numel() else r.new_zeros(()),
            # Truncated (a TIS weight below its ratio) or masked (a weight of 0).
            "mismatch_corrected_fraction": (mask & ((w == 0) | (kind.endswith("tis") & (w < r)))).sum() / count,
        }
    return w, metrics
