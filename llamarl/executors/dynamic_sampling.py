"""Dynamic sampling with refill (DAPO, Yu et al. 2025, arXiv:2503.14476, §3.2), inside the generator.

A prompt group whose samples all score alike has a GRPO advantage of exactly 0 (the trainer sets it
so): it adds no gradient, only tokens to the loss's denominator. DAPO over-samples and keeps only
groups with a spread of rewards until the batch is full. With ``--algo.max-refill N`` (N > 0) the
generator does that itself, each tick:

1. it samples its ``--generator.num-prompts-per-step`` prompts as usual (plus the carried partial
   rollouts), and scores every group that finished with the run's own scorer (``build_pool`` and
   ``score_rollouts`` of ``llamarl/executors/reward.py``: the recipe's scorer or the one of
   ``--reward.scorer`` / ``--reward.trajectory-scorer`` / ``--reward.funcs``, with the overlong
   shaping, so the decision is on the rewards the trainer's advantages will see);
2. it drops the groups whose rewards are all equal (``dynamic_sampling_dropped``);
3. while it holds fewer than ``num_prompts_per_step`` groups, and for at most N rounds, it takes as
   many new prompts as groups are missing (never more: a round cannot overshoot the batch), samples
   them to the end with the same weights, scores and filters them (``dynamic_sampling_refill_rounds``);
4. it emits the groups kept (``dynamic_sampling_kept``), exactly as without dynamic sampling; the
   reward executor scores them again as usual (rule-based scorers take milliseconds; the generator
   only decides which groups to keep), so nothing downstream changes.

Why in the generator (decision): refill needs each group's rewards before the batch is complete,
and only the generator can sample more. Scoring there works in every schedule unchanged (colocated,
sync, async lag 1 and 2: the channels carry what they always carry, one batch a tick), and keeps
the refill on the weights of the tick (strictly on-policy under sync and colocated). A reward that
the generator cannot call (an LLM judge, a reward executor of a recipe's own) is refused before any
process group (``standard_pipeline``).

Data position and resume: every prompt consumed, a dropped group's included, advances the data
position; with several data-parallel replicas each round's prompts are shared out by one
all-reduce of the replicas' missing counts (``agree``), replica d taking the run
``[position + sum of the counts before d, ...)``, so every rank runs the same rounds and the
position stays the same on every rank. Refill happens within the tick and nothing of it is pending
at a tick's end (prompts not finished under partial rollouts are carried like any other), so a
checkpoint and its resume are exact, as without it.

Short batches: after N rounds the batch may still lack groups; the trainer trains on the groups it
has. As for ``recipes/dapo_filter.py`` (a filter without refill), the loss is a mean over the
tokens of the groups kept (``--algo.loss-agg``), so a short batch does not scale the per-token
gradient down, it only averages over fewer samples; and compared with no dynamic sampling, the
zero-advantage tokens that used to dilute the denominator are gone (the loss of the tokens with
signal scales up by all tokens / kept tokens, as DAPO intends).

Partial rollouts (``--generator.token-budget``; decision): the budget applies to the tick's own
prompts, which finish over later ticks as usual, while a refill round samples its prompts to the
end, since a group that replaces a dropped one must be scored within the tick. (Counting refill
prompts still in flight as kept instead would leave the batch short every tick; refilling again
while they are in flight would consume prompts without bound.) A tick in which more carried groups
finish than ``num_prompts_per_step`` emits them all, as without dynamic sampling.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import ClassVar

import torch

from llamarl.executors.config import RewardConfig
from llamarl.rewards.pool import RewardPool
from llamarl.runtime.batch import TensorBatch
from llamarl.runtime.metrics import MetricSpec

__all__ = ["DYNAMIC_SAMPLING_METRICS", "DynamicSampling", "Group", "agree_counts", "tied_groups"]

Group = tuple[int, list, object]
"""One finished prompt group: its id (the prompt's data index), its completions in sample order, its
``Problem``."""

DYNAMIC_SAMPLING_METRICS = {
    "dynamic_sampling_kept": MetricSpec("rollouts", "sum"),
    "dynamic_sampling_dropped": MetricSpec("rollouts", "sum"),
    "dynamic_sampling_refill_rounds": MetricSpec("rollouts", "max"),
}
"""Per tick: groups emitted and groups dropped for equal rewards (summed over the data-parallel
replicas), and the refill rounds run (the same on every rank)."""


def tied_groups(batch: TensorBatch) -> set[int]:
    """The ``group_ids`` of the groups of scored ``batch`` whose rows all have the same reward."""
    group_ids, rewards = batch["group_ids"], batch["rewards"]
    return {gid for gid in group_ids.unique().tolist()
            if bool((rewards[group_ids == gid] == rewards[group_ids == gid][0]).all())}


class DynamicSampling:
    """The generator's keep-or-refill loop (module docstring). ``target``: groups a tick should emit
    per replica (``--generator.num-prompts-per-step``); ``max_refill``: N; ``reward`` and ``scorer``:
    what ``build_pool`` builds the run's scorer from; ``scores``: whether this rank scores (a TP
    group's first rank; its peers follow the agreed counts and emit nothing)."""

    metric_specs: ClassVar[dict] = DYNAMIC_SAMPLING_METRICS

    def __init__(self, *, reward: RewardConfig, scorer: str | None, target: int, max_refill: int) -> None:
        if max_refill < 1 or target < 1:
            raise ValueError(f"dynamic sampling needs max_refill >= 1 and target >= 1, got {max_refill}, {target}")
        self.reward, self.scorer, self.target, self.max_refill = reward, scorer, target, max_refill
        self.pool: RewardPool | None = None

    def init(self, *, scores: bool) -> None:
        """Start the scoring pool where this rank scores (``--reward.num-workers`` processes)."""
        if scores:
            from llamarl.executors.reward import build_pool

            self.pool = build_pool(self.reward, self.scorer)

    def close(self) -> None:
        if self.pool is not None:
            self.pool.close()
            self.pool = None

    def keep(self, groups: list[Group], *, to_batch: Callable[[list[Group]], TensorBatch]) -> tuple[list[Group], int]:
        """The groups of ``groups`` with a spread of rewards, in order, and how many were dropped.
        Scored on ``to_batch(groups)`` (the rollout batch they would be emitted as); a rank that does
        not score keeps them all (its ``fill`` follows the agreed counts)."""
        if not groups or self.pool is None:
            return groups, 0
        from llamarl.executors.reward import score_rollouts

        scored, _ = score_rollouts(self.pool, to_batch(groups), self.reward)
        tied = tied_groups(scored)
        return [g for g in groups if g[0] not in tied], len(tied)

    def fill(self, groups: list[Group], *, sample: Callable[[list[int]], list[Group]],
             to_batch: Callable[[list[Group]], TensorBatch],
             agree: Callable[[int], list[int]]) -> tuple[list[Group], dict[str, float]]:
        """Keep ``groups``' with signal, then refill: at most ``max_refill`` rounds, each with every
        replica's missing count agreed (``agree(missing)``: the list over replicas, the same on every
        rank) and ``sample(counts)`` giving this replica's newly finished groups. Returns the groups
        to emit and the tick's metrics."""
        kept, dropped = self.keep(groups, to_batch=to_batch)
        rounds = 0
        while rounds < self.max_refill:
            counts = agree(max(self.target - len(kept), 0))
            if not any(counts):
                break
            rounds += 1
            more, more_dropped = self.keep(sample(counts), to_batch=to_batch)
            kept += more
            dropped += more_dropped
        return kept, {"dynamic_sampling_kept": float(len(kept)), "dynamic_sampling_dropped": float(dropped),
                      "dynamic_sampling_refill_rounds": float(rounds)}


def agree_counts(missing: int, *, ctx) -> list[int]:
    """Every data-parallel replica's ``missing`` (a TP group's first rank's), one all-reduce over the
    generator's ranks (``ctx.group``); alone (no process group, one rank), ``[missing]``."""
    import torch.distributed as dist

    if not dist.is_initialized() or ctx.dp_size * ctx.tp_size == 1:
        return [missing]
    group = ctx.group
    backend = str(dist.get_backend(group))
    device = torch.device("cpu") if "gloo" in backend else ctx.device
    counts = torch.zeros(ctx.dp_size, dtype=torch.int64, device=device)
    if ctx.tp_rank == 0:
        counts[ctx.dp_rank] = missing
    dist.all_reduce(counts, group=group)
    return [int(c) for c in counts.tolist()]
