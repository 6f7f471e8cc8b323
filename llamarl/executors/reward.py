"""RewardExecutor: scores rollouts with a rule-based scorer in a process pool.

Reads the ``completion`` / ``reference`` strings of its input batch (with
``--reward.trajectory-scorer``: its ``trajectory`` / ``question`` / ``reference`` strings, see
llamarl/rewards/trajectory.py), adds ``rewards`` (float32 [N]) and passes the batch on. A scorer that raises or times out gives 0 and is counted in the
metrics (``reward_errors`` / ``reward_timeouts``); it never stops the run.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import ClassVar

import torch

from llamarl.data.prompts import Problem
from llamarl.executors.config import RewardConfig
from llamarl.rewards.funcs import RewardFuncs, combine, function_means
from llamarl.rewards.overlong import mask_truncated, overlong_penalty
from llamarl.rewards.pool import RewardPool
from llamarl.runtime.batch import TensorBatch, set_balance_tokens
from llamarl.runtime.checkpoint import read_json, write_json
from llamarl.runtime.executor import Executor
from llamarl.runtime.metrics import MetricSpec

REWARD_METRICS = {
    "reward_mean": MetricSpec("reward", "mean", weight="reward_samples"),
    "accuracy": MetricSpec("reward", "mean", weight="reward_samples"),
    "reward_samples": MetricSpec("reward", "sum"),
    "completion_len_mean": MetricSpec("rollouts", "mean", weight="reward_samples"),
    "reward_errors": MetricSpec("errors", "sum"),
    "reward_timeouts": MetricSpec("errors", "sum"),
    "reward_worker_start_failures": MetricSpec("errors", "sum"),
    "reward_seconds": MetricSpec("time", "max"),
    "overlong_penalty_mean": MetricSpec("reward", "mean", weight="reward_samples"),
    "overlong_filtered": MetricSpec("reward", "mean", weight="reward_samples"),
}
"""What ``score_rollouts`` reports, and how each is reduced over the scoring ranks (the error
counters are each rank's running totals, so their sum is the run's)."""


def build_pool(config: RewardConfig, scorer: str | None) -> RewardPool:
    """The scoring pool of ``config``: its reward functions (``--reward.funcs``) or its trajectory
    scorer when set, else its text scorer (``--reward.scorer``) when set, else the recipe's text
    ``scorer``."""
    if config.funcs is not None:
        return RewardPool(config.funcs, num_workers=config.num_workers, timeout_s=config.timeout_s, kind="funcs")
    if config.trajectory_scorer is not None:
        return RewardPool(config.trajectory_scorer, num_workers=config.num_workers, timeout_s=config.timeout_s,
                          kind="trajectory")
    scorer = config.scorer or scorer
    if scorer is None:
        raise ValueError("no scorer: the recipe has no text scorer; set --reward.scorer or --reward.trajectory-scorer")
    return RewardPool(scorer, num_workers=config.num_workers, timeout_s=config.timeout_s)


def score_rollouts(pool: RewardPool, batch: TensorBatch,
                   config: RewardConfig | None = None) -> tuple[TensorBatch, dict[str, float]]:
    """Add ``rewards`` (float32 [N], on the batch's device) to a non-empty rollout batch; return it
    and the reward metrics. With ``config``'s overlong settings, DAPO's soft overlong punishment
    is added to the rewards and truncated samples are masked out of the loss
    (llamarl/rewards/overlong.py; ``reward_mean`` is then the shaped mean, ``accuracy`` the
    scorer's)."""
    start = time.perf_counter()
    per_function: dict[str, float] = {}
    if pool.kind == "funcs":
        rewards, per_function = score_with_funcs(pool, batch, config)
    elif pool.kind == "trajectory":
        if not {"trajectory", "question"} <= set(batch.string_fields):
            raise ValueError("a trajectory scorer needs the batch's 'trajectory' and 'question' strings "
                             "(made by the generator executor); this batch has only "
                             f"{sorted(batch.string_fields)}")
        problems = [Problem(question=s["question"], answer=s["reference"], columns=s["columns"])
                    for s in funcs_samples(batch)]
        rewards = pool.score_trajectories(batch.get_strings("trajectory"), problems)
    else:
        rewards = pool.score_batch(batch.get_strings("completion"), batch.get_strings("reference"))
    batch.fields["rewards"] = torch.tensor(rewards, dtype=torch.float32, device=batch.device)
    shaping: dict[str, float] = {}
    if config is not None and config.overlong_buffer:
        if config.max_len is None:
            raise ValueError("--reward.overlong-buffer needs the completion limit (RewardConfig.max_len: the "
                             "recipe's config sets it from --generator.max-new-tokens)")
        shaped = overlong_penalty(batch["completion_len"], max_len=config.max_len, buffer=config.overlong_buffer,
                                  penalty=config.overlong_penalty).to(batch.device)
        batch.fields["rewards"] = batch["rewards"] + shaped
        shaping["overlong_penalty_mean"] = float(shaped.mean())
    if config is not None and config.overlong_filter and "finish_stop" in batch:
        ended = batch["finish_stop"].bool()
        batch.fields["loss_mask"] = mask_truncated(batch["loss_mask"], ended)
        shaping["overlong_filtered"] = float((~ended).float().mean())
    set_balance_tokens(batch)
    stats = pool.stats()
    metrics = {"reward_mean": float(sum(rewards) / len(rewards)),
               "accuracy": float(sum(r >= 1.0 for r in rewards) / len(rewards)),
               "completion_len_mean": float(batch["completion_len"].float().mean()),
               "reward_errors": float(stats["num_errors"]), "reward_timeouts": float(stats["num_timeouts"]),
               "reward_worker_start_failures": float(stats["num_worker_start_failures"]),
               "reward_seconds": time.perf_counter() - start, "reward_samples": float(len(rewards)), **shaping,
               **per_function}
    if shaping:
        metrics["reward_mean"] = float(batch["rewards"].float().mean())
    return batch, metrics


def group_chunks(group_ids: list[int], parts: int) -> list[slice]:
    """Up to ``parts`` contiguous row slices of about equal size, cut only where the group id changes."""
    n = len(group_ids)
    cuts = [0]
    for k in range(1, max(1, parts)):
        cut = max(round(k * n / parts), cuts[-1])
        while 0 < cut < n and group_ids[cut] == group_ids[cut - 1]:
            cut += 1
        if cut < n and cut > cuts[-1]:
            cuts.append(cut)
    return [slice(a, b) for a, b in zip(cuts, [*cuts[1:], n])]


def funcs_samples(batch: TensorBatch) -> list[dict]:
    """What ``--reward.funcs`` reads of each row (llamarl/rewards/funcs.py): its completion text and
    token ids, reference, question and the dataset row's other columns (the ``columns`` JSON strings,
    when the generator's problems have any)."""
    n = len(batch)
    ids, starts, lengths = batch["input_ids"].tolist(), batch["prompt_len"].tolist(), batch["completion_len"].tolist()
    questions = batch.get_strings("question") if "question" in batch.string_fields else [""] * n
    columns = [json.loads(c) for c in batch.get_strings("columns")] if "columns" in batch.string_fields else [{}] * n
    return [{"completion": c, "reference": r, "question": q, "columns": cols, "completion_ids": row[p : p + m]}
            for c, r, q, cols, row, p, m in zip(batch.get_strings("completion"), batch.get_strings("reference"),
                                                questions, columns, ids, starts, lengths)]


def score_with_funcs(pool: RewardPool, batch: TensorBatch,
                     config: RewardConfig | None) -> tuple[list[float], dict[str, float]]:
    """Each row's weighted sum of the ``--reward.funcs`` functions and each function's mean
    (``reward_fn_<name>``), the batch scored in chunks of whole groups, one per worker."""
    funcs = pool.scorer
    weights = list(config.weights) if config is not None and config.weights else [1.0] * len(funcs.names)
    chunks = group_chunks(batch["group_ids"].tolist(), pool.num_workers or 1)
    results = pool.score_funcs(funcs_samples(batch), chunks=chunks)
    values: list[list] = [[] for _ in funcs.names]
    for chunk, result in zip(chunks, results):
        rows = len(range(*chunk.indices(len(batch))))
        got = result["values"] if isinstance(result, dict) else [[0.0] * rows for _ in funcs.names]
        for column, part in zip(values, got):
            column += part
    return combine(values, weights), function_means(funcs.names, values)


class RewardExecutor(Executor):
    metric_specs: ClassVar[dict] = REWARD_METRICS
    num_threads = 1  # scoring runs in the pool's processes (or inline, pure Python)

    def __init__(self, ctx, *, config: RewardConfig, scorer: str | None, input_name: str = "rollouts",
                 output_name: str = "scored") -> None:
        super().__init__(ctx)
        self.config, self.scorer = config, scorer
        if config.funcs is not None:  # each function's mean, over the scoring ranks like reward_mean
            names = RewardFuncs(config.funcs).names
            self.metric_specs = {**REWARD_METRICS, **{f"reward_fn_{name}": MetricSpec("reward", "mean",
                                                                                      weight="reward_samples")
                                                       for name in names}}
        self.input_name, self.output_name = input_name, output_name
        self.pool: RewardPool | None = None

    def init(self) -> None:
        torch.set_num_threads(1)
        self.pool = build_pool(self.config, self.scorer)

    def step(self) -> None:
        batch = self.inputs.pop(self.input_name, TensorBatch())
        if not len(batch):
            self.metrics = {}
            return
        self.outputs[self.output_name], self.metrics = score_rollouts(self.pool, batch, self.config)

    def save_checkpoint(self, directory: Path) -> None:
        """Pending outputs (base class) and the pool's cumulative counters (errors, timeouts, ...)."""
        super().save_checkpoint(directory)
        write_json(directory / f"state_rank{self.ctx.local_rank}.json", {"counters": self.pool.stats()})

    def load_checkpoint(self, directory: Path) -> None:
        super().load_checkpoint(directory)
        self.pool.restore_stats(read_json(directory / f"state_rank{self.ctx.local_rank}.json")["counters"])

    def close(self) -> None:
        if self.pool is not None:
            self.pool.close()
