"""DAPO, GSPO (and GSPO-token), CISPO, the loss aggregations and the mismatch corrections against
their papers' formulas, written out here per token / per sample in fp64 with padding and empty rows;
gradients by finite differences (gradcheck). llamarl/algorithms/{clip_variants,aggregation,mismatch}.py."""

import math

import pytest
import torch

from llamarl.algorithms.aggregation import Aggregation, aggregate, token_weights
from llamarl.algorithms.clip_variants import cispo_loss, dapo_loss, gspo_loss
from llamarl.algorithms.config import AlgoConfig
from llamarl.algorithms.losses import decoupled_ppo_loss
from llamarl.algorithms.mismatch import mismatch_weights
from llamarl.algorithms.registered import get_advantage, get_policy_loss

torch.manual_seed(0)
B, T = 5, 7


def inputs(per_token_adv=False):
    g = torch.Generator().manual_seed(1)
    logp = (-torch.rand(B, T, generator=g, dtype=torch.float64) * 2).requires_grad_()
    prox = logp.detach() + 0.3 * torch.randn(B, T, generator=g, dtype=torch.float64)
    behav = prox + 0.4 * torch.randn(B, T, generator=g, dtype=torch.float64)
    mask = torch.ones(B, T, dtype=torch.bool)
    mask[1, 4:] = False  # padding
    mask[3] = False  # an empty row
    adv = torch.randn(B, T, generator=g, dtype=torch.float64) if per_token_adv else \
        torch.randn(B, generator=g, dtype=torch.float64)
    return logp, prox, behav, mask, adv


def full_adv(adv):
    return adv if adv.dim() == 2 else adv[:, None].expand(B, T)


def test_aggregations_match_their_formulas_and_any_micro_batch_split():
    x = torch.randn(B, T, dtype=torch.float64)
    _, _, _, mask, _ = inputs()
    lengths = mask.sum(1)
    n_tok, n_seq = float(mask.sum()), float((lengths > 0).sum())
    expect = {
        "token-mean": (x * mask).sum() / n_tok,
        "seq-mean-token-mean": sum((x[i] * mask[i]).sum() / lengths[i] for i in range(B) if lengths[i]) / n_seq,
        "seq-mean-token-sum-norm": (x * mask).sum() / (12 * n_seq),
    }
    for mode, value in expect.items():
        agg = Aggregation(mode, num_tokens=n_tok, num_seqs=n_seq, constant=12)
        assert torch.allclose(aggregate(x, mask, agg), value)
        parts = sum(aggregate(x[rows], mask[rows], agg) for rows in ([0, 2], [1, 3, 4]))
        assert torch.allclose(parts, value)  # micro-batches summed = the whole batch
        assert torch.allclose((token_weights(mask, agg, x.dtype) * x).sum(), value)
    # A plain count is today's formula, bit for bit.
    assert torch.equal(aggregate(x, mask, n_tok), torch.where(mask, x, 0.0).sum() / n_tok)


def test_dapo_is_clip_higher_with_dual_clip():
    logp, prox, behav, mask, adv = inputs()
    loss, metrics = dapo_loss(logp=logp, prox_logp=prox, behav_logp=behav, advantages=adv, mask=mask,
                              eps_low=0.2, eps_high=0.28, dual_clip=3.0)
    a = full_adv(adv)
    u = (logp.detach() - prox).exp()
    w = (prox - behav).exp()
    surr = torch.minimum(u * a, u.clamp(0.8, 1.28) * a)
    surr = torch.where(a < 0, torch.maximum(surr, 3.0 * a), surr)
    assert torch.allclose(loss, (-(w * surr) * mask).sum() / mask.sum())
    assert 0 <= metrics["clip_fraction"] <= 1
    torch.autograd.gradcheck(lambda lp: dapo_loss(logp=lp, prox_logp=prox, behav_logp=behav, advantages=adv,
                                                  mask=mask, dual_clip=3.0)[0], (logp,))


def test_gspo_uses_one_length_normalised_ratio_per_sample():
    logp, prox, behav, mask, adv = inputs()
    agg = Aggregation("seq-mean-token-mean", num_tokens=float(mask.sum()), num_seqs=4.0)
    loss, _ = gspo_loss(logp=logp, prox_logp=prox, behav_logp=behav, advantages=adv, mask=mask, num_loss_tokens=agg)
    total = 0.0
    for i in range(B):
        m = mask[i]
        if not m.any():
            continue
        s = ((logp.detach()[i] - prox[i])[m].mean()).exp()
        w = (prox[i] - behav[i]).exp()[m].mean()
        total += -w * torch.minimum(s * adv[i], s.clamp(1 - 3e-4, 1 + 4e-4) * adv[i])
    assert torch.allclose(loss, total / 4)
    torch.autograd.gradcheck(lambda lp: gspo_loss(logp=lp, prox_logp=prox, behav_logp=behav, advantages=adv,
                                                  mask=mask, eps_low=0.2, eps_high=0.2, num_loss_tokens=agg)[0],
                             (logp,))


def test_gspo_token_has_gspos_value_and_gradient_with_per_sample_advantages():
    logp, prox, behav, mask, adv = inputs()
    kwargs = {"prox_logp": prox, "behav_logp": behav, "advantages": adv, "mask": mask, "eps_low": 0.2, "eps_high": 0.2}
    seq, _ = gspo_loss(logp=logp, **kwargs)
    (g_seq,) = torch.autograd.grad(seq, logp)
    tok, _ = gspo_loss(logp=logp, token_level=True, **kwargs)
    (g_tok,) = torch.autograd.grad(tok, logp)
    assert torch.allclose(seq, tok) and torch.allclose(g_seq, g_tok)


def test_cispo_clips_the_weight_and_keeps_every_tokens_gradient():
    logp, prox, behav, mask, adv = inputs(per_token_adv=True)
    loss, _ = cispo_loss(logp=logp, prox_logp=prox, behav_logp=behav, advantages=adv, mask=mask,
                         eps_low=1.0, eps_high=0.28)
    u = (logp.detach() - prox).exp().clamp(0.0, 1.28)
    w = (prox - behav).exp()
    n = mask.sum()
    assert torch.allclose(loss, (-(w * u * adv * logp) * mask).sum() / n)
    (grad,) = torch.autograd.grad(loss, logp)
    assert torch.allclose(grad, -(w * u * adv) * mask / n)
    assert (grad[mask] != 0).all()  # no token clipped out of the gradient


@pytest.mark.parametrize("kind", ["none", "token-tis", "seq-tis", "token-mis", "seq-mis", "icepop"])
def test_mismatch_corrections_match_their_definitions(kind):
    _, prox, behav, mask, _ = inputs()
    cap = 1.5
    w, metrics = mismatch_weights(prox, behav, mask, kind=kind, cap=cap)
    r = (prox - behav).exp()
    seq = torch.where(mask, prox - behav, 0.0).sum(1, keepdim=True).exp().expand(B, T)
    inside = (r >= 1 / cap) & (r <= cap)
    seq_inside = (seq >= 1 / cap) & (seq <= cap)
    expect = {"none": r, "token-tis": r.clamp(max=cap), "seq-tis": seq.clamp(max=cap),
              "token-mis": torch.where(inside, r, 0.0), "seq-mis": torch.where(seq_inside, seq, 0.0),
              "icepop": inside.double()}[kind]
    assert torch.allclose(w, torch.where(mask, expect, 0.0))
    log_r = torch.where(mask, prox - behav, 0.0)
    assert torch.allclose(metrics["mismatch_k3"], ((log_r.exp() - 1 - log_r) * mask).sum() / mask.sum())
    assert math.isclose(float(metrics["mismatch_ratio_max"]), float(r[mask].max()))
    assert math.isclose(float(metrics["mismatch_inv_ratio_max"]), float((1 / r)[mask].max()))


def test_decoupled_ppo_with_token_tis_truncates_the_behaviour_weight():
    logp, prox, behav, mask, adv = inputs()
    loss, metrics = decoupled_ppo_loss(logp=logp, prox_logp=prox, behav_logp=behav, advantages=adv, mask=mask,
                                       mismatch="token-tis", mismatch_cap=1.2)
    a = full_adv(adv)
    u = (logp.detach() - prox).exp()
    w = (prox - behav).exp().clamp(max=1.2)
    expect = (-(w * torch.minimum(u * a, u.clamp(0.8, 1.2) * a)) * mask).sum() / mask.sum()
    assert torch.allclose(loss, expect) and "mismatch_k3" in metrics


def test_registered_losses_and_presets():
    logp, prox, behav, mask, adv = inputs()
    for preset, loss_name in (("dapo", "dapo"), ("gspo", "gspo"), ("cispo", "cispo"), ("dr-grpo", "decoupled_ppo")):
        algo = AlgoConfig(preset=preset)
        assert algo.loss == loss_name
        fn = get_policy_loss(algo.loss)
        loss, metrics = fn.fn(logp=logp, behav_logp=behav, prox_logp=prox, advantages=adv, mask=mask, algo=algo,
                              num_loss_tokens=float(mask.sum()))
        assert torch.isfinite(loss) and set(metrics) <= set(fn.metrics)
    assert AlgoConfig(preset="dr-grpo").advantage == "dr_grpo"
    assert AlgoConfig(preset="gspo", eps_high=1e-3).eps_high == 1e-3  # a flag given wins
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0])
    assert torch.allclose(get_advantage("dr_grpo")(rewards, 4), rewards - 0.25)
    with pytest.raises(ValueError, match="needs --algo.prox recompute"):
        AlgoConfig(loss="decoupled_ppo", mismatch="icepop", prox="loglinear")
