"""Channels in a real 4-rank gloo world (tests/worlds/channels_world.py): a = ranks 0-1, b = 2-3."""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from launch import check, run_torchrun
from worlds.channels_world import make_batch

from llamarl.channels.base import balanced_group_partition
from llamarl.runtime.batch import TensorBatch


@pytest.fixture(scope="module")
def received(tmp_path_factory):
    out = tmp_path_factory.mktemp("channels")
    check(run_torchrun("channels_world.py", nproc=4, args=["--out", str(out)]))

    def load(case: str, rank: int) -> TensorBatch:
        header = torch.tensor(list((out / f"{case}_rank{rank}.header").read_bytes()), dtype=torch.uint8)
        data = torch.tensor(list((out / f"{case}_rank{rank}.data").read_bytes()), dtype=torch.uint8)
        return TensorBatch.decode(header, data)
    return load


def assert_same(actual: TensorBatch, expected: TensorBatch) -> None:
    assert sorted(actual.fields) == sorted(expected.fields)
    for name in expected.fields:
        assert actual[name].dtype == expected[name].dtype, name
        assert torch.equal(actual[name], expected[name]), name
    assert actual.get_strings("text") == expected.get_strings("text")


def test_broadcast_reaches_every_inbound_rank_whole_with_an_empty_sender(received):
    expected = TensorBatch.concat([make_batch(0, "broadcast"), make_batch(1, "broadcast")])
    assert len(expected) == 6
    for rank in (2, 3):
        assert_same(received("broadcast", rank), expected)


def test_gather_concatenates_on_the_first_inbound_rank_only(received):
    expected = TensorBatch.concat([make_batch(0, "gather"), make_batch(1, "gather")])
    got = received("gather", 2)
    assert len(got) == 10
    assert_same(got, expected)  # ragged 'tokens' widths (3 and 4) padded on concat
    assert received("gather", 3).fields == {}


def test_scatter_keeps_groups_whole_and_balances_tokens(received):
    full = TensorBatch.concat([make_batch(0, "scatter"), make_batch(1, "scatter")])
    parts = [received("scatter", 2), received("scatter", 3)]
    assert sum(len(p) for p in parts) == len(full)
    seen_groups = [set(p["group_ids"].tolist()) for p in parts]
    assert not seen_groups[0] & seen_groups[1], "a group was split across ranks"
    for part in parts:
        for gid in set(part["group_ids"].tolist()):
            assert (part["group_ids"] == gid).sum() == (full["group_ids"] == gid).sum()
    loads = [int(p["num_tokens"].sum()) for p in parts]
    assert sum(loads) == int(full["num_tokens"].sum())
    # Group token sums are 3, 7, 11 (rank 0) and 4, 12 (rank 1): the best split is 18 / 19.
    assert sorted(loads) == [18, 19]
    # Every received row is a real row of the full batch (identity via the unique token values).
    full_rows = {tuple(r) for r in full["tokens"].tolist()}
    assert all(tuple(r) in full_rows for p in parts for r in p["tokens"].tolist())


def test_balanced_group_partition_hand_example():
    batch = TensorBatch({"group_ids": torch.tensor([0, 0, 1, 1, 2, 2, 3, 3]),
                         "num_tokens": torch.tensor([5, 5, 1, 1, 3, 3, 4, 4])})
    parts = balanced_group_partition(batch, 2)
    assert parts == [[0, 1, 2, 3], [4, 5, 6, 7]]  # loads 12 / 14: groups never split
    assert balanced_group_partition(batch, 5)[4] == []
    with pytest.raises(ValueError):
        balanced_group_partition(batch, 0)


def test_balance_tokens_override_num_tokens_for_balancing_only():
    # Groups 0 and 1 carry no training signal (balance 0): the two groups that do are split apart.
    batch = TensorBatch({"group_ids": torch.tensor([0, 0, 1, 1, 2, 2, 3, 3]),
                         "num_tokens": torch.tensor([9, 9, 9, 9, 3, 3, 3, 3]),
                         "balance_tokens": torch.tensor([0, 0, 0, 0, 3, 3, 3, 3])})
    parts = balanced_group_partition(batch, 2)
    assert parts == [[0, 1, 2, 3, 4, 5], [6, 7]]
    loads = [sum(int(batch["balance_tokens"][r]) for r in part) for part in parts]
    assert loads == [6, 6]
