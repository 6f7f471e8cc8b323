"""Registries of policy losses and advantage estimators (verl's ``register_policy_loss`` pattern).

A policy loss is registered under a name with the metrics it reports and how each is reduced over
micro-batches and ranks, and whether it needs the proximal policy; the trainer calls whatever
``--algo.loss`` names, with one keyword signature::

    @register_policy_loss("my_loss", metrics={"clip_fraction": "mean", "ratio_max": "max"})
    def my_loss(*, logp, behav_logp, prox_logp, advantages, mask, algo, num_loss_tokens):
        ...
        return loss, {"clip_fraction": ..., "ratio_max": ...}

``logp`` / ``behav_logp`` / ``prox_logp`` / ``mask`` are ``[B, T]`` (``prox_logp`` is None unless the
loss was registered with ``needs_prox=True``), ``advantages`` ``[B]``, ``algo`` the ``AlgoConfig``
(hyper-parameters), ``num_loss_tokens`` the global loss-token count of the optimizer step: the loss
must be ``sum over masked tokens / num_loss_tokens`` so micro-batch gradients add up to a global
token mean. With ``--algo.loss-agg`` other than ``token-mean``, ``num_loss_tokens`` is an
``aggregation.Aggregation`` instead: a loss written with ``aggregation.aggregate(per_token, mask,
num_loss_tokens)`` (as every built-in one is) supports every aggregation. Reductions: ``mean``
(token-weighted over every micro-batch and rank), ``max``, ``sum``.
Registering from recipe code (at import time, on every rank) is enough to use a new loss by name.

Advantage estimators: ``fn(rewards [N], group_size, *, eps) -> advantages [N]`` with rows grouped by
prompt in runs of ``group_size``, registered with ``register_advantage``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from torch import Tensor

from llamarl.algorithms.advantages import group_advantages
from llamarl.algorithms.clip_variants import cispo_loss, dapo_loss, gspo_loss
from llamarl.algorithms.losses import aipo_loss, decoupled_ppo_loss, ppo_loss
from llamarl.runtime.registry import Registry

Reduction = Literal["mean", "max", "sum"]
REDUCTIONS = ("mean", "max", "sum")


@dataclass(frozen=True)
class PolicyLoss:
    """A registered loss: the function, its declared metrics and whether it needs prox log-probs."""

    name: str
    fn: Callable[..., tuple[Tensor, dict[str, Tensor]]]
    metrics: dict[str, Reduction]
    needs_prox: bool = False


POLICY_LOSSES: Registry[PolicyLoss] = Registry("policy loss")
ADVANTAGES: Registry[Callable[..., Tensor]] = Registry("advantage estimator")


def register_policy_loss(name: str, *, metrics: dict[str, Reduction], needs_prox: bool = False):
    """Decorator: register ``fn`` as the policy loss ``name`` (see the module docstring)."""
    bad = {k: v for k, v in metrics.items() if v not in REDUCTIONS}
    if bad:
        raise ValueError(f"policy loss {name!r}: metric reductions must be one of {REDUCTIONS}, got {bad}")

    def decorate(fn):
        POLICY_LOSSES.add(name, PolicyLoss(name, fn, dict(metrics), needs_prox))
        return fn

    return decorate


def get_policy_loss(name: str) -> PolicyLoss:
    """The registered loss ``name``; ValueError listing the known ones otherwise."""
    return POLICY_LOSSES.get(name)


def register_advantage(name: str):
    """Decorator: register ``fn(rewards, group_size, *, eps)`` as the advantage estimator ``name``."""
    return ADVANTAGES.register(name)


def get_advantage(name: str) -> Callable[..., Tensor]:
    """The registered estimator ``name``; ValueError listing the known ones otherwise."""
    return ADVANTAGES.get(name)


# ----- built-ins -----
_BEHAVIOUR_METRICS: dict[str, Reduction] = {"importance_weight_mean": "mean", "importance_weight_max": "max",
                                            "approx_kl": "mean", "clip_fraction": "mean"}


@register_policy_loss("aipo", metrics=_BEHAVIOUR_METRICS)
def _aipo(*, logp, behav_logp, prox_logp, advantages, mask, algo, num_loss_tokens):
    return aipo_loss(logp=logp, behav_logp=behav_logp, advantages=advantages, mask=mask, rho=algo.rho,
                     num_loss_tokens=num_loss_tokens)


_MISMATCH_METRICS: dict[str, Reduction] = {"mismatch_k3": "mean", "mismatch_ratio_max": "max",
                                            "mismatch_inv_ratio_max": "max", "mismatch_corrected_fraction": "mean"}


def _bounds(algo, low: float, high: float) -> dict[str, float]:
    """``--algo.eps-low`` / ``--algo.eps-high``, or the loss's published values where unset."""
    return {"eps_low": low if algo.eps_low is None else algo.eps_low,
            "eps_high": high if algo.eps_high is None else algo.eps_high}


@register_policy_loss("decoupled_ppo", needs_prox=True, metrics={
    **_BEHAVIOUR_METRICS, **_MISMATCH_METRICS, "behav_weight_mean": "mean", "behav_capped_fraction": "mean"})
def _decoupled_ppo(*, logp, behav_logp, prox_logp, advantages, mask, algo, num_loss_tokens):
    return decoupled_ppo_loss(logp=logp, prox_logp=prox_logp, behav_logp=behav_logp, advantages=advantages, mask=mask,
                              eps_clip=algo.eps_clip, behav_weight_cap=algo.behav_weight_cap,
                              num_loss_tokens=num_loss_tokens, mismatch=algo.mismatch, mismatch_cap=algo.mismatch_cap)


@register_policy_loss("dapo", needs_prox=True, metrics={**_BEHAVIOUR_METRICS, **_MISMATCH_METRICS})
def _dapo(*, logp, behav_logp, prox_logp, advantages, mask, algo, num_loss_tokens):
    return dapo_loss(logp=logp, prox_logp=prox_logp, behav_logp=behav_logp, advantages=advantages, mask=mask,
                     **_bounds(algo, 0.2, 0.28), dual_clip=algo.dual_clip, num_loss_tokens=num_loss_tokens,
                     mismatch=algo.mismatch, mismatch_cap=algo.mismatch_cap)


for _name, _token in (("gspo", False), ("gspo_token", True)):
    register_policy_loss(_name, needs_prox=True, metrics={**_BEHAVIOUR_METRICS, **_MISMATCH_METRICS})(
        lambda *, logp, behav_logp, prox_logp, advantages, mask, algo, num_loss_tokens, _token=_token: gspo_loss(
            logp=logp, prox_logp=prox_logp, behav_logp=behav_logp, advantages=advantages, mask=mask,
            **_bounds(algo, 3e-4, 4e-4), token_level=_token, num_loss_tokens=num_loss_tokens,
            mismatch=algo.mismatch, mismatch_cap=algo.mismatch_cap))


@register_policy_loss("cispo", needs_prox=True, metrics={**_BEHAVIOUR_METRICS, **_MISMATCH_METRICS})
def _cispo(*, logp, behav_logp, prox_logp, advantages, mask, algo, num_loss_tokens):
    return cispo_loss(logp=logp, prox_logp=prox_logp, behav_logp=behav_logp, advantages=advantages, mask=mask,
                      **_bounds(algo, 1.0, 0.28), num_loss_tokens=num_loss_tokens, mismatch=algo.mismatch,
                      mismatch_cap=algo.mismatch_cap)


@register_policy_loss("ppo", metrics=_BEHAVIOUR_METRICS)
def _ppo(*, logp, behav_logp, prox_logp, advantages, mask, algo, num_loss_tokens):
    return ppo_loss(logp=logp, behav_logp=behav_logp, advantages=advantages, mask=mask, eps_clip=algo.eps_clip,
                    num_loss_tokens=num_loss_tokens)


for _mode in ("grpo", "rloo", "mean"):
    register_advantage(_mode)(lambda rewards, group_size, *, eps=1e-6, _mode=_mode:
                              group_advantages(rewards, group_size, _mode, eps=eps))
# Dr. GRPO's name for the plain group-mean baseline (no std division, arXiv:2503.20783).
register_advantage("dr_grpo")(lambda rewards, group_size, *, eps=1e-6:
                              group_advantages(rewards, group_size, "mean", eps=eps))
