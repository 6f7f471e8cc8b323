"""One policy update, the algorithm's side: what the trainer executor calls between its collectives.

verl's ``core_algos.py`` pattern: the algorithm lives in one module and the executor only calls it.
``TrainerExecutor`` (``llamarl/executors/trainer.py``) keeps the device work (placement, FSDP2
forward / backward, gradient clipping, the optimizer step), the collectives (each all-reduce and
all-gather below is the trainer's, fed by and fed back into these functions) and checkpoint state.
Everything here is local to one rank and runs without a process group. In the order of one batch:

1. ``PolicyUpdate.advantages``: rows sorted by group id, groups checked whole, advantages from the
   registered estimator (``--algo.advantage``: GRPO / RLOO / Dr. GRPO, ``advantages.py``);
   ``--algo.normalize-batch``: ``advantage_moments`` (this rank's count, sum, sum of squares, summed
   over the trainer's ranks by the trainer) then ``normalize_advantages``, ``(a - mean) / (std + eps)``
   with the population std of the whole batch;
2. ``split_minibatches``: the batch's prompt groups (every rank's, gathered by the trainer) sorted by
   id and cut into k consecutive runs of sizes differing by at most one, group ``i`` of ``G`` in
   minibatch ``i * k // G``; this rank's rows of each, in order;
3. per minibatch, at the trainer's version ``v``: ``filter_stale`` (staleness ``v - versions`` per
   loss token; with ``--algo.max-staleness`` eta, rows holding a token older than eta lose their loss
   mask), then ``minibatch_counts`` (the rows to forward, ``forwarded_rows``: a loss token and
   ``A != 0``, and this rank's counts, summed over ranks by the trainer into ``MINIBATCH_COUNTS``);
4. per micro-batch: ``PolicyUpdate.loss_on`` (the proximal log-probs, stored or A-3PO log-linear,
   ``prox.py``, then the loss registered as ``--algo.loss``, resolved once, ``registered.py``) and
   ``PolicyUpdate.accumulate`` (its metrics by their declared reduction);
5. ``PolicyUpdate.metric_vectors`` (what the trainer all-reduces: sums, then maxima) and
   ``PolicyUpdate.reduced_metrics`` (the step's loss and token-weighted means).

The formulas are in docs/algorithms.md ("Advantages", "Versions and staleness").
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from llamarl.algorithms.advantages import check_groups
from llamarl.algorithms.aggregation import Aggregation, aggregate
from llamarl.algorithms.config import AlgoConfig
from llamarl.algorithms.prox import loglinear_prox_logp
from llamarl.algorithms.registered import PolicyLoss, get_advantage, get_policy_loss
from llamarl.runtime.batch import TensorBatch
from llamarl.runtime.metrics import MetricSpec

__all__ = ["MINIBATCH_COUNTS", "NORMALIZE_EPS", "PolicyUpdate", "advantage_moments", "filter_stale",
           "forwarded_rows", "minibatch_counts", "normalize_advantages", "split_minibatches"]

NORMALIZE_EPS = 1e-6  # ``--algo.normalize-batch``'s epsilon on the std
# What ``minibatch_counts`` returns per rank, in order; the trainer sums each over its ranks.
MINIBATCH_COUNTS = ("tokens", "staleness_sum", "zero_advantage", "signal", "dropped_stale", "sequences")


# ----- advantages -----
def advantage_moments(advantages: Tensor) -> list[float]:
    """This rank's ``[count, sum, sum of squares]`` of ``advantages`` (squares in float64), for the
    whole-batch statistics of ``normalize_advantages`` once summed over every trainer rank."""
    return [float(advantages.numel()), float(advantages.sum()), float((advantages.double() ** 2).sum())]


def normalize_advantages(advantages: Tensor, count: float, total: float, squares: float,
                         *, eps: float = NORMALIZE_EPS) -> Tensor:
    """``(a - mean) / (std + eps)`` with ``mean = total / count`` and the population std
    ``sqrt(squares / count - mean**2)`` (clamped at 0 against rounding): ``advantage_moments`` summed
    over the batch's ranks, so the result does not depend on how the batch is split over them."""
    if count <= 0:
        raise ValueError(f"normalize_advantages: count must be > 0 (the batch's number of samples), got {count}")
    mean = total / count
    std = max(squares / count - mean * mean, 0.0) ** 0.5
    return (advantages - mean) / (std + eps)


# ----- staleness -----
def filter_stale(batch: TensorBatch, version: int,
                 max_staleness: int | None) -> tuple[TensorBatch, dict[str, float]]:
    """Staleness ``version - versions`` of every loss token; ``--algo.max-staleness`` eta.

    With eta set, rows holding a token more than eta versions behind ``version`` lose their loss
    mask (a new batch; the input's fields are not modified) and ``dropped_stale_samples`` counts
    them. ``staleness_sum`` / ``staleness_max`` are over the loss tokens left (zero-advantage
    samples' included), the ones the optimizer step's token mean is over. An empty batch gives
    ``{}``.
    """
    stats: dict[str, float] = {}
    if not len(batch):
        return batch, stats
    mask = batch["loss_mask"].bool()
    staleness = (version - batch["versions"]).masked_fill(~mask, 0)
    if max_staleness is not None:
        stale_rows = (staleness > max_staleness).any(dim=1)
        batch = TensorBatch(dict(batch.fields), batch.metadata)
        batch.fields["loss_mask"] = batch["loss_mask"] * (~stale_rows).unsqueeze(1).to(batch["loss_mask"].dtype)
        stats["dropped_stale_samples"] = float(stale_rows.sum())
        mask = batch["loss_mask"].bool()
    stats["staleness_sum"] = float(staleness[mask].sum())
    stats["staleness_max"] = float(staleness[mask].max()) if mask.any() else 0.0
    if max_staleness is not None and stats["staleness_max"] > max_staleness:
        raise RuntimeError(f"a token {stats['staleness_max']:.0f} versions old survived --algo.max-staleness "
                           f"{max_staleness}")
    return batch, stats


# ----- minibatches -----
def split_minibatches(batch: TensorBatch, group_ids: Sequence[int], k: int) -> list[TensorBatch]:
    """This rank's rows of each of the k minibatches, in order.

    ``group_ids``: the group ids of the whole batch over every trainer rank (the trainer gathers
    them; any order, duplicates ignored). Sorted, group ``i`` of ``G`` goes to minibatch
    ``i * k // G``: k consecutive runs of whole groups whose sizes differ by at most one, the same
    split however the batch is spread over ranks. Minibatch j holds this rank's rows of run j
    (possibly none); an empty batch gives k empty ones.
    """
    if k < 1:
        raise ValueError(f"split_minibatches: k (--trainer.num-minibatches) must be >= 1, got {k}")
    if k == 1:
        return [batch]
    if not len(batch):
        return [batch] * k
    every = sorted({int(g) for g in group_ids})
    which = {g: i * k // len(every) for i, g in enumerate(every)}
    local = batch["group_ids"].tolist()
    missing = sorted(set(local) - which.keys())
    if missing:
        raise ValueError(f"split_minibatches: group ids {missing[:5]} of the batch are not among the gathered ones")
    assigned = torch.tensor([which[g] for g in local], device=batch.device)
    return [batch.select((assigned == j).nonzero().squeeze(1)) for j in range(k)]


# ----- rows with signal -----
def forwarded_rows(batch: TensorBatch, *, every_loss_row: bool = False) -> Tensor:
    """Indices of the rows the loss needs a forward for: some loss token and a non-zero advantage
    (every built-in loss is proportional to A, so the others add exactly zero loss and gradient).
    ``every_loss_row`` (an entropy bonus, ``--algo.entropy-coef``: every loss token has a gradient):
    every row with a loss token."""
    has_tokens = batch["loss_mask"].bool().any(dim=1)
    return (has_tokens if every_loss_row else (batch["advantages"] != 0) & has_tokens).nonzero().squeeze(1)


def minibatch_counts(batch: TensorBatch, stats: dict[str, float], *,
                     every_loss_row: bool = False) -> tuple[TensorBatch, list[float]]:
    """This rank's rows to forward (``forwarded_rows``) and its counts, in ``MINIBATCH_COUNTS``
    order: loss tokens (forwarded or not: the global token mean's denominator), ``staleness_sum``,
    zero-advantage samples, rows forwarded, ``dropped_stale_samples`` (``stats`` from
    ``filter_stale``), samples with a loss token (the ``seq-mean`` aggregations' denominator). A zero-advantage row (its group all scored alike) adds exactly zero loss and
    gradient, so it is not forwarded, but its tokens still count in the token mean: the update is
    bit-for-bit the same. Rows the staleness filter masked have no loss token: not forwarded, and
    not signal (else an AdamW step on a zero gradient could still happen). ``every_loss_row``
    (``forwarded_rows``): every row with a loss token is forwarded and counts as signal, since the
    entropy bonus gives each a gradient."""
    tokens = float(batch["loss_mask"].sum()) if len(batch) else 0.0
    zero_advantage = sequences = 0.0
    if len(batch):
        zero_advantage = float((batch["advantages"] == 0).sum())
        sequences = float(batch["loss_mask"].bool().any(dim=1).sum())
        batch = batch.select(forwarded_rows(batch, every_loss_row=every_loss_row))
    return batch, [tokens, stats.get("staleness_sum", 0.0), zero_advantage, float(len(batch)),
                   stats.get("dropped_stale_samples", 0.0), sequences]


# ----- the configured update -----
@dataclass
class PolicyUpdate:
    """The algorithm of ``--algo``: the advantage estimator and the policy loss, each looked up in the
    registry once, here, and the per-rank steps of an update that depend on them."""

    algo: AlgoConfig
    """The ``--algo`` section (``llamarl/algorithms/config.py``)."""
    loss: PolicyLoss = field(init=False)
    """The loss registered as ``algo.loss``: its function, declared metrics, whether it needs prox."""

    def __post_init__(self) -> None:
        self.loss = get_policy_loss(self.algo.loss)
        self._advantage = get_advantage(self.algo.advantage)
        keys = sorted(self.loss.metrics)
        self._sum_keys = [k for k in keys if self.loss.metrics[k] != "max"]
        self._max_keys = [k for k in keys if self.loss.metrics[k] == "max"]

    @property
    def metric_specs(self) -> dict[str, MetricSpec]:
        """The loss's declared metrics, section ``loss``; the trainer already reduced them over its
        ranks (``reduced_metrics``), so every rank holds the same value ("max" keeps it)."""
        return {key: MetricSpec("loss", "max") for key in self.loss.metrics}

    def advantages(self, batch: TensorBatch) -> TensorBatch:
        """``batch`` (non-empty) with rows sorted by group id (stable), every group checked to have
        ``metadata['group_size']`` rows, and ``advantages`` [N] from the estimator, before any
        ``--algo.normalize-batch``."""
        if "group_size" not in batch.metadata:
            raise ValueError("trainer input: the batch has no metadata['group_size'] (samples per prompt); "
                             "without it every row would be its own group and every advantage 0")
        group_size = int(batch.metadata["group_size"])
        batch = batch.select(torch.argsort(batch["group_ids"], stable=True))
        check_groups(batch["group_ids"], group_size, where="trainer input")
        advantages = self._advantage(batch["rewards"].float(), group_size)
        if self.algo.adv_pos_weight != 1.0 or self.algo.adv_neg_weight != 1.0:
            # Positive / negative reweighting (--algo.adv-pos-weight / --algo.adv-neg-weight).
            advantages = torch.where(advantages > 0, advantages * self.algo.adv_pos_weight,
                                     advantages * self.algo.adv_neg_weight)
        batch.fields["advantages"] = advantages
        return batch

    def begin_minibatch(self, counts: dict[str, float]) -> None:
        """The minibatch's global ``MINIBATCH_COUNTS`` (summed over the trainer's ranks), before its
        first ``loss_on``: the ``--algo.loss-agg`` denominators."""
        self._counts = counts

    def aggregation(self, num_loss_tokens: float) -> float | Aggregation:
        """What the loss gets as ``num_loss_tokens``: the count itself for ``token-mean`` (the
        registry's contract, unchanged), else the ``Aggregation`` with this minibatch's counts."""
        mode = getattr(self.algo, "loss_agg", "token-mean")
        if mode == "token-mean":
            return num_loss_tokens
        counts = getattr(self, "_counts", None)
        if counts is None:
            raise RuntimeError(f"--algo.loss-agg {mode}: begin_minibatch was not called with the minibatch's counts")
        return Aggregation(mode, num_tokens=num_loss_tokens, num_seqs=counts["sequences"],
                           constant=float(self.algo.loss_agg_length or 1))

    @property
    def every_loss_row(self) -> bool:
        """Whether every row with a loss token is forwarded: with an entropy bonus each has a gradient."""
        return float(getattr(self.algo, "entropy_coef", 0.0)) != 0.0

    def loss_on(self, sub: TensorBatch, logp: Tensor, mask: Tensor, *, num_loss_tokens: float, version: int,
                prox_version: int, timed: Callable[[Callable[[], Tensor]], Tensor] | None = None,
                entropy: Tensor | None = None) -> tuple[Tensor, dict]:
        """The registered loss on one micro-batch: ``logp`` / ``mask`` ``[b, length]`` of the rows
        ``sub``, the weights at ``version``. A loss that needs the proximal policy gets
        ``sub['prox_logp']`` when the trainer recomputed it, else A-3PO's log-linear approximation
        anchored at ``prox_version`` (run through ``timed``, the trainer's device timer, if given).

        Entropy bonus (``--algo.entropy-coef`` c, verl's ``entropy_coeff``): with ``entropy``
        ``[b, length]``, each token's ``H_t = -sum_v p_v log p_v`` (differentiable), the loss is
        ``loss - c * agg(H)``, ``agg`` the ``--algo.loss-agg`` aggregation of the policy loss over the
        same global counts (``token-mean``: ``sum_t H_t / N``), so it too is exact however the step
        is split into micro-batches and ranks."""
        length = mask.shape[1]
        behav = sub["behav_logp"][:, :length].float()
        prox = None
        if self.loss.needs_prox:
            if "prox_logp" in sub:
                prox = sub["prox_logp"][:, :length]
            else:
                def interpolate() -> Tensor:
                    return loglinear_prox_logp(behav, logp, sub["versions"][:, :length], version,
                                               prox_version=prox_version, mask=mask)
                prox = timed(interpolate) if timed is not None else interpolate()
        agg = self.aggregation(num_loss_tokens)
        loss, metrics = self.loss.fn(logp=logp, behav_logp=behav, prox_logp=prox, advantages=sub["advantages"],
                                     mask=mask, algo=self.algo, num_loss_tokens=agg)
        if self.every_loss_row:
            if entropy is None:
                raise ValueError("--algo.entropy-coef: loss_on needs the micro-batch's entropy [b, length]")
            loss = loss - float(self.algo.entropy_coef) * aggregate(entropy[:, :length].float(), mask.bool(), agg)
        return loss, metrics

    def accumulate(self, sums: dict[str, float], maxes: dict[str, float], metrics: dict, loss: float,
                   num_tokens: float) -> None:
        """Add one micro-batch (``num_tokens`` loss tokens) to this rank's ``sums`` / ``maxes``, in
        place: ``loss``, ``metric_tokens``, and each metric as declared: ``mean`` token-weighted,
        ``sum``, ``max``. A metric the loss did not declare is a ValueError."""
        for key, value in metrics.items():
            reduction = self.loss.metrics.get(key)
            if reduction is None:
                raise ValueError(f"policy loss {self.loss.name!r} reported metric {key!r} it did not declare "
                                 f"(declared: {sorted(self.loss.metrics)})")
            if reduction == "max":
                maxes[key] = max(maxes.get(key, float("-inf")), float(value))
            elif reduction == "sum":
                sums[key] = sums.get(key, 0.0) + float(value)
            else:  # token-weighted mean
                sums[key] = sums.get(key, 0.0) + float(value) * num_tokens
        sums["loss"] = sums.get("loss", 0.0) + loss
        sums["metric_tokens"] = sums.get("metric_tokens", 0.0) + num_tokens

    def metric_vectors(self, sums: dict[str, float], maxes: dict[str, float]) -> tuple[list[float], list[float]]:
        """What the trainer reduces over its ranks: ``[loss, metric_tokens, *sum and mean metrics]``
        (summed) and ``[*max metrics]`` (maximum), each in sorted key order, so every rank sends
        the same keys, one that only ran dummy micro-batches included (0 for a missing key)."""
        return ([sums.get("loss", 0.0), sums.get("metric_tokens", 0.0)] + [sums.get(k, 0.0) for k in self._sum_keys],
                [maxes.get(k, 0.0) for k in self._max_keys])

    def reduced_metrics(self, summed: Sequence[float], maxed: Sequence[float]) -> tuple[float, dict[str, float]]:
        """The step's loss and the loss's metrics from ``metric_vectors`` reduced over ranks:
        ``mean`` metrics divided by the loss tokens trained on (at least 1), the rest as they are."""
        if len(summed) != 2 + len(self._sum_keys) or len(maxed) != len(self._max_keys):
            raise ValueError(f"reduced_metrics: expected {2 + len(self._sum_keys)} sums and {len(self._max_keys)} "
                             f"maxima (metric_vectors' order), got {len(summed)} and {len(maxed)}")
        metric_tokens = max(summed[1], 1.0)
        metrics = {k: v / metric_tokens if self.loss.metrics[k] == "mean" else v
                   for k, v in zip(self._sum_keys, summed[2:])}
        metrics.update(dict(zip(self._max_keys, maxed)))
        return summed[0], metrics
