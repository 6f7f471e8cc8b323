"""``--trainer.num-minibatches k``: k optimizer steps per batch, prompt groups whole, the recomputed
proximal policy computed once before the first, the same update on 1 and 2 trainer ranks as a
single-process reference from the paper formula (decoupled PPO, AReaL eq. 3):
``reference_minibatch_sgd`` in tests/trainer_reference.py; the world is tests/worlds/trainer_world.py.

The trainer's AdamW is swapped for SGD in the world (``--optimizer sgd``), as the parity tests of
tests/test_trainer.py compare gradients: Adam's first step is about lr * sign(g), so a last-bit
difference of a near-zero gradient between CPUs or rank counts would flip an element by 2 * lr,
and with two sequential steps the second gradient would inherit it. With SGD the weights after
both steps, and the second step's gradient, are compared to the reference at float tolerance.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from launch import check, run_torchrun
from test_trainer import setup  # noqa: F401 - a fixture: tiny model + batch
from trainer_reference import (
    CURRENT_VERSION,
    LR,
    TrainerWorlds,
    assert_grads_close,
    read_update,
    reference_minibatch_sgd,
)

from llamarl.models.loading import load_causal_lm


def job(*, nproc, k, budget, prox, lr=LR, chunk=0):
    """``trainer_world.py`` with k SGD minibatches of ``probe_decoupled_ppo`` on ``nproc`` ranks: its name
    and ``(nproc, flags)``. ``chunk``: ``--trainer.logprob-chunk-tokens``."""
    return f"out_{nproc}_{k}_{budget}_{prox}_{lr}_{chunk}", (nproc, [
        "--budget", str(budget), "--loss", "probe_decoupled_ppo", "--prox", prox, "--num-minibatches", str(k),
        "--optimizer", "sgd", "--lr", str(lr), "--probes", "--logprob-chunk-tokens", str(chunk)])


def run_world(worlds, **case):
    """Job ``case``'s update (its world runs on first use): rank 0's (metrics, weights, gradients) and
    every rank's probes, (minibatch, max |logp - prox|) per micro-batch."""
    name, (nproc, _) = job(**case)
    out = worlds.out(name)
    metrics, weights, grads = read_update(out)
    probes = [p for r in range(nproc) for p in json.loads(Path(f"{out}.rank{r}.json").read_text())]
    return metrics, weights, grads, probes


# Groups of make_batch, sorted: 1 (signal), 3 (all 0), 7 (signal), 9 (all 1). k = 2: {1, 3}, {7, 9};
# k = 3: {1, 3}, {7}, {9}: the last has no signal, so 2 steps. On 2 ranks (LPT by tokens) rank 0
# holds groups 1 and 7, rank 1 groups 3 and 9: it forwards nothing and runs dummy micro-batches.
# chunk 3: log-probs (with grad, and the no-grad recomputed prox) 3 tokens at a time, the LM head
# inside FSDP2's root forward (--trainer.logprob-chunk-tokens; llamarl/models/logprob_chunks.py).
CASES = [(1, 2, 4096, "recompute", 0), (2, 2, 12, "recompute", 0), (2, 3, 4096, "recompute", 0),
         (2, 2, 12, "loglinear", 0), (2, 2, 12, "recompute", 3)]
PROX_CASE = {"nproc": 1, "k": 2, "budget": 4096, "prox": "recompute", "lr": 10.0}  # the clip test's large step
# Every trainer world of this module: one world per rank count runs all its jobs (``TrainerWorlds``).
JOBS = dict([job(**dict(zip(("nproc", "k", "budget", "prox", "chunk"), case))) for case in CASES] + [job(**PROX_CASE)])


@pytest.fixture(scope="module")
def worlds(setup):  # noqa: F811 - the fixture's value
    tmp, model_dir, _ = setup
    return TrainerWorlds(tmp, model_dir, JOBS, lambda plan_file, nproc: check(run_torchrun(
        "trainer_world.py", nproc=nproc, args=["--plan", str(plan_file)], timeout_s=600)))


@pytest.mark.parametrize(("nproc", "k", "budget", "prox", "chunk"), CASES)
def test_minibatch_updates_match_the_sequential_reference_on_1_and_2_ranks(setup, worlds, nproc, k, budget, prox,  # noqa: F811
                                                                           chunk):
    _, model_dir, batch = setup
    metrics, weights, grads, _ = run_world(worlds, nproc=nproc, k=k, budget=budget, prox=prox, chunk=chunk)
    expected_weights, expected_grads, losses, tokens, steps = reference_minibatch_sgd(model_dir, batch, k, prox)
    assert steps == 2 and metrics["version"] == CURRENT_VERSION + steps
    largest = assert_grads_close(grads, expected_grads)
    assert largest > 1e-3, "the reference gradient is ~0; the test would be vacuous"
    initial, _ = load_causal_lm(str(model_dir))
    moved = max((expected_weights[n] - p.detach()).abs().max().item() for n, p in initial.named_parameters())
    assert moved > 1e-4, "the updates did not move the weights; the test would be vacuous"
    for name, weight in expected_weights.items():
        torch.testing.assert_close(weights[name], weight, rtol=1e-5, atol=1e-7, msg=name)
    assert metrics["loss"] == pytest.approx(sum(losses) / len(losses), rel=1e-4, abs=1e-6)
    assert metrics["num_loss_tokens"] == tokens  # summed over the minibatches that stepped
    assert metrics["zero_advantage_samples"] == 4
    assert metrics.get("skipped_no_signal", 0.0) == float(k - steps)
    assert metrics["prox_seconds"] > 0  # the recompute forward, or A-3PO's interpolation, was timed


def test_recomputed_prox_is_the_policy_before_the_first_minibatch(worlds):
    """k = 2, recompute: the first minibatch trains at the proximal policy's weights (ratio 1 up to
    the float noise of another packing), the second after one update, so the clip can act there
    (a large SGD step, so that some ratio leaves [1 - eps, 1 + eps])."""
    metrics, _, _, probes = run_world(worlds, **PROX_CASE)
    first = [gap for mb, gap in probes if mb == 0]
    second = [gap for mb, gap in probes if mb == 1]
    assert first and second
    assert max(first) < 1e-4
    assert max(second) > 0.2  # |log u| beyond log(1 + eps)
    assert metrics["clip_fraction"] > 0  # the mean over the two minibatches: only the second clips


def test_num_minibatches_is_validated():
    from llamarl.executors.config import TrainerConfig

    with pytest.raises(ValueError, match="--trainer.num-minibatches must be >= 1, got 0"):
        TrainerConfig(num_minibatches=0)


def test_minibatch_metrics_combine_as_documented():
    """Counts add up, maxima are maxima, ``staleness_mean`` is over every trained token, versions
    are the last, the rest average over the minibatches that stepped (a skipped one reports none)."""
    from llamarl.executors.trainer_metrics import combine_minibatch_metrics

    stepped = {"loss": 1.0, "grad_norm": 2.0, "num_loss_tokens": 30.0, "staleness_mean": 1.0, "staleness_max": 1.0,
               "version": 5.0, "zero_advantage_samples": 2.0, "clip_fraction": 0.1, "ratio_max": 1.5, "n_clipped": 3.0}
    later = {"loss": 3.0, "grad_norm": 4.0, "num_loss_tokens": 10.0, "staleness_mean": 3.0, "staleness_max": 3.0,
             "version": 6.0, "zero_advantage_samples": 1.0, "clip_fraction": 0.3, "ratio_max": 1.2, "n_clipped": 1.0}
    skipped = {"skipped_no_signal": 1.0, "zero_advantage_samples": 4.0, "version": 6.0}
    out = combine_minibatch_metrics([stepped, later, skipped],
                                    loss_metrics={"clip_fraction": "mean", "ratio_max": "max", "n_clipped": "sum"})
    assert out == {"loss": 2.0, "grad_norm": 3.0, "num_loss_tokens": 40.0, "staleness_mean": (30 + 30) / 40,
                   "staleness_max": 3.0, "version": 6.0, "zero_advantage_samples": 7.0, "skipped_no_signal": 1.0,
                   "clip_fraction": pytest.approx(0.2), "ratio_max": 1.5, "n_clipped": 4.0}
