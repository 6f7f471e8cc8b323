"""Losses and the log-linear proximal policy against plain-Python re-implementations of the papers."""

from __future__ import annotations

import math

import pytest
import torch

from llamarl.algorithms.losses import aipo_loss, decoupled_ppo_loss, ppo_loss

LOSS_FNS = {"aipo": aipo_loss, "decoupled_ppo": decoupled_ppo_loss, "ppo": ppo_loss}


def call(name, *, logp, prox, behav, adv, mask, **kwargs):
    """The loss ``name`` on these tensors (keyword-only, one order; prox only where it is used)."""
    extra = {"prox_logp": prox} if name == "decoupled_ppo" else {}
    return LOSS_FNS[name](logp=logp, **extra, behav_logp=behav, advantages=adv, mask=mask, **kwargs)
from llamarl.algorithms.prox import loglinear_prox_logp

F64 = torch.float64
EPS = 0.2
RHO = 4.0
# Ratios chosen to hit every branch: below 1-eps, inside the trust region, above 1+eps, above rho.
RATIOS = [0.3, 0.7, 0.9, 1.0, 1.1, 1.5, 3.0, 6.0, 10.0]


def make_batch(seed: int, B: int = 4, T: int = 9):
    g = torch.Generator().manual_seed(seed)
    behav = -0.1 - 3.0 * torch.rand(B, T, generator=g, dtype=F64)
    idx = torch.randint(len(RATIOS), (B, T), generator=g)
    logp = behav + torch.tensor(RATIOS, dtype=F64).log()[idx]
    # A third, independent ratio set for the proximal policy: prox sits between behav and logp-ish.
    prox_idx = torch.randint(len(RATIOS), (B, T), generator=g)
    prox = behav + 0.5 * torch.tensor(RATIOS, dtype=F64).log()[prox_idx]
    adv = torch.randn(B, T, generator=g, dtype=F64)
    mask = torch.rand(B, T, generator=g) < 0.75
    mask[1] = False  # a fully masked row
    return logp.requires_grad_(), behav, prox, adv, mask


# ----------------------------------------------------------------------------------------------
# Independent references: per-token Python-float loops of the paper formulas; gradients derived
# by hand (d loss / d logp), not by autograd.


def ref_aipo(logp, behav, adv, mask, rho, n):
    """LlamaRL §6: l = -min(pi/mu, rho) * A * log pi (weight is a constant)."""
    B, T = logp.shape
    loss, grad = 0.0, [[0.0] * T for _ in range(B)]
    clipped = count = 0
    for b in range(B):
        for t in range(T):
            if not mask[b][t]:
                continue
            lp, bl, a = float(logp[b, t]), float(behav[b, t]), float(adv[b, t])
            r = math.exp(lp - bl)
            c = min(r, rho)
            loss += -c * a * lp
            grad[b][t] = -c * a / n
            clipped += r > rho
            count += 1
    return loss / n, torch.tensor(grad, dtype=F64), clipped / max(count, 1)


def ref_decoupled(logp, prox, behav, adv, mask, eps, cap, n):
    """AReaL eq. 3: l = -w * min(u A, clip(u, 1-eps, 1+eps) A), w = pi_prox/mu, u = pi/pi_prox."""
    B, T = logp.shape
    loss, grad = 0.0, [[0.0] * T for _ in range(B)]
    clipped = count = capped = 0
    for b in range(B):
        for t in range(T):
            if not mask[b][t]:
                continue
            lp, px, bl, a = float(logp[b, t]), float(prox[b, t]), float(behav[b, t]), float(adv[b, t])
            count += 1
            u = math.exp(lp - px)
            s1, s2 = u * a, min(max(u, 1 - eps), 1 + eps) * a
            clipped += s2 < s1
            w = math.exp(px - bl)
            if cap is not None and w > cap:
                capped += 1
                continue
            if s1 <= s2:
                loss += -w * s1
                grad[b][t] = -w * a * u / n
            else:
                loss += -w * s2  # clipped branch is constant in logp
    return loss / n, torch.tensor(grad, dtype=F64), clipped / max(count, 1), capped / max(count, 1)


def ref_behaviour_metrics(logp, behav, mask):
    ws, kls = [], []
    for b in range(logp.shape[0]):
        for t in range(logp.shape[1]):
            if mask[b][t]:
                lr = float(logp[b, t]) - float(behav[b, t])
                ws.append(math.exp(lr))
                kls.append(math.exp(lr) - 1 - lr)  # k3 of KL(mu || pi)
    if not ws:
        return 0.0, 0.0, 0.0
    return sum(ws) / len(ws), max(ws), sum(kls) / len(kls)


def grad_of(loss, logp):
    (g,) = torch.autograd.grad(loss, logp)
    return g


def assert_close(x, y):
    torch.testing.assert_close(
        torch.as_tensor(x, dtype=F64), torch.as_tensor(y, dtype=F64), rtol=1e-9, atol=1e-12
    )


def test_batch_hits_every_branch():
    # Guard: the random batch must actually exercise the edge cases the other tests rely on.
    logp, behav, _, adv, mask = make_batch(0)
    r = (logp.detach() - behav).exp()[mask]
    a = adv[mask]
    assert (r > RHO).any()
    assert ((r > 1 + EPS) & (a > 0)).any() and ((r > 1 + EPS) & (a < 0)).any()
    assert ((r < 1 - EPS) & (a > 0)).any() and ((r < 1 - EPS) & (a < 0)).any()
    assert ((r > 1 - EPS) & (r < 1 + EPS)).any()
    assert not mask[1].any()


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_aipo_matches_reference(seed):
    logp, behav, _, adv, mask = make_batch(seed)
    n = int(mask.sum())
    loss, metrics = aipo_loss(logp=logp, behav_logp=behav, advantages=adv, mask=mask, rho=RHO)
    exp_loss, exp_grad, exp_clip = ref_aipo(logp.detach(), behav, adv, mask, RHO, n)
    assert_close(loss, exp_loss)
    assert_close(grad_of(loss, logp), exp_grad)
    assert_close(metrics["clip_fraction"], exp_clip)
    assert exp_clip > 0
    w_mean, w_max, kl = ref_behaviour_metrics(logp.detach(), behav, mask)
    assert_close(metrics["importance_weight_mean"], w_mean)
    assert_close(metrics["importance_weight_max"], w_max)
    assert_close(metrics["approx_kl"], kl)


@pytest.mark.parametrize("cap", [None, 1.5])
@pytest.mark.parametrize("seed", [0, 1])
def test_decoupled_ppo_matches_reference(seed, cap):
    logp, behav, prox, adv, mask = make_batch(seed)
    n = int(mask.sum())
    loss, metrics = decoupled_ppo_loss(logp=logp, prox_logp=prox, behav_logp=behav, advantages=adv, mask=mask,
                                       eps_clip=EPS, behav_weight_cap=cap)
    exp_loss, exp_grad, exp_clip, exp_capped = ref_decoupled(
        logp.detach(), prox, behav, adv, mask, EPS, cap, n
    )
    assert_close(loss, exp_loss)
    assert_close(grad_of(loss, logp), exp_grad)
    assert_close(metrics["clip_fraction"], exp_clip)
    assert_close(metrics["behav_capped_fraction"], exp_capped)
    assert 0 < exp_clip < 1
    if cap is not None:
        assert exp_capped > 0
    w_mean, w_max, kl = ref_behaviour_metrics(logp.detach(), behav, mask)
    assert_close(metrics["importance_weight_mean"], w_mean)
    assert_close(metrics["importance_weight_max"], w_max)
    assert_close(metrics["approx_kl"], kl)


@pytest.mark.parametrize("seed", [0, 3])
def test_ppo_matches_reference(seed):
    logp, behav, _, adv, mask = make_batch(seed)
    n = int(mask.sum())
    loss, metrics = ppo_loss(logp=logp, behav_logp=behav, advantages=adv, mask=mask, eps_clip=EPS)
    exp_loss, exp_grad, exp_clip, _ = ref_decoupled(logp.detach(), behav, behav, adv, mask, EPS, None, n)
    assert_close(loss, exp_loss)
    assert_close(grad_of(loss, logp), exp_grad)
    assert_close(metrics["clip_fraction"], exp_clip)


def test_ppo_clip_branches_by_hand():
    # One token per branch, A = +1 / -1, eps = 0.2, ratio r = exp(logp - behav), n = 4.
    behav = torch.zeros(1, 4, dtype=F64)
    r = torch.tensor([[1.5, 1.5, 0.5, 0.5]], dtype=F64)
    adv = torch.tensor([[1.0, -1.0, 1.0, -1.0]], dtype=F64)
    logp = r.log().requires_grad_()
    loss, metrics = ppo_loss(logp=logp, behav_logp=behav, advantages=adv, mask=torch.ones(1, 4, dtype=torch.bool))
    # Per-token -min(rA, clip(r)A): [-1.2 (clip), +1.5 (unclipped), -0.5 (unclipped), +0.8 (clip)].
    assert_close(loss, (-1.2 + 1.5 - 0.5 + 0.8) / 4)
    # d/dlogp of -rA = -rA where unclipped, 0 where clipped.
    assert_close(grad_of(loss, logp), torch.tensor([[0.0, 1.5 / 4, -0.5 / 4, 0.0]], dtype=F64))
    assert_close(metrics["clip_fraction"], 0.5)


def test_aipo_clip_by_hand():
    behav = torch.zeros(1, 3, dtype=F64)
    logp = torch.tensor([[math.log(8.0), math.log(0.5), -1.0]], dtype=F64, requires_grad=True)
    adv = torch.tensor([2.0], dtype=F64)  # [B] advantages broadcast over T
    loss, metrics = aipo_loss(logp=logp, behav_logp=behav, advantages=adv, mask=torch.ones(1, 3), rho=4.0)
    w = [4.0, 0.5, math.exp(-1.0)]  # 8 is clipped to rho = 4
    lp = [math.log(8.0), math.log(0.5), -1.0]
    assert_close(loss, sum(-wi * 2.0 * li for wi, li in zip(w, lp)) / 3)
    assert_close(grad_of(loss, logp), torch.tensor([[-wi * 2.0 / 3 for wi in w]], dtype=F64))
    assert_close(metrics["clip_fraction"], 1 / 3)
    assert_close(metrics["importance_weight_max"], 8.0)


@pytest.mark.parametrize("name", ["aipo", "decoupled_ppo", "ppo"])
def test_per_sample_advantages_broadcast(name):
    logp, behav, prox, _, mask = make_batch(4)
    adv_b = torch.randn(logp.shape[0], dtype=F64)
    loss_b, _ = call(name, logp=logp, prox=prox, behav=behav, adv=adv_b, mask=mask)
    loss_bt, _ = call(name, logp=logp, prox=prox, behav=behav, adv=adv_b[:, None].expand_as(logp), mask=mask)
    assert_close(loss_b, loss_bt)
    assert loss_b.abs() > 0


@pytest.mark.parametrize("name", ["aipo", "decoupled_ppo", "ppo"])
def test_all_masked_gives_zero_loss_zero_grad(name):
    logp, behav, prox, adv, _ = make_batch(5)
    mask = torch.zeros_like(adv, dtype=torch.bool)
    loss, metrics = call(name, logp=logp, prox=prox, behav=behav, adv=adv, mask=mask)
    assert loss.item() == 0.0
    assert torch.equal(grad_of(loss, logp), torch.zeros_like(adv))
    for key, value in metrics.items():
        assert value.dim() == 0 and not value.requires_grad, key
        assert value.item() == 0.0, key


@pytest.mark.parametrize("name", ["aipo", "decoupled_ppo", "ppo"])
def test_num_loss_tokens_sums_over_microbatches(name):
    logp, behav, prox, adv, mask = make_batch(6, B=6)
    n_global = int(mask.sum())

    def run(rows, n):
        lp = logp.detach()[rows].clone().requires_grad_()
        loss, _ = call(name, logp=lp, prox=prox[rows], behav=behav[rows], adv=adv[rows], mask=mask[rows],
                       num_loss_tokens=n)
        return loss, grad_of(loss, lp)

    full_loss, full_grad = run(slice(0, 6), None)
    l1, g1 = run(slice(0, 3), n_global)
    l2, g2 = run(slice(3, 6), torch.tensor(n_global))  # a tensor count behaves the same
    assert_close(l1 + l2, full_loss)
    assert_close(torch.cat([g1, g2]), full_grad)
    # With local counts the halves would be two means, not one: the contract matters.
    local = run(slice(0, 3), None)[0] + run(slice(3, 6), None)[0]
    assert not torch.allclose(local, full_loss)


@pytest.mark.parametrize("name", ["aipo", "decoupled_ppo", "ppo"])
def test_garbage_on_padding_does_not_leak(name):
    logp, behav, prox, adv, mask = make_batch(7)
    clean_loss, _ = call(name, logp=logp, prox=prox, behav=behav, adv=adv, mask=mask)
    clean_grad = grad_of(clean_loss, logp)
    # Extreme log-ratios (exp overflows) and inf advantages on non-loss tokens only.
    bad_logp = torch.where(mask, logp.detach(), 0.0).requires_grad_()
    bad_behav = torch.where(mask, behav, -1e4)
    bad_prox = torch.where(mask, prox, -5e3)
    bad_adv = torch.where(mask, adv, math.inf)
    loss, metrics = call(name, logp=bad_logp, prox=bad_prox, behav=bad_behav, adv=bad_adv, mask=mask)
    assert_close(loss, clean_loss)
    assert_close(grad_of(loss, bad_logp), clean_grad)
    assert all(torch.isfinite(v) for v in metrics.values())


def test_low_precision_logp_is_upcast():
    logp, behav, _, adv, mask = make_batch(8)
    lp16 = logp.detach().to(torch.bfloat16).requires_grad_()
    loss, _ = aipo_loss(logp=lp16, behav_logp=behav.to(torch.bfloat16), advantages=adv, mask=mask)
    assert loss.dtype == torch.float32
    assert grad_of(loss, lp16).dtype == torch.bfloat16


def test_user_errors():
    logp, behav, prox, adv, mask = make_batch(0)
    with pytest.raises(ValueError, match="rho"):
        aipo_loss(logp=logp, behav_logp=behav, advantages=adv, mask=mask, rho=0.0)
    with pytest.raises(ValueError, match="eps_clip"):
        ppo_loss(logp=logp, behav_logp=behav, advantages=adv, mask=mask, eps_clip=1.5)
    with pytest.raises(ValueError, match="behav_weight_cap"):
        decoupled_ppo_loss(logp=logp, prox_logp=prox, behav_logp=behav, advantages=adv, mask=mask,
                           behav_weight_cap=-1.0)
    with pytest.raises(ValueError, match="advantages"):
        ppo_loss(logp=logp, behav_logp=behav, advantages=adv[:, :3], mask=mask)
    with pytest.raises(ValueError, match="mask"):
        ppo_loss(logp=logp, behav_logp=behav, advantages=adv, mask=mask[:, :3])
    with pytest.raises(ValueError, match="prox_logp"):
        decoupled_ppo_loss(logp=logp, prox_logp=prox[:2], behav_logp=behav, advantages=adv, mask=mask)
    with pytest.raises(ValueError, match="num_loss_tokens"):
        aipo_loss(logp=logp, behav_logp=behav, advantages=adv, mask=mask, num_loss_tokens=-3)
    with pytest.raises(TypeError):  # keyword-only: tensors cannot be passed in the wrong order
        aipo_loss(logp, behav, adv, mask)


# ----------------------------------------------------------------------------------------------
# The proximal policy (AReaL's definition) and its A-3PO log-linear approximation.


def test_loglinear_prox_by_hand():
    behav = torch.tensor([[-1.0, -2.0, -3.0, -4.0, -5.0, -6.0, -7.0]], dtype=F64)
    logp = torch.tensor([[-0.5, -1.0, -1.0, -2.0, -2.0, -1.0, -4.0]], dtype=F64, requires_grad=True)
    versions = torch.tensor([[-1, 5, 4, 3, 2, 3, 4]])
    mask = torch.tensor([[1, 1, 1, 1, 1, 0, 1]])
    # v_theta 5, v_prox 4: alpha = (4 - v) / (5 - v). prompt -> behav; v=5 (v_theta) -> behav;
    # v=4 (v_prox) -> alpha 0 -> behav; v=3 -> 1/2; v=2 -> 2/3; masked -> behav.
    out = loglinear_prox_logp(behav, logp, versions, 5, prox_version=4, mask=mask)
    expected = torch.tensor([[-1.0, -2.0, -3.0, -3.0, -5.0 + 2 / 3 * 3.0, -6.0, -7.0]], dtype=F64)
    assert_close(out, expected)
    assert not out.requires_grad
    # In minibatch 0 (v_theta == v_prox) every stale token takes the current log-prob: recompute's.
    first = loglinear_prox_logp(behav, logp, versions.clamp(max=4), 4, prox_version=4, mask=torch.tensor([[1] * 7]))
    assert_close(first, torch.tensor([[-1.0, -2.0, -3.0, -2.0, -2.0, -1.0, -7.0]], dtype=F64))


def test_loglinear_equals_recompute_where_logprobs_are_linear_in_the_version():
    """AReaL's proximal policy is the one before the batch's first step; recompute computes it, the
    log-linear approximation interpolates to it. Where each token's log-prob is a + b * version,
    the two agree exactly, in every minibatch j (v_theta = v_prox + j) and at every staleness."""
    g = torch.Generator().manual_seed(0)
    B, T, v_prox = 4, 9, 6
    a = -3 * torch.rand(B, T, generator=g, dtype=F64)
    b = 0.2 * torch.randn(B, T, generator=g, dtype=F64)
    versions = torch.randint(0, v_prox + 1, (B, T), generator=g)  # generated at or before v_prox
    behav = a + b * versions
    recompute = a + b * v_prox
    for j in range(4):
        logp = a + b * (v_prox + j)  # the weights after j optimizer steps of this batch
        out = loglinear_prox_logp(behav, logp, versions, v_prox + j, prox_version=v_prox)
        torch.testing.assert_close(out, recompute, rtol=0, atol=1e-12)


def test_loglinear_prox_matches_reference_random():
    g = torch.Generator().manual_seed(0)
    B, T, current, v_prox = 3, 8, 7, 5
    behav = -3 * torch.rand(B, T, generator=g, dtype=F64)
    logp = -3 * torch.rand(B, T, generator=g, dtype=F64)
    versions = torch.randint(-1, current + 1, (B, T), generator=g)
    mask = torch.rand(B, T, generator=g) < 0.8
    out = loglinear_prox_logp(behav, logp, versions, current, prox_version=v_prox, mask=mask)
    for i in range(B):
        for t in range(T):
            v = int(versions[i, t])
            if v == -1 or not mask[i, t]:
                want = float(behav[i, t])
            else:
                alpha = 0.0 if v == current else min(max((v_prox - v) / (current - v), 0.0), 1.0)
                want = float(behav[i, t]) + alpha * (float(logp[i, t]) - float(behav[i, t]))
            assert math.isclose(float(out[i, t]), want, rel_tol=1e-12, abs_tol=1e-12)


def test_loglinear_prox_in_decoupled_loss():
    logp, behav, _, adv, mask = make_batch(9)
    B, T = logp.shape
    # Tokens generated by the proximal policy itself (v_behav = v_prox = 4, v_theta 5): prox = behav,
    # so the decoupled loss is exactly coupled PPO.
    prox1 = loglinear_prox_logp(behav, logp, torch.full((B, T), 4), 5, prox_version=4, mask=mask)
    assert_close(decoupled_ppo_loss(logp=logp, prox_logp=prox1, behav_logp=behav, advantages=adv, mask=mask)[0],
                 ppo_loss(logp=logp, behav_logp=behav, advantages=adv, mask=mask)[0])
    # Minibatch 0 (v_theta = v_prox = 5) on one-step-stale tokens: prox = sg[logp], u = 1,
    # loss = -sum(w A) / n with w = pi/mu (recompute gives the same).
    prox0 = loglinear_prox_logp(behav, logp, torch.full((B, T), 4), 5, prox_version=5, mask=mask)
    loss, _ = decoupled_ppo_loss(logp=logp, prox_logp=prox0, behav_logp=behav, advantages=adv, mask=mask)
    w = (logp.detach() - behav).exp()
    n = mask.sum()
    assert_close(loss, -(w * adv)[mask].sum() / n)
    assert_close(grad_of(loss, logp), torch.where(mask, -w * adv / n, 0.0))


def test_loglinear_prox_errors():
    behav = torch.zeros(1, 3, dtype=F64)
    logp = torch.zeros(1, 3, dtype=F64)
    with pytest.raises(ValueError, match="newer than current_version"):
        loglinear_prox_logp(behav, logp, torch.tensor([[-1, 2, 3]]), 2, prox_version=2)
    # A future version on an excluded token is ignored.
    out = loglinear_prox_logp(behav, logp, torch.tensor([[-1, 2, 3]]), 2, prox_version=2,
                              mask=torch.tensor([[1, 1, 0]]))
    assert out.shape == (1, 3)
    with pytest.raises(ValueError, match="integer"):
        loglinear_prox_logp(behav, logp, torch.zeros(1, 3), 2, prox_version=2)
    with pytest.raises(ValueError, match="versions"):
        loglinear_prox_logp(behav, logp, torch.tensor([[0, 0]]), 2, prox_version=2)
    with pytest.raises(ValueError, match=">= 0"):
        loglinear_prox_logp(behav, logp, torch.tensor([[-2, 0, 0]]), 2, prox_version=2)
    with pytest.raises(ValueError, match="current_version"):
        loglinear_prox_logp(behav, logp, torch.tensor([[0, 0, 0]]), -1, prox_version=0)
    with pytest.raises(ValueError, match="prox_version"):
        loglinear_prox_logp(behav, logp, torch.tensor([[0, 0, 0]]), 2, prox_version=3)
