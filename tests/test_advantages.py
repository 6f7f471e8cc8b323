"""Group advantages and KL estimators on hand-worked examples."""

from __future__ import annotations

import math

import pytest
import torch

from llamarl.algorithms.advantages import group_advantages, kl_penalty

# Two groups of 4: [1, 2, 3, 6] (mean 3, deviations [-2, -1, 0, 3], population var 14/4 = 3.5)
# and [0, 0, 1, 1] (mean 0.5, deviations [-.5, -.5, .5, .5], population std 0.5).
REWARDS = torch.tensor([1.0, 2.0, 3.0, 6.0, 0.0, 0.0, 1.0, 1.0], dtype=torch.float64)


def close(actual, expected, tol=1e-5):
    torch.testing.assert_close(actual, torch.tensor(expected, dtype=actual.dtype), rtol=0, atol=tol)


def test_grpo_by_hand():
    s = math.sqrt(3.5)  # population std of group 1; the unbiased one would be sqrt(14/3)
    expected = [-2 / s, -1 / s, 0.0, 3 / s, -1.0, -1.0, 1.0, 1.0]
    close(group_advantages(REWARDS, 4, "grpo"), expected)


def test_rloo_by_hand():
    # r_i minus the mean of the other three: 1 - 11/3, 2 - 10/3, 3 - 9/3, 6 - 6/3; 0 - 1/3, ...
    expected = [-8 / 3, -4 / 3, 0.0, 4.0, -2 / 3, -2 / 3, 2 / 3, 2 / 3]
    close(group_advantages(REWARDS, 4, "rloo"), expected, tol=1e-12)


def test_mean_by_hand():
    expected = [-2.0, -1.0, 0.0, 3.0, -0.5, -0.5, 0.5, 0.5]
    close(group_advantages(REWARDS, 4, "mean"), expected, tol=1e-12)


def test_group_size_two_and_constant_group():
    r = torch.tensor([1.0, 3.0, 5.0, 5.0])
    close(group_advantages(r, 2, "grpo"), [-1.0, 1.0, 0.0, 0.0])  # a constant group gives 0, not NaN
    close(group_advantages(r, 2, "rloo"), [-2.0, 2.0, 0.0, 0.0])


def test_group_size_one_and_integer_rewards():
    assert torch.equal(group_advantages(torch.tensor([3.0, -1.0]), 1, "grpo"), torch.zeros(2))
    out = group_advantages(torch.tensor([0, 1, 1, 1]), 2, "mean")
    assert out.dtype == torch.float32
    close(out, [-0.5, 0.5, 0.0, 0.0])


def test_group_advantages_errors():
    with pytest.raises(ValueError, match="divisible"):
        group_advantages(REWARDS, 3)
    with pytest.raises(ValueError, match="group_size"):
        group_advantages(REWARDS, 0)
    with pytest.raises(ValueError, match="rloo"):
        group_advantages(REWARDS[:2], 1, "rloo")
    with pytest.raises(ValueError, match="mode"):
        group_advantages(REWARDS, 4, "gae")
    with pytest.raises(ValueError, match="1-D"):
        group_advantages(REWARDS.view(2, 4), 4)


def test_kl_penalty_by_hand():
    logp = torch.tensor([[-1.0, -2.0, 0.0]], dtype=torch.float64)
    ref = torch.tensor([[-1.5, -1.0, -1e4]], dtype=torch.float64)  # last token is padding
    mask = torch.tensor([[True, True, False]])
    # log_r = ref - logp = [-0.5, 1.0]
    close(kl_penalty(logp, ref, mask, kind="k1"), [[0.5, -1.0, 0.0]], tol=1e-12)
    close(kl_penalty(logp, ref, mask, kind="k2"), [[0.125, 0.5, 0.0]], tol=1e-12)
    k3 = [math.exp(-0.5) - 1 + 0.5, math.e - 1 - 1, 0.0]
    close(kl_penalty(logp, ref, mask, kind="k3"), [k3], tol=1e-12)


def test_kl_penalty_gradient_and_errors():
    logp = torch.tensor([[-1.0, -2.0]], dtype=torch.float64, requires_grad=True)
    ref = torch.tensor([[-1.5, -1.0]], dtype=torch.float64)
    kl = kl_penalty(logp, ref, torch.ones(1, 2), kind="k3")
    (g,) = torch.autograd.grad(kl.sum(), logp)
    # d/dlogp [exp(ref - logp) - 1 - (ref - logp)] = 1 - exp(ref - logp)
    close(g, [[1 - math.exp(-0.5), 1 - math.e]], tol=1e-12)
    with pytest.raises(ValueError, match="KL estimator"):
        kl_penalty(logp, ref, torch.ones(1, 2), kind="k4")
    with pytest.raises(ValueError, match="mask"):
        kl_penalty(logp, ref, torch.ones(2, 2))


@pytest.mark.parametrize("mode", ["grpo", "rloo", "mean"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_a_tied_group_gets_exactly_zero_in_any_dtype(mode, dtype):
    """Graded rewards (a judge's p(yes), partial credit) tie too: 0.9 x 8 must give 0, not a push.

    The fp32 mean of eight 0.9s is an ulp away from 0.9; divided by std + 1e-6 that was -0.056."""
    values = [0.9, 0.1, 1 / 3, 0.7, 2.0 / 7]
    rewards = torch.tensor([v for v in values for _ in range(8)], dtype=dtype)
    rewards = torch.cat([rewards, torch.tensor([0.2, 0.9, 0.9, 0.9, 0.9, 0.9, 0.9, 0.9], dtype=dtype)])
    adv = group_advantages(rewards, 8, mode)
    assert torch.equal(adv[:40], torch.zeros(40, dtype=adv.dtype))
    assert (adv[40:] != 0).all()  # a group that differs keeps its signal


def test_groups_must_have_exactly_group_size_rows():
    from llamarl.algorithms.advantages import check_groups

    check_groups(torch.tensor([1, 1, 4, 4]), 2, where="test")
    with pytest.raises(ValueError, match="test: group 4 has 3 rows, but the batch's group_size is 2"):
        check_groups(torch.tensor([1, 1, 4, 4, 4]), 2, where="test")
    with pytest.raises(ValueError, match="group 1 has 1 rows"):
        check_groups(torch.tensor([1, 4, 4]), 2, where="test")
