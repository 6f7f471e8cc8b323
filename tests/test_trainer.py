"""FSDP2 trainer parity: 1 and 2 gloo ranks, with and without micro-batch packing, give the same
update as a single-process reference written from the paper formulas on the whole batch
(``tests/trainer_reference.py``; the world is ``tests/worlds/trainer_world.py``).

Compared on the clipped gradients, not through the weights after one AdamW step: Adam's first step
is about lr * sign(g), so a last-bit difference in a near-zero gradient (the summation order differs
between CPUs, rank counts and micro-batch splits) flips an element by 2 * lr. The optimizer step is
checked separately and exactly: AdamW applied to the trainer's own gradients must give its weights.
"""

import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).parent))
from launch import check, run_torchrun
from tiny_model import save_tiny_model
from trainer_reference import (
    CURRENT_VERSION,
    TrainerWorlds,
    adamw_step,
    assert_grads_close,
    make_batch,
    read_update,
    reference_gradients,
)

from llamarl.models.loading import load_causal_lm


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """A tiny model and ``make_batch``'s batch (in ``batch.safetensors``): ``(tmp, model_dir, batch)``."""
    tmp = tmp_path_factory.mktemp("trainer")
    model_dir = save_tiny_model(tmp / "model")
    model, _ = load_causal_lm(str(model_dir))
    batch = make_batch(model)
    save_file(batch, str(tmp / "batch.safetensors"))
    return tmp, model_dir, batch


# Every trainer world of this module, {name: (nproc, flags)}: one world per rank count runs them all
# (``TrainerWorlds``), each job a fresh trainer on the same batch.
FSDP_CASES = [(1, 4096), (2, 4096), (2, 12), (1, "rows3")]
ENTROPY_COEF = 0.5
LOSS_CASES = [(1, 4096), (2, 12)]
JOBS = {
    **{f"out_{nproc}_{budget}_{loss}": (nproc, ["--budget", str(budget), "--loss", loss])
       for nproc, budget in FSDP_CASES for loss in ("aipo", "decoupled_ppo")},
    **{f"x2_{nproc}_{budget}": (nproc, ["--budget", str(budget), "--loss", "aipo_x2"]) for nproc, budget in LOSS_CASES},
    "compiled_1": (1, ["--budget", "4096", "--loss", "aipo", "--compile"]),
    **{f"stale_{nproc}": (nproc, ["--budget", "4096", "--loss", "aipo", "--max-staleness", "1"]) for nproc in (1, 2)},
    **{f"norm_{nproc}_{budget}": (nproc, ["--budget", str(budget), "--loss", "aipo", "--max-staleness", "none",
                                          "--normalize-batch"]) for nproc, budget in LOSS_CASES},
    **{f"agg_{nproc}_{budget}_{agg}": (nproc, ["--budget", str(budget), "--loss", "decoupled_ppo", "--loss-agg", agg])
       for nproc, budget in LOSS_CASES for agg in ("seq-mean-token-mean", "seq-mean-token-sum-norm")},
    **{f"ent_{nproc}_{budget}_{agg}": (nproc, ["--budget", str(budget), "--loss", "aipo", "--loss-agg", agg,
                                               "--entropy-coef", str(ENTROPY_COEF)])
       for nproc, budget in LOSS_CASES for agg in ("token-mean", "seq-mean-token-mean")},
}


@pytest.fixture(scope="module")
def worlds(setup):
    tmp, model_dir, _ = setup
    return TrainerWorlds(tmp, model_dir, JOBS, lambda plan_file, nproc: check(run_torchrun(
        "trainer_world.py", nproc=nproc, args=["--plan", str(plan_file)], timeout_s=600)))


def run_world(worlds, name):
    """Job ``name``'s update (its world runs on first use): rank 0's (metrics, weights, gradients)."""
    return read_update(worlds.out(name))


@pytest.mark.parametrize("loss_name", ["aipo", "decoupled_ppo"])
@pytest.mark.parametrize(("nproc", "budget"), FSDP_CASES)
def test_fsdp_update_matches_single_process_reference(setup, worlds, nproc, budget, loss_name):
    _, model_dir, batch = setup
    metrics, got_weights, got_grads = run_world(worlds, f"out_{nproc}_{budget}_{loss_name}")
    expected_grads, expected_loss = reference_gradients(model_dir, batch, loss_name)
    assert sorted(got_grads) == sorted(expected_grads) == sorted(got_weights)
    largest = assert_grads_close(got_grads, expected_grads)
    assert largest > 1e-3, "the reference gradient is ~0; the test would be vacuous"
    # The optimizer step is elementwise, so from the same gradients it is the same on any CPU.
    initial, _ = load_causal_lm(str(model_dir))
    stepped = adamw_step(model_dir, got_grads)
    moved = max((stepped[n] - p).abs().max().item() for n, p in initial.named_parameters())
    assert moved > 1e-3, "the update did not move the weights; the test would be vacuous"
    for name, weight in stepped.items():
        torch.testing.assert_close(got_weights[name], weight, rtol=1e-6, atol=1e-7, msg=name)
    assert metrics["loss"] == pytest.approx(expected_loss, rel=1e-4, abs=1e-6)
    assert metrics["num_loss_tokens"] == float(batch["loss_mask"].sum())
    assert metrics["staleness_max"] == 2.0
    assert metrics["zero_advantage_samples"] == 4  # groups 3 (all 0) and 9 (all 1): skipped, same update


def test_compiled_layers_train_as_eager(setup, worlds):
    """``--trainer.compile layers`` (aot_eager): the FSDP2 trainer's gradients, update and loss those
    of the eager trainer on the same batch, the compile's seconds reported once."""
    _, model_dir, _ = setup
    compiled, compiled_weights, compiled_grads = run_world(worlds, "compiled_1")
    eager, _, eager_grads = run_world(worlds, "out_1_4096_aipo")
    assert sorted(compiled_grads) == sorted(eager_grads)
    for name, grad in eager_grads.items():
        torch.testing.assert_close(compiled_grads[name], grad, rtol=1e-4, atol=1e-6, msg=name)
    # The update is AdamW's of those gradients (elementwise, so the same on any CPU; near-zero
    # gradients' AdamW steps amplify summation-order differences, so not compared with eager's).
    for name, weight in adamw_step(model_dir, compiled_grads).items():
        torch.testing.assert_close(compiled_weights[name], weight, rtol=1e-6, atol=1e-7, msg=name)
    assert compiled["loss"] == pytest.approx(eager["loss"], rel=1e-5, abs=1e-7)
    assert compiled["compile_seconds"] > 0 and "compile_seconds" not in eager


@pytest.mark.parametrize("loss_agg", ["seq-mean-token-mean", "seq-mean-token-sum-norm"])
@pytest.mark.parametrize(("nproc", "budget"), LOSS_CASES)
def test_loss_aggregations_match_their_formula_on_any_split_and_rank_count(setup, worlds, nproc, budget, loss_agg):
    """``--algo.loss-agg``: one rank with one micro-batch and two ranks with micro-batches of 12
    tokens give the gradient of the formula over the whole batch (llamarl/algorithms/aggregation.py)."""
    _, model_dir, batch = setup
    metrics, _, got_grads = run_world(worlds, f"agg_{nproc}_{budget}_{loss_agg}")
    expected_grads, expected_loss = reference_gradients(model_dir, batch, "decoupled_ppo", loss_agg=loss_agg)
    token_mean_grads, token_mean_loss = reference_gradients(model_dir, batch, "decoupled_ppo")
    assert expected_loss != pytest.approx(token_mean_loss, rel=1e-3)  # not token-mean's by another name
    if loss_agg == "seq-mean-token-mean":  # (sum-norm is token-mean times a constant: clipping makes them equal)
        assert any(not torch.allclose(expected_grads[n], token_mean_grads[n], rtol=1e-3) for n in expected_grads)
    assert assert_grads_close(got_grads, expected_grads) > 1e-3
    assert metrics["loss"] == pytest.approx(expected_loss, rel=1e-4, abs=1e-6)


@pytest.mark.parametrize("loss_agg", ["token-mean", "seq-mean-token-mean"])
@pytest.mark.parametrize(("nproc", "budget"), LOSS_CASES)
def test_entropy_bonus_matches_its_formula_on_any_split_and_rank_count(setup, worlds, nproc, budget, loss_agg):
    """``--algo.entropy-coef`` c: the gradient of ``loss - c * agg(H)`` over the whole batch, H the
    entropy of every loss token (the zero-advantage groups' too: they are forwarded), aggregated as
    ``--algo.loss-agg``; on one rank with one micro-batch and on two with micro-batches of 12 tokens."""
    _, model_dir, batch = setup
    metrics, _, got_grads = run_world(worlds, f"ent_{nproc}_{budget}_{loss_agg}")
    expected_grads, expected_loss = reference_gradients(model_dir, batch, "aipo", loss_agg=loss_agg,
                                                        entropy_coef=ENTROPY_COEF)
    plain_grads, plain_loss = reference_gradients(model_dir, batch, "aipo", loss_agg=loss_agg)
    assert expected_loss < plain_loss - 0.1  # the bonus is there, and large enough to matter
    assert any(not torch.allclose(expected_grads[n], plain_grads[n], rtol=1e-2) for n in expected_grads)
    assert assert_grads_close(got_grads, expected_grads) > 1e-3
    assert metrics["loss"] == pytest.approx(expected_loss, rel=1e-4, abs=1e-6)
    assert metrics["zero_advantage_samples"] == 4  # counted as before, but forwarded for their entropy


@pytest.mark.parametrize(("nproc", "budget"), LOSS_CASES)
def test_a_loss_registered_by_user_code_is_used_with_its_declared_reductions(setup, worlds, nproc, budget):
    """``aipo_x2`` (registered in the world script) doubles AIPO's loss; its ``rows`` metric is a
    sum over micro-batches and ranks: the 4 samples with signal, however they are split."""
    _, model_dir, batch = setup
    metrics, _, _ = run_world(worlds, f"x2_{nproc}_{budget}")
    _, expected_loss = reference_gradients(model_dir, batch, "aipo")
    assert metrics["loss"] == pytest.approx(2 * expected_loss, rel=1e-4, abs=1e-6)
    assert metrics["rows"] == 4 and "importance_weight_max" not in metrics


def test_unknown_names_list_the_registered_ones():
    from llamarl.algorithms.config import AlgoConfig
    from llamarl.algorithms.registered import get_advantage, get_policy_loss, register_policy_loss

    with pytest.raises(ValueError, match=r"unknown policy loss 'nope'; registered: aipo, cispo, dapo, "
                                         r"decoupled_ppo, gspo, gspo_token, ppo"):
        get_policy_loss("nope")
    with pytest.raises(ValueError, match=r"unknown advantage estimator 'nope'; registered: dr_grpo, grpo, mean, rloo$"):
        get_advantage("nope")
    with pytest.raises(ValueError, match="--algo.loss 'nope' is not registered; known:"):
        AlgoConfig(loss="nope")
    with pytest.raises(ValueError, match="already registered"):
        register_policy_loss("aipo", metrics={})(lambda **kw: None)
    with pytest.raises(ValueError, match="reductions must be one of"):
        register_policy_loss("other", metrics={"x": "median"})


@pytest.mark.parametrize("nproc", [1, 2])
def test_max_staleness_drops_rows_counts_them_and_reports_staleness_over_kept_tokens(setup, worlds, nproc):
    """eta = 1 with the trainer at version 3: rows holding a version-1 token are dropped, counted,
    and the update is the reference's on the other rows (advantages still from whole groups)."""
    _, model_dir, batch = setup
    metrics, _, grads = run_world(worlds, f"stale_{nproc}")
    mask = batch["loss_mask"].bool()
    staleness = (CURRENT_VERSION - batch["versions"]).masked_fill(~mask, 0)
    stale_rows = (staleness > 1).any(dim=1)
    assert 0 < int(stale_rows.sum()) < len(stale_rows), "the fixture must have stale and fresh rows"
    kept = dict(batch, loss_mask=batch["loss_mask"] * (~stale_rows).unsqueeze(1).to(torch.uint8))
    expected_grads, expected_loss = reference_gradients(model_dir, kept, "aipo")
    kept_mask = kept["loss_mask"].bool()
    assert metrics["dropped_stale_samples"] == float(stale_rows.sum())
    assert metrics["num_loss_tokens"] == float(kept_mask.sum())
    assert metrics["staleness_max"] == 1.0
    assert metrics["staleness_mean"] == pytest.approx(float(staleness[kept_mask].float().mean()))
    assert metrics["loss"] == pytest.approx(expected_loss, rel=1e-4, abs=1e-6)
    assert_grads_close(grads, expected_grads)


def test_top_p_and_top_k_are_refused_for_training():
    from llamarl.executors.config import GeneratorConfig
    from llamarl.rl.config import RLConfig

    with pytest.raises(ValueError, match="--generator.top-p 0.9 / --generator.top-k 0: training needs"):
        RLConfig(generator=GeneratorConfig(top_p=0.9))
    with pytest.raises(ValueError, match="top-k 5"):
        RLConfig(generator=GeneratorConfig(top_k=5))


@pytest.mark.parametrize(("nproc", "budget"), LOSS_CASES)
def test_normalize_batch_uses_the_whole_batch_on_any_number_of_ranks(setup, worlds, nproc, budget):
    """Batch-normalised advantages come from the statistics of the whole batch (one all-reduce),
    so 1 and 2 trainer ranks give the reference's update."""
    _, model_dir, batch = setup
    metrics, _, grads = run_world(worlds, f"norm_{nproc}_{budget}")
    expected_grads, expected_loss = reference_gradients(model_dir, batch, "aipo", normalize_batch=True)
    assert metrics["loss"] == pytest.approx(expected_loss, rel=1e-4, abs=1e-6)
    assert_grads_close(grads, expected_grads)
