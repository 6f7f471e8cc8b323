"""What a run's configuration implies, resolved once and passed to whoever needs it.

Three values follow from several flags at once: the pipeline's lag in trainer versions (the
schedule, ``--run.async-lag``, ``--trainer.num-minibatches``), the longest sample (the trainer's
micro-batch and the model's context) and the partial-rollout budget (``--generator.token-budget``,
or ``--generator.partial-rollouts auto`` on the device kind the world will use). ``plan_run``
computes them before any process group exists; ``validate_config`` checks the configuration
against the plan and the RL pipeline hands the same plan to the generator, so no executor
re-derives them (and none can disagree with the checks).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from llamarl.executors.config import GeneratorConfig
from llamarl.rl.config import RLConfig
from llamarl.runtime.world import device_type

AUTO_PARTIAL_MIN_NEW_TOKENS = 256
"""``--generator.partial-rollouts auto`` applies from this ``max_new_tokens`` on (long-tail lengths)."""


@dataclass(frozen=True)
class RunPlan:
    """The derived values of one run (see the module docstring)."""

    expected_lag: int
    """Trainer versions between the weights a sample is generated with and the last optimizer step
    that trains it (``expected_lag``)."""
    max_sequence_tokens: int
    """Longest prompt + completion a sample may have: ``--trainer.max-tokens-per-microbatch``, or
    the model's context when shorter."""
    token_budget: int | None
    """New tokens per generator step and sample (partial rollouts), None for whole completions
    (``auto_token_budget``)."""


def model_context_length(name: str) -> int | None:
    """``max_position_embeddings`` of a local HF directory's ``config.json`` (None when unknown:
    an alias not yet converted, or a hub id)."""
    config = Path(name).expanduser() / "config.json"
    if not config.is_file():
        return None
    try:
        value = json.loads(config.read_text()).get("max_position_embeddings")
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"--model.name {name}: cannot read {config}: {exc}") from None
    return int(value) if isinstance(value, int) else None


def expected_lag(config: RLConfig) -> int:
    """Trainer versions between the weights a sample is generated with and the last optimizer step
    that trains it: the schedule's lag in ticks L (async: ``--run.async-lag``; sync and colocated: 0)
    times the k = ``--trainer.num-minibatches`` steps per tick, plus the k - 1 steps before the
    batch's last minibatch. ``--algo.stale-policy wait`` plans with it."""
    lag = config.run.async_lag if config.run.schedule == "async" else 0
    k = config.trainer.num_minibatches
    return lag * k + k - 1


def auto_token_budget(config: GeneratorConfig, *, schedule: str, device_kind: str) -> int | None:
    """The partial-rollout budget a generator runs with: ``config.token_budget`` when set; else, with
    ``partial_rollouts == "auto"``, ``max_new_tokens // 2`` for an ``async`` schedule on ``cuda``
    with ``max_new_tokens >= AUTO_PARTIAL_MIN_NEW_TOKENS``; else None (whole completions)."""
    if config.token_budget is not None:
        return config.token_budget
    if (config.partial_rollouts == "auto" and schedule == "async" and device_kind == "cuda"
            and config.max_new_tokens >= AUTO_PARTIAL_MIN_NEW_TOKENS):
        return config.max_new_tokens // 2
    return None


def plan_run(config: RLConfig, *, device_kind: str | None = None) -> RunPlan:
    """The run's ``RunPlan`` (``device_kind``: ``cuda`` or ``cpu``; default the kind the world will
    use, ``world.device_type()``)."""
    micro = config.trainer.max_tokens_per_microbatch
    context = model_context_length(config.model.name)
    return RunPlan(expected_lag=expected_lag(config), max_sequence_tokens=min(micro, context or micro),
                   token_budget=auto_token_budget(config.generator, schedule=config.run.schedule,
                                                  device_kind=device_kind or device_type()))
