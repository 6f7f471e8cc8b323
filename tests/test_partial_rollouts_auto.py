"""``--generator.partial-rollouts auto``: on for async CUDA generators with long completions, off elsewhere."""

import pytest
import torch

from llamarl.config import GeneratorConfig
from llamarl.executors.generator import auto_token_budget

CUDA, CPU = torch.device("cuda", 0), torch.device("cpu")


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
    assert auto_token_budget(config, schedule=schedule, device=device) == budget
