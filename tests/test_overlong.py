"""DAPO's soft overlong punishment and overlong filtering (llamarl/rewards/overlong.py) against the
paper's eq. 13 by hand, and through the reward executor's scoring (llamarl/executors/reward.py)."""

import pytest
import torch

from llamarl.executors.config import RewardConfig
from llamarl.executors.reward import score_rollouts
from llamarl.rewards.overlong import mask_truncated, overlong_penalty
from llamarl.rewards.pool import RewardPool
from llamarl.runtime.batch import TensorBatch


def test_the_punishment_is_dapos_eq_13():
    # L_max 20, L_cache 8: free up to 12, then (12 - |y|) / 8, -1 past 20.
    lengths = torch.tensor([5, 12, 13, 16, 20, 21])
    got = overlong_penalty(lengths, max_len=20, buffer=8, penalty=0.5)
    assert torch.allclose(got, 0.5 * torch.tensor([0.0, 0.0, -1 / 8, -4 / 8, -1.0, -1.0]))
    with pytest.raises(ValueError, match="overlong buffer"):
        overlong_penalty(lengths, max_len=20, buffer=21)


def test_scoring_shapes_rewards_and_masks_truncated_samples():
    batch = TensorBatch({"group_ids": torch.tensor([0, 0]), "num_tokens": torch.tensor([10, 30]),
                         "completion_len": torch.tensor([4, 20]), "finish_stop": torch.tensor([True, False]),
                         "loss_mask": torch.ones(2, 30, dtype=torch.uint8)})
    batch.set_strings("completion", ["7", "7"])
    batch.set_strings("reference", ["7", "7"])
    pool = RewardPool("llamarl.rewards.arithmetic:score", num_workers=0)
    config = RewardConfig(num_workers=0, overlong_buffer=8, overlong_filter=True)
    config.max_len = 20
    scored, metrics = score_rollouts(pool, batch, config)
    assert scored["rewards"].tolist() == [1.0, 0.0]  # 1 - (12 - 20) / 8 = 0 for the long one
    assert scored["loss_mask"][0].all() and not scored["loss_mask"][1].any()
    assert metrics["accuracy"] == 1.0 and metrics["reward_mean"] == 0.5
    assert metrics["overlong_penalty_mean"] == -0.5 and metrics["overlong_filtered"] == 0.5
    assert mask_truncated(torch.ones(1, 3), torch.tensor([True])).all()
