"""First-fit-decreasing micro-batch packing."""

from __future__ import annotations

import pytest
import torch

from llamarl.data.packing import pack_microbatches


def check_valid(bins, counts, budget):
    flat = [i for b in bins for i in b]
    assert sorted(flat) == list(range(len(counts)))  # every index exactly once
    for b in bins:
        assert b == sorted(b)
        assert sum(counts[i] for i in b) <= budget
    assert [b[0] for b in bins] == sorted(b[0] for b in bins)


def test_ffd_finds_optimum_where_plain_first_fit_does_not():
    # Total 30 with budget 10, so 3 bins is optimal. In input order, first fit needs 4:
    # [2, 5, 1], [4, 3], [7], [8]. FFD visits 8, 7, 5, 4, 3, 2, 1 and fills
    # {8, 2}, {7, 3}, {5, 4, 1} -> indices [0, 6], [3, 5], [1, 2, 4].
    counts = [2, 5, 4, 7, 1, 3, 8]
    assert pack_microbatches(counts, max_tokens_per_microbatch=10) == [[0, 6], [1, 2, 4], [3, 5]]


def test_ffd_second_hand_example():
    # FFD: 5 -> A, 4 -> A (9), 3 -> B, 3 -> B, 2 -> B, 2 -> B (10), 1 -> A (10): 2 bins = optimal.
    counts = torch.tensor([5, 4, 3, 3, 2, 2, 1])
    assert pack_microbatches(counts, max_tokens_per_microbatch=10) == [[0, 1, 6], [2, 3, 4, 5]]


def test_ties_and_zero_sized_samples_are_deterministic():
    # Equal sizes are visited by ascending index; zero-token samples go into the first bin.
    assert pack_microbatches([3, 3, 3, 0], max_tokens_per_microbatch=6) == [[0, 1, 3], [2]]
    assert pack_microbatches([], max_tokens_per_microbatch=4) == []


def test_random_inputs_are_valid_and_deterministic():
    g = torch.Generator().manual_seed(0)
    for _ in range(200):
        n = int(torch.randint(1, 40, (1,), generator=g))
        budget = int(torch.randint(8, 64, (1,), generator=g))
        counts = torch.randint(0, budget + 1, (n,), generator=g).tolist()
        bins = pack_microbatches(counts, max_tokens_per_microbatch=budget)
        check_valid(bins, counts, budget)
        assert pack_microbatches(counts, max_tokens_per_microbatch=budget) == bins
        # First-fit invariant: a bin is only opened when its first item fits in no earlier bin,
        # and bins only grow, so no two micro-batches could have been merged.
        fills = [sum(counts[i] for i in b) for b in bins]
        for a in range(len(fills)):
            for b in range(a + 1, len(fills)):
                assert fills[a] + fills[b] > budget


def test_oversize_sample_is_rejected_with_index_and_size():
    with pytest.raises(ValueError, match=r"sample 2 has 12 tokens"):
        pack_microbatches([3, 4, 12, 1], max_tokens_per_microbatch=10)


def test_bad_arguments():
    with pytest.raises(ValueError, match="max_tokens_per_microbatch"):
        pack_microbatches([1], max_tokens_per_microbatch=0)
    with pytest.raises(ValueError, match="negative"):
        pack_microbatches([1, -1], max_tokens_per_microbatch=4)
    with pytest.raises(ValueError, match="1-D"):
        pack_microbatches(torch.ones(2, 2, dtype=torch.int64), max_tokens_per_microbatch=4)
