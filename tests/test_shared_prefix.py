"""Shared-prompt forwards: each distinct context once, the same log-probs and gradients as per-row
forwards; the planner keeps a context's rows together under a packed-token budget."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch
from conftest import rows_batch
from tiny_model import build_tiny_llama

from llamarl.models.logprobs import completion_logprobs
from llamarl.models.microbatch import microbatch_inputs, plan_microbatches
from llamarl.models.shared_prefix import context_groups, shared_prefix_logprobs, supports
from llamarl.runtime.batch import TensorBatch

TEMPERATURE = 0.7


def _batch(seed: int = 0) -> TensorBatch:
    """Three prompts (lengths 7, 4, 7 — two of them equal in length but not in tokens), 2-3 samples
    each, completions of 1-8 tokens; one row has a hole in its loss mask (a masked stale token)."""
    gen = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, 128, (n,), generator=gen).tolist() for n in (7, 4, 7)]
    rows = [(p, torch.randint(3, 128, (int(torch.randint(1, 9, (1,), generator=gen)),), generator=gen).tolist())
            for p in (prompts[0], prompts[1], prompts[0], prompts[2], prompts[1], prompts[0], prompts[2])]
    batch = rows_batch(rows, width=max(len(p) + len(c) for p, c in rows) + 2)
    batch["loss_mask"][5, len(rows[5][0]) + 1:len(rows[5][0]) + 2] = 0  # a hole after the first loss token
    return batch


def _per_row_and_shared(model, batch):
    ids, attention, mask, start, _ = microbatch_inputs(batch, list(range(len(batch))), device="cpu")
    per_row = completion_logprobs(model, ids, attention, start=start, temperature=TEMPERATURE) * mask
    shared = shared_prefix_logprobs(model, ids, attention, mask, temperature=TEMPERATURE) * mask
    return per_row, shared


def test_groups_are_the_rows_with_equal_context():
    batch = _batch()
    groups, context_lengths = context_groups(batch["input_ids"], batch["num_tokens"].tolist(), batch["loss_mask"])
    assert groups == [[0, 2, 5], [1, 4], [3, 6]]
    assert context_lengths == [7, 4, 7, 7, 4, 7, 7]


def test_log_probs_and_gradients_equal_per_row_forwards():
    model = build_tiny_llama(seed=0)
    assert supports(model)
    per_row, shared = _per_row_and_shared(model, _batch())
    assert per_row.abs().sum() > 1.0
    torch.testing.assert_close(shared, per_row, rtol=1e-5, atol=1e-5)
    weights = torch.linspace(-1.0, 1.0, per_row.numel()).reshape(per_row.shape)
    grads = []
    for logp in (per_row, shared):
        model.zero_grad()
        (logp * weights).sum().backward(retain_graph=True)
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
    largest = max(g.abs().max().item() for g in grads[0].values())
    assert largest > 1e-3
    for name in grads[0]:
        torch.testing.assert_close(grads[1][name], grads[0][name], rtol=1e-4, atol=1e-5 * largest, msg=name)


def test_a_completion_never_sees_another_samples_tokens():
    """Changing one sample's completion changes no other row's log-probs (the tree mask holds)."""
    model = build_tiny_llama(seed=0)
    batch = _batch()
    ids, attention, mask, _, _ = microbatch_inputs(batch, list(range(len(batch))), device="cpu")
    before = shared_prefix_logprobs(model, ids, attention, mask, temperature=TEMPERATURE)
    changed = ids.clone()
    changed[0, 7:int(batch["num_tokens"][0])] = 5
    after = shared_prefix_logprobs(model, changed, attention, mask, temperature=TEMPERATURE)
    assert not torch.equal(after[0], before[0])
    torch.testing.assert_close(after[1:], before[1:], rtol=0, atol=0)


def test_the_dummy_microbatch_runs():
    model = build_tiny_llama(seed=0)
    ids, attention, mask, _, _ = microbatch_inputs(TensorBatch({}), None, device="cpu")
    out = shared_prefix_logprobs(model, ids, attention, mask, temperature=TEMPERATURE)
    assert out.shape == ids.shape and torch.isfinite(out).all()


@pytest.mark.parametrize("budget", [64, 24, 16])
def test_planner_keeps_groups_whole_and_counts_packed_tokens(budget):
    batch = _batch()
    lengths = batch["num_tokens"].tolist()
    microbatches, count = plan_microbatches(batch, max_tokens_per_microbatch=budget, group=None, share_prompts=True)
    assert count == len(microbatches)
    assert sorted(r for mb in microbatches for r in mb) == list(range(len(batch)))
    groups, context_lengths = context_groups(batch["input_ids"], lengths, batch["loss_mask"])
    for mb in microbatches:
        packed = 0
        for rows in groups:
            inside = [r for r in rows if r in mb]
            if inside:
                packed += context_lengths[inside[0]] + sum(lengths[r] - context_lengths[r] for r in inside)
        assert packed <= budget
    if budget == 64:  # everything fits: one micro-batch, where per-row packing needs more
        assert len(microbatches) == 1
        assert len(plan_microbatches(batch, max_tokens_per_microbatch=budget, group=None)[0]) > 1
    for rows in groups:
        cost = context_lengths[rows[0]] + sum(lengths[r] - context_lengths[r] for r in rows)
        holding = sum(1 for mb in microbatches if any(r in mb for r in rows))
        assert holding == 1 if cost <= budget else holding > 1, (rows, cost, budget)
    if budget == 16:
        assert any(context_lengths[rows[0]] + sum(lengths[r] - context_lengths[r] for r in rows) > budget
                   for rows in groups), "want a group split by the budget"


def test_eager_attention_falls_back_to_per_row_forwards():
    from llamarl.models.microbatch import microbatch_logprobs

    model = build_tiny_llama(seed=0)
    model.config._attn_implementation = "eager"
    assert not supports(model)
    batch = _batch()
    ids, attention, mask, start, _ = microbatch_inputs(batch, list(range(len(batch))), device="cpu")
    got = microbatch_logprobs(model, ids, attention, mask, start=start, temperature=TEMPERATURE, share_prompts=True)
    expected = completion_logprobs(model, ids, attention, start=start, temperature=TEMPERATURE)
    torch.testing.assert_close(got, expected, rtol=0, atol=0)


def test_fixed_microbatches_take_consecutive_rows_and_ignore_the_budget():
    batch = _batch()
    microbatches, count = plan_microbatches(batch, max_tokens_per_microbatch=16, group=None, microbatch_rows=3,
                                            share_prompts=True)
    assert microbatches == [[0, 1, 2], [3, 4, 5], [6]] and count == 3


def test_a_row_over_the_budget_is_named():
    with pytest.raises(ValueError, match="sample 3 has 15 tokens, more than max_tokens_per_microbatch=14"):
        plan_microbatches(_batch(), max_tokens_per_microbatch=14, group=None, share_prompts=True)
