"""``--generator.partial-rollouts auto``: on for async CUDA generators with long completions, off elsewhere."""

import pytest

from llamarl.executors.config import GeneratorConfig, TrainerConfig
from llamarl.models.config import ModelConfig
from llamarl.rl.config import RLConfig
from llamarl.rl.run_plan import auto_token_budget, plan_run
from llamarl.run.config import RunConfig

CUDA, CPU = "cuda", "cpu"


@pytest.mark.parametrize(("config", "schedule", "device", "budget"), [
    (GeneratorConfig(max_new_tokens=512), "async", CUDA, 256),  # long tail on a GPU: on, half the length
    (GeneratorConfig(max_new_tokens=256), "async", CUDA, 128),
    (GeneratorConfig(max_new_tokens=255), "async", CUDA, None),  # short answers: whole completions
    (GeneratorConfig(max_new_tokens=512), "async", CPU, None),  # CPU decode is not batch-efficient
    (GeneratorConfig(max_new_tokens=512), "sync", CUDA, None),  # nothing overlaps the tail
    (GeneratorConfig(max_new_tokens=512), "colocated", CUDA, None),
    (GeneratorConfig(max_new_tokens=512, partial_rollouts="off"), "async", CUDA, None),
    (GeneratorConfig(max_new_tokens=512, token_budget=64), "async", CUDA, 64),  # explicit budget wins
    (GeneratorConfig(max_new_tokens=12, token_budget=6), "sync", CPU, 6),
])
def test_auto_budget(config, schedule, device, budget):
    assert auto_token_budget(config, schedule=schedule, device_kind=device) == budget


def test_plan_run_resolves_the_lag_the_longest_sample_and_the_budget(model_dir):
    """The values the generator runs with, resolved once from several flags (llamarl/rl/run_plan.py)."""
    config = RLConfig(model=ModelConfig(name=str(model_dir)), generator=GeneratorConfig(max_new_tokens=300),
                      trainer=TrainerConfig(max_tokens_per_microbatch=4096, num_minibatches=2),
                      run=RunConfig(schedule="async", async_lag=2))
    plan = plan_run(config, device_kind="cuda")
    # lag 2 ticks x 2 minibatches + the step before the batch's last minibatch; the tiny model's
    # context (256 positions) is below the micro-batch; async on CUDA with >= 256 new tokens: half.
    assert (plan.expected_lag, plan.max_sequence_tokens, plan.token_budget) == (5, 256, 150)
    config.trainer.max_tokens_per_microbatch, config.run.schedule = 200, "sync"
    plan = plan_run(config, device_kind="cuda")
    assert (plan.expected_lag, plan.max_sequence_tokens, plan.token_budget) == (1, 200, None)
    assert plan_run(config).token_budget is None  # this machine's kind (no CUDA here, or sync anyway)
