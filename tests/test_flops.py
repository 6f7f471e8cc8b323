"""MFU counted from the work (llamarl/models/flops.py, issue 46): the FLOP formula equals
``torch.utils.flop_counter.FlopCounterMode``'s count of a real forward and backward on every tiny
model family (within 2 %; it is exact here), the shared-prompt pairs are exactly those the tree
mask lets attend, and the peaks are known only where they should be."""

import pytest
import torch
from model_families import FAMILIES, build_family
from test_shared_prefix import _batch
from torch.utils.flop_counter import FlopCounterMode

from llamarl.models.flops import ModelFlops, pairs_causal, peak_tflops, work_of
from llamarl.models.logprobs import completion_logprobs
from llamarl.models.microbatch import microbatch_inputs, plan_forwards


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_flop_count_equals_flop_counter_mode_on_every_family(family):
    """Eager attention (its Q K^T and P V are bmm's that FlopCounterMode counts; on the CPU it does
    not count SDPA's fused kernel) over every (query, key) pair of 2 rows of 300 tokens, the LM head
    on the kept positions; forward and backward, every weight trained."""
    model = build_family(family)
    model.train()
    model.config._attn_implementation = "eager"
    rows, length, start = 2, 300, 250
    ids = torch.randint(0, 1000, (rows, length), generator=torch.Generator().manual_seed(0))
    counter = FlopCounterMode(display=False)
    with counter:
        logp = completion_logprobs(model, ids, torch.ones_like(ids), start=start, temperature=0.7, chunk_tokens=0)
        logp.sum().backward()
    measured = counter.get_total_flops()
    counted = ModelFlops.from_config(model.config).training(
        tokens=rows * length, pairs=rows * length * length, predicted=rows * (length - start + 1))
    assert counted == pytest.approx(measured, rel=0.02)
    attention = sum(v for k, v in counter.get_flop_counts()["Global"].items() if "bmm" in str(k))
    assert attention > 0.05 * measured  # the attention term is there to be checked


def test_the_work_of_a_micro_batch_counts_shared_prompts_once_and_only_visible_pairs():
    """``work_of``'s pairs are the True entries of the tree mask ``shared_prefix_logprobs`` builds
    (padding excluded), its tokens each context once; per row, causal pairs."""
    model = build_family("llama-tied")
    batch = _batch()
    rows = list(range(len(batch)))
    plan = plan_forwards(batch, [rows], 1, share_prompts=True, model=model)[0]
    segments = plan.layout.segments
    real = segments >= 0
    causal = torch.ones(segments.shape[1], segments.shape[1], dtype=torch.bool).tril()
    visible = (segments.unsqueeze(1) == 0) | (segments.unsqueeze(1) == segments.unsqueeze(2))
    mask = causal & visible & real.unsqueeze(1) & real.unsqueeze(2)
    tokens, pairs, predicted = plan.work
    assert pairs == float(mask.sum())
    assert tokens == float(real.sum())
    num_tokens = batch["num_tokens"].tolist()
    per_row_tokens = sum(num_tokens)
    assert tokens < per_row_tokens  # each prompt once
    assert predicted == float(len(plan.layout.rows))
    _, _, _, start, _ = microbatch_inputs(batch, rows, device="cpu")
    assert work_of(num_tokens, start) == (float(per_row_tokens), float(sum(pairs_causal(n) for n in num_tokens)),
                                          float(sum(n - start for n in num_tokens)))


def test_peaks_are_known_by_device_name_and_none_on_a_cpu():
    assert peak_tflops("NVIDIA H100 80GB HBM3") == 989.0
    assert peak_tflops("NVIDIA H100 PCIe") == 756.0
    assert peak_tflops("NVIDIA H200") == 989.0
    assert peak_tflops(None) is None and peak_tflops("AMD EPYC 9R14") is None


def test_lora_counts_no_weight_gradients():
    flops = ModelFlops(per_token=10.0, per_pair=1.0, per_predicted=100.0)
    assert flops.training(tokens=2, pairs=3, predicted=1) == 3 * (20 + 3 + 100)
    assert flops.training(tokens=2, pairs=3, predicted=1, frozen_weights=True) == 2 * (20 + 100) + 3 * 3
