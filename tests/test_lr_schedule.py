"""The learning-rate schedule (llamarl/algorithms/lr_schedule.py) step by step against hand values,
its flags, and the trainer setting it from its version (a resumed run: tests/test_resume_semantics.py)."""

import math

import pytest
import torch

from llamarl.algorithms.lr_schedule import lr_at
from llamarl.executors.config import TrainerConfig
from llamarl.executors.trainer import TrainerExecutor
from llamarl.rl.config import RLConfig
from llamarl.run.config import RunConfig


def test_warmup_then_linear_and_cosine_step_by_step():
    # lr 1, warm-up 2, horizon 6: 1/2, 2/2, then p = (s - 2) / 4 for s = 2..5, 0 from step 6 on.
    linear = [lr_at(s, lr=1.0, schedule="linear", warmup_steps=2, decay_steps=6) for s in range(8)]
    assert linear == pytest.approx([0.5, 1.0, 1.0, 0.75, 0.5, 0.25, 0.0, 0.0])
    cosine = [lr_at(s, lr=2.0, schedule="cosine", warmup_steps=2, decay_steps=6) for s in range(8)]
    half = 0.5 * (1 + math.cos(math.pi / 4))  # p = 1/4
    assert cosine == pytest.approx([1.0, 2.0, 2.0, 2 * half, 1.0, 2 * (1 - half), 0.0, 0.0])
    constant = [lr_at(s, lr=3.0, schedule="constant", warmup_steps=3) for s in range(5)]
    assert constant == pytest.approx([1.0, 2.0, 3.0, 3.0, 3.0])
    assert lr_at(0, lr=1.0, schedule="linear", decay_steps=4) == 1.0  # no warm-up: the first step at lr


def test_the_trainer_sets_the_rate_of_its_version():
    """What a resumed trainer does: its version (restored from the checkpoint) alone gives the rate."""
    trainer = TrainerExecutor.__new__(TrainerExecutor)
    trainer.config = TrainerConfig(lr=0.1, lr_schedule="cosine", warmup_steps=1, lr_decay_steps=3)
    trainer.optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], lr=0.1)
    got = []
    for version in (2, 0, 1):
        trainer.version = version
        got.append(trainer.set_lr())
        assert trainer.optimizer.param_groups[0]["lr"] == got[-1]
    assert got == pytest.approx([0.05, 0.1, 0.1])  # step 2: p = 1/2, cos(pi/2) = 0


def test_the_decay_horizon_defaults_to_every_tick_and_bad_flags_are_one_line():
    config = RLConfig(run=RunConfig(max_steps=7), trainer=TrainerConfig(num_minibatches=2, lr_schedule="linear"))
    assert config.trainer.lr_decay_steps is None  # a preset's default must not fix it for other --run.max-steps
    config.run.max_steps = 9  # a flag given after the preset
    config.trainer.settle_schedule(max_steps=config.run.max_steps)  # run_pipeline, once the flags are parsed
    assert config.trainer.lr_decay_steps == 18
    with pytest.raises(ValueError, match="--trainer.warmup-steps must be >= 0"):
        TrainerConfig(warmup_steps=-1)
    with pytest.raises(ValueError, match="--trainer.lr-decay-steps 2 must exceed --trainer.warmup-steps 2"):
        TrainerConfig(warmup_steps=2, lr_decay_steps=2)
