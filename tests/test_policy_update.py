"""``llamarl/algorithms/update.py``, the algorithm's side of one policy update, on hand-worked
examples and the formulas of docs/algorithms.md ("Advantages", "Versions and staleness", the
losses and the proximal policy). One process, no process group: the trainer's collectives are
played here by summing / taking the maximum of two "ranks'" values."""

from __future__ import annotations

import math

import pytest
import torch

from llamarl.algorithms.config import AlgoConfig
from llamarl.algorithms.registered import get_policy_loss
from llamarl.algorithms.update import (
    MINIBATCH_COUNTS,
    PolicyUpdate,
    advantage_moments,
    filter_stale,
    forwarded_rows,
    minibatch_counts,
    normalize_advantages,
    split_minibatches,
)
from llamarl.runtime.batch import TensorBatch
from llamarl.runtime.metrics import MetricSpec


def close(actual, expected, tol=1e-6):
    torch.testing.assert_close(actual, torch.as_tensor(expected, dtype=actual.dtype), rtol=0, atol=tol)


# ----- advantages -----
def test_advantages_sorted_by_group_and_grpo_by_hand():
    batch = TensorBatch({"group_ids": torch.tensor([1, 0, 1, 0]), "rewards": torch.tensor([1.0, 0.0, 0.0, 0.0]),
                         "row": torch.arange(4)}, {"group_size": 2})
    out = PolicyUpdate(AlgoConfig(advantage="grpo")).advantages(batch)
    assert out["row"].tolist() == [1, 3, 0, 2]  # stable sort by group id
    # group 0: rewards [0, 0]: no signal, exactly 0; group 1: [1, 0], mean 0.5, population std 0.5
    close(out["advantages"], [0.0, 0.0, 0.5 / (0.5 + 1e-6), -0.5 / (0.5 + 1e-6)])
    assert "advantages" not in batch  # the input is not modified
    # RLOO with G = 2: r_i - r_j
    close(PolicyUpdate(AlgoConfig(advantage="rloo")).advantages(batch)["advantages"], [0.0, 0.0, 1.0, -1.0])


def test_advantages_bad_batches():
    update = PolicyUpdate(AlgoConfig())
    batch = TensorBatch({"group_ids": torch.tensor([0, 0, 1]), "rewards": torch.tensor([1.0, 0.0, 1.0])})
    with pytest.raises(ValueError, match=r"no metadata\['group_size'\]"):
        update.advantages(batch)
    batch.metadata["group_size"] = 2
    with pytest.raises(ValueError, match="trainer input: group 1 has 1 rows, but the batch's group_size is 2"):
        update.advantages(batch)


def test_normalize_advantages_by_hand():
    # [1, 3]: mean 2, population std 1
    a = torch.tensor([1.0, 3.0])
    close(normalize_advantages(a, *advantage_moments(a)), [-1 / (1 + 1e-6), 1 / (1 + 1e-6)])


def test_normalize_advantages_over_two_ranks_is_the_whole_batch():
    """(a - mean) / (std + eps) with the whole batch's mean and population std, whichever rank holds a row."""
    first, second = torch.tensor([1.0, 3.0, 5.0]), torch.tensor([7.0])
    moments = [x + y for x, y in zip(advantage_moments(first), advantage_moments(second))]  # the all-reduce
    assert moments == [4.0, 16.0, 84.0]
    std = math.sqrt(5.0)  # [1, 3, 5, 7]: mean 4, deviations [-3, -1, 1, 3], population variance 20 / 4
    close(normalize_advantages(first, *moments), [-3 / (std + 1e-6), -1 / (std + 1e-6), 1 / (std + 1e-6)])
    close(normalize_advantages(second, *moments), [3 / (std + 1e-6)])


def test_normalize_advantages_needs_samples():
    with pytest.raises(ValueError, match="count must be > 0"):
        normalize_advantages(torch.zeros(0), 0.0, 0.0, 0.0)


# ----- staleness -----
def stale_batch() -> TensorBatch:
    # Trainer at version 5. Row 0: tokens of versions 4, 3 (staleness 1, 2); row 1: versions 2, 4
    # (staleness 3, 1); row 2: versions 5, 5 and a padding token of version -1 (not a loss token).
    return TensorBatch({"versions": torch.tensor([[-1, 4, 3], [-1, 2, 4], [5, 5, -1]]),
                        "loss_mask": torch.tensor([[0, 1, 1], [0, 1, 1], [1, 1, 0]], dtype=torch.int32)})


def test_filter_stale_by_hand():
    batch = stale_batch()
    kept, stats = filter_stale(batch, 5, None)
    assert kept is batch and stats == {"staleness_sum": 1 + 2 + 3 + 1 + 0 + 0, "staleness_max": 3.0}
    kept, stats = filter_stale(batch, 5, 2)  # eta = 2: row 1 holds a token 3 versions old
    assert kept["loss_mask"].tolist() == [[0, 1, 1], [0, 0, 0], [1, 1, 0]]
    assert stats == {"dropped_stale_samples": 1.0, "staleness_sum": 3.0, "staleness_max": 2.0}
    assert batch["loss_mask"][1].tolist() == [0, 1, 1]  # the input is not modified
    assert filter_stale(TensorBatch(), 5, 2) == (TensorBatch(), {})


def test_filter_stale_keeps_nothing_older_than_eta_zero():
    kept, stats = filter_stale(stale_batch(), 5, 0)
    assert kept["loss_mask"].tolist() == [[0, 0, 0], [0, 0, 0], [1, 1, 0]]
    assert stats == {"dropped_stale_samples": 2.0, "staleness_sum": 0.0, "staleness_max": 0.0}


# ----- minibatches -----
def grouped(groups: list[int]) -> TensorBatch:
    """Two rows per group, ``row`` numbering them."""
    ids = torch.tensor(groups).repeat_interleave(2)
    return TensorBatch({"group_ids": ids, "row": torch.arange(len(ids))}, {"group_size": 2})


def test_split_minibatches_by_hand():
    # 5 groups, k = 2: group i of 5 goes to minibatch i * 2 // 5 = [0, 0, 0, 1, 1]
    parts = split_minibatches(grouped([3, 1]), [4, 0, 1, 3, 2, 1], 2)  # this rank holds groups 3 and 1
    assert [p["group_ids"].tolist() for p in parts] == [[1, 1], [3, 3]]
    assert [p["row"].tolist() for p in parts] == [[2, 3], [0, 1]]
    parts = split_minibatches(grouped([0, 1, 2, 3, 4]), range(5), 3)  # i * 3 // 5 = [0, 0, 1, 1, 2]
    assert [sorted(set(p["group_ids"].tolist())) for p in parts] == [[0, 1], [2, 3], [4]]


def test_split_minibatches_does_not_depend_on_the_ranks():
    every = [0, 1, 2, 3, 4, 5, 6]
    whole = split_minibatches(grouped(every), every, 3)
    halves = [split_minibatches(grouped(part), every, 3) for part in ([6, 0, 2, 4], [1, 3, 5])]
    for j in range(3):
        assert sorted(whole[j]["group_ids"].tolist()) == sorted(
            halves[0][j]["group_ids"].tolist() + halves[1][j]["group_ids"].tolist())


def test_split_minibatches_edges_and_bad_inputs():
    batch = grouped([0, 1])
    assert split_minibatches(batch, [0, 1], 1) == [batch]
    assert [len(p) for p in split_minibatches(TensorBatch(), [0, 1], 3)] == [0, 0, 0]
    assert [len(p) for p in split_minibatches(batch, [0, 1], 4)] == [2, 0, 2, 0]  # more minibatches than groups
    with pytest.raises(ValueError, match=r"group ids \[1\] of the batch are not among the gathered ones"):
        split_minibatches(batch, [0, 2], 2)
    with pytest.raises(ValueError, match="k .* must be >= 1, got 0"):
        split_minibatches(batch, [0, 1], 0)


# ----- rows with signal -----
def test_forwarded_rows_and_minibatch_counts_by_hand():
    batch = TensorBatch({"advantages": torch.tensor([0.5, 0.0, -0.5, 1.0]),
                         "loss_mask": torch.tensor([[1, 1, 0], [1, 1, 1], [0, 1, 0], [0, 0, 0]]),
                         "row": torch.arange(4)})
    # row 1: advantage 0 (no signal); row 3: no loss token left (e.g. dropped as stale)
    assert forwarded_rows(batch).tolist() == [0, 2]
    rows, counts = minibatch_counts(batch, {"staleness_sum": 7.0, "staleness_max": 2.0, "dropped_stale_samples": 1.0})
    assert rows["row"].tolist() == [0, 2]
    # every loss token counts (row 1's included), one zero-advantage sample, two rows with signal
    assert dict(zip(MINIBATCH_COUNTS, counts)) == {"tokens": 6.0, "staleness_sum": 7.0, "zero_advantage": 1.0,
                                                   "signal": 2.0, "dropped_stale": 1.0, "sequences": 3.0}
    empty, counts = minibatch_counts(TensorBatch(), {})
    assert len(empty) == 0 and counts == [0.0] * 6


# ----- the loss, resolved once -----
def test_the_loss_is_resolved_once_from_the_registry():
    update = PolicyUpdate(AlgoConfig(loss="decoupled_ppo"))
    assert update.loss is get_policy_loss("decoupled_ppo") and update.loss.needs_prox
    assert update.metric_specs == {k: MetricSpec("loss", "max") for k in update.loss.metrics}
    algo = AlgoConfig()
    algo.loss = "nope"  # past the config's own check
    with pytest.raises(ValueError, match="unknown policy loss 'nope'; registered: .*aipo"):
        PolicyUpdate(algo)


LOGP = torch.tensor([[-1.0, -0.5, -2.0, -0.1], [-0.3, -0.7, -1.2, -0.9]])
BEHAV = torch.tensor([[-1.1, -0.9, -1.5, -0.2, 0.0], [-0.3, -0.2, -1.6, -0.9, 0.0]])  # one column more: sliced
MASK = torch.tensor([[0.0, 1.0, 1.0, 1.0], [0.0, 1.0, 1.0, 0.0]])
ADV = torch.tensor([1.0, -0.5])
TOKENS = 10.0  # the global count of the step: more than this micro-batch's 5


def sub(**extra) -> TensorBatch:
    return TensorBatch({"behav_logp": BEHAV, "advantages": ADV,
                        "versions": torch.tensor([[-1, 1, 1, 1, -1], [-1, 1, 1, -1, -1]]), **extra})


def test_loss_on_aipo_is_the_paper_formula():
    """AIPO (LlamaRL §6): l_t = -sg[min(pi / mu, rho)] * A * log pi, summed over masked tokens / N."""
    algo = AlgoConfig(loss="aipo", rho=1.2)
    logp = LOGP.clone().requires_grad_()
    loss, metrics = PolicyUpdate(algo).loss_on(sub(), logp, MASK, num_loss_tokens=TOKENS, version=3, prox_version=3)
    weight = torch.clamp((LOGP - BEHAV[:, :4]).exp(), max=1.2)
    expected = -(weight * ADV[:, None] * LOGP * MASK).sum() / TOKENS
    close(loss.detach(), expected)
    loss.backward()
    close(logp.grad, -(weight * ADV[:, None] * MASK) / TOKENS)
    assert set(metrics) == set(get_policy_loss("aipo").metrics)


def test_loss_on_decoupled_ppo_with_the_loglinear_prox():
    """Decoupled PPO (AReaL eq. 3) with A-3PO's prox: tokens of version 1, prox version 2, weights at
    version 3: alpha = (2 - 1) / (3 - 1) = 1/2, log prox = log mu + (log pi - log mu) / 2."""
    update = PolicyUpdate(AlgoConfig(loss="decoupled_ppo", prox="loglinear", eps_clip=0.2))
    calls = []

    def timed(compute):
        calls.append(1)
        return compute()

    loss, _ = update.loss_on(sub(), LOGP, MASK, num_loss_tokens=TOKENS, version=3, prox_version=2, timed=timed)
    behav = BEHAV[:, :4]
    prox = behav + 0.5 * (LOGP - behav)
    u, w = (LOGP - prox).exp(), (prox - behav).exp()
    a = ADV[:, None]
    expected = -(w * torch.minimum(u * a, u.clamp(0.8, 1.2) * a) * MASK).sum() / TOKENS
    close(loss, expected)
    assert calls == [1]  # the interpolation went through the trainer's timer
    # minibatch 0 (version == prox version): alpha = 1, so u = 1 and l_t = -w * A with w = pi / mu
    loss, _ = update.loss_on(sub(), LOGP, MASK, num_loss_tokens=TOKENS, version=2, prox_version=2)
    close(loss, -((LOGP - behav).exp() * a * MASK).sum() / TOKENS)


def test_loss_on_uses_a_recomputed_prox_when_there_is_one():
    update = PolicyUpdate(AlgoConfig(loss="decoupled_ppo"))
    stored = torch.cat([LOGP, torch.zeros(2, 1)], dim=1)  # the recomputed proximal log-probs = pi's
    loss, _ = update.loss_on(sub(prox_logp=stored), LOGP, MASK, num_loss_tokens=TOKENS, version=5, prox_version=4,
                             timed=lambda compute: pytest.fail("no interpolation with a stored prox"))
    close(loss, -((LOGP - BEHAV[:, :4]).exp() * ADV[:, None] * MASK).sum() / TOKENS)


# ----- metrics -----
def test_metrics_accumulate_and_reduce_by_hand():
    """Two ranks: rank 0 runs micro-batches of 2 and 6 loss tokens, rank 1 one of 4 and a dummy."""
    update = PolicyUpdate(AlgoConfig(loss="aipo"))
    ranks = []
    for microbatches in (
        [(0.3, 2.0, {"importance_weight_mean": 1.0, "importance_weight_max": 1.5, "approx_kl": 0.1,
                     "clip_fraction": 0.0}),
         (0.1, 6.0, {"importance_weight_mean": 2.0, "importance_weight_max": 1.2, "approx_kl": 0.3,
                     "clip_fraction": 0.5})],
        [(0.2, 4.0, {"importance_weight_mean": 0.5, "importance_weight_max": 0.9, "approx_kl": 0.0,
                     "clip_fraction": 0.25}),
         (0.0, 0.0, {})],  # the dummy micro-batch
    ):
        sums, maxes = {}, {}
        for loss, tokens, metrics in microbatches:
            update.accumulate(sums, maxes, metrics, loss, tokens)
        ranks.append(update.metric_vectors(sums, maxes))
    summed = [x + y for x, y in zip(ranks[0][0], ranks[1][0])]  # the trainer's two all-reduces
    maxed = [max(x, y) for x, y in zip(ranks[0][1], ranks[1][1])]
    loss, metrics = update.reduced_metrics(summed, maxed)
    assert loss == pytest.approx(0.6)
    # token-weighted means over 2 + 6 + 4 = 12 tokens; the maximum over every micro-batch and rank
    assert metrics == pytest.approx({"importance_weight_mean": (2 + 12 + 2) / 12, "approx_kl": (0.2 + 1.8) / 12,
                                     "clip_fraction": (3 + 1) / 12, "importance_weight_max": 1.5})
    # a rank that ran only dummies sends the same keys, as zeros
    assert update.metric_vectors({}, {}) == ([0.0] * 5, [0.0])


def test_metrics_bad_inputs():
    update = PolicyUpdate(AlgoConfig(loss="aipo"))
    with pytest.raises(ValueError, match="policy loss 'aipo' reported metric 'ratio' it did not declare"):
        update.accumulate({}, {}, {"ratio": 1.0}, 0.0, 1.0)
    with pytest.raises(ValueError, match="expected 5 sums and 1 maxima"):
        update.reduced_metrics([0.0, 1.0], [0.0])
