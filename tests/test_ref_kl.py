"""recipes/ref_kl.py: the reference-policy executor between the reward and the trainer, in real
gloo worlds on a tiny random Llama (generator, reward, ref, trainer: four executors).

* the shaping is what it says: every reward the trainer received is the rule reward minus
  beta * the per-sample KL sum, recomputed here from the tapped batch with the reference model
  loaded independently (k3, async, the reference sharded over two ranks);
* at the first tick (policy = reference, fp32 generator and reference) the k1 KL is ~0;
* the KL metric falls as its coefficient rises: beta 0 vs beta 5 from the same seed, on-policy
  (sync), a learning rate that moves the policy within a few ticks; beta 0 leaves rewards untouched.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parent / "worlds"))
from conftest import read_jsonl
from launch import check, run_torchrun
from middle_stage import check_middle_stage_pipeline
from scorers_for_tests import first_char_even
from taps import read_taps

from llamarl.algorithms.advantages import kl_penalty
from llamarl.models.loading import load_causal_lm
from llamarl.models.logprobs import completion_logprobs
from recipes.ref_kl import RefConfig, RefKLConfig, check_ref_kl, ref_kl_pipeline

TEMPERATURE = 0.8  # ArithmeticConfig's default, which the worlds keep
REF_KEYS = ("kl_mean", "kl_penalty_mean", "reward_raw_mean", "reward_shaped_mean", "ref_samples", "ref_tokens")


def run_world(tmp_path, model_dir, name, *, nproc=4, args=()):
    out, taps = tmp_path / name, tmp_path / f"{name}_taps"
    check(run_torchrun("stage_recipe_world.py", nproc=nproc, timeout_s=300, env={"LLAMARL_TEST_TAPS": str(taps)}, args=[
        "--recipe", "ref_kl", "--tap", "trainer", "--",
        "--model.name", str(model_dir), "--run.output-dir", str(out), "--run.num-eval-problems", "4",
        "--generator.num-prompts-per-step", "4", "--generator.dtype", "float32", "--trainer.param-dtype", "float32",
        "--reward.num-workers", "0", "--export.no-final", "--run.device-guard", *args]))
    return out, read_taps(taps, "trainer", "shaped")


def reference_kl_sums(model, batch, kind):
    """Per-sample KL sums of a tapped batch against the reference, recomputed row by row here."""
    sums = []
    for row in range(len(batch)):
        n, p = int(batch["num_tokens"][row]), int(batch["prompt_len"][row])
        ids = batch["input_ids"][row, :n].unsqueeze(0)
        with torch.no_grad():
            ref = completion_logprobs(model, ids, torch.ones_like(ids), start=p, temperature=TEMPERATURE)
        kl = kl_penalty(batch["behav_logp"][row, :n].unsqueeze(0), ref, batch["loss_mask"][row, :n].unsqueeze(0),
                        kind=kind)
        sums.append(float(kl.sum()))
    return torch.tensor(sums, dtype=torch.float64)


def test_shaped_rewards_are_rule_reward_minus_beta_kl_async_k3_two_ref_ranks(tmp_path, model_dir):
    beta = 0.5
    out, taps = run_world(tmp_path, model_dir, "async", nproc=5, args=[
        "--run.max-steps", "6", "--run.schedule", "async", "--run.async-lag", "2", "--ref.num-ranks", "2",
        "--ref.kl-coef", str(beta),
        "--ref.kl-estimator", "k3", "--trainer.lr", "1e-2"])
    ref = read_jsonl(out / "metrics" / "ref.jsonl")
    # async lag 2: rollouts of tick t are scored and shaped at t + 1 (same-tick hop), trained at t + 2.
    assert [r["step"] for r in ref] == [1, 2, 3, 4, 5] and all(k in r for r in ref for k in REF_KEYS)
    assert sorted(taps) == [2, 3, 4, 5]
    model, _ = load_causal_lm(str(model_dir), dtype=torch.float32)
    moved = False
    for step, batch in taps.items():
        metrics = ref[step - 2]
        raw = torch.tensor([first_char_even(c, r) for c, r in zip(batch.get_strings("completion"),
                                                                     batch.get_strings("reference"))])
        assert torch.equal(batch["reward_raw"], raw.float())
        kl_sums = reference_kl_sums(model, batch, "k3")
        torch.testing.assert_close(batch["kl_sum"].double(), kl_sums, atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(batch["rewards"].double(), raw.double() - beta * kl_sums, atol=1e-5, rtol=1e-4)
        tokens = float(batch["loss_mask"].sum())
        assert metrics["ref_samples"] == len(batch) == 16 and metrics["ref_tokens"] == tokens
        assert metrics["kl_mean"] == pytest.approx(float(kl_sums.sum()) / tokens, abs=1e-6)
        assert metrics["kl_penalty_mean"] == pytest.approx(beta * float(kl_sums.mean()), abs=1e-6)
        assert metrics["reward_raw_mean"] == pytest.approx(float(raw.mean()))
        assert metrics["reward_shaped_mean"] == pytest.approx(float(raw.mean()) - beta * float(kl_sums.mean()),
                                                              abs=1e-5)
        assert (kl_sums >= 0).all()  # k3 is non-negative
        moved = moved or metrics["kl_mean"] > 1e-3
    # The first shaped batch was sampled by the reference's own weights (version 0): KL ~0.
    first = taps[2]
    assert int(first["versions"][first["loss_mask"].bool()].max()) == 0 and ref[0]["kl_mean"] < 1e-10
    # The trainer's first step (tick 2) reaches the generator at tick 3, its samples the trainer at 5.
    assert moved, ref
    trainer = [r for r in read_jsonl(out / "metrics" / "trainer.jsonl") if "loss" in r]
    assert [r["step"] for r in trainer] == [2, 3, 4, 5] and all(r["optimizer_steps"] == 1 for r in trainer)


def test_under_lora_the_reference_is_the_trainers_base_with_its_adapters_disabled(tmp_path, model_dir):
    """--trainer.lora.rank: no second model; the reference stage runs on the trainer's ranks and
    forwards the trainer's own model with the adapters off. Its KL sums are those of the base loaded
    independently here, while the adapters move the policy away from it."""
    out, taps = run_world(tmp_path, model_dir, "lora", nproc=3, args=[
        "--run.max-steps", "5", "--run.schedule", "async", "--run.async-lag", "2", "--ref.kl-coef", "0.5",
        "--ref.kl-estimator", "k3", "--trainer.lr", "5e-2", "--trainer.lora.rank", "4"])
    ref = read_jsonl(out / "metrics" / "ref.jsonl")
    assert [r["step"] for r in ref] == [1, 2, 3, 4] and sorted(taps) == [2, 3, 4]
    model, _ = load_causal_lm(str(model_dir), dtype=torch.float32)
    for batch in taps.values():
        torch.testing.assert_close(batch["kl_sum"].double(), reference_kl_sums(model, batch, "k3"), atol=1e-5, rtol=1e-4)
    assert ref[0]["kl_mean"] < 1e-10 and ref[-1]["kl_mean"] > 1e-4, ref  # the adapters moved the policy


def last_ticks_kl(out, ticks=3):
    ref = read_jsonl(out / "metrics" / "ref.jsonl")
    return sum(r["kl_mean"] for r in ref[-ticks:]) / ticks, ref


def test_kl_falls_as_its_coefficient_rises(tmp_path, model_dir):
    # On-policy (sync), same seed, a learning rate that moves the tiny policy within a few ticks.
    # Measured: the mean kl_mean of the last 3 of 8 ticks is 0.51 / 0.61 / 0.79 with beta 0 and
    # 0.13 / 0.17 / 0.15 with beta 5 (seeds 0 / 1 / 2; the test runs seed 0).
    common = ["--run.max-steps", "8", "--run.schedule", "sync", "--trainer.lr", "1e-2", "--ref.kl-estimator", "k1"]
    free_out, free_taps = run_world(tmp_path, model_dir, "beta0", args=[*common, "--ref.kl-coef", "0"])
    held_out, _ = run_world(tmp_path, model_dir, "beta5", args=[*common, "--ref.kl-coef", "5"])
    free_kl, free = last_ticks_kl(free_out)
    held_kl, held = last_ticks_kl(held_out)
    # Tick 0 samples from the reference's own weights (fp32 on both sides): the k1 KL is ~0.
    assert abs(free[0]["kl_mean"]) < 1e-5 and abs(held[0]["kl_mean"]) < 1e-5
    assert free[0]["kl_mean"] == held[0]["kl_mean"]  # same seed, same weights: same samples
    # beta 0 reports the KL and leaves every reward exactly as the rule scored it.
    assert sorted(free_taps) == list(range(8))
    for batch in free_taps.values():
        assert torch.equal(batch["rewards"], batch["reward_raw"])
    assert all(r["reward_shaped_mean"] == r["reward_raw_mean"] and r["kl_penalty_mean"] == 0 for r in free)
    assert free_kl > 0.3, free
    assert held_kl < 0.5 * free_kl, (held_kl, free_kl)


def test_config_and_schedule_are_checked():
    for kwargs, message in [({"num_ranks": -1}, "--ref.num-ranks"), ({"kl_coef": -0.1}, "--ref.kl-coef"),
                            ({"kl_coef": float("nan")}, "--ref.kl-coef"), ({"kl_estimator": "k4"}, "--ref.kl-estimator"),
                            ({"max_tokens_per_microbatch": 0}, "--ref.max-tokens-per-microbatch"),
                            ({"num_threads": 0}, "--ref.num-threads")]:
        with pytest.raises(ValueError, match=message):
            RefConfig(**kwargs)
    # The pipeline: four stages in data order; the reference adds no lag (scored is same-tick).
    check_middle_stage_pipeline(RefKLConfig, ref_kl_pipeline, middle="ref", channels=("rollouts", "scored", "shaped"))
    config = RefKLConfig()
    config.run.output_dir = "/tmp"
    config.ref.max_tokens_per_microbatch = 100
    with pytest.raises(ValueError, match="--ref.max-tokens-per-microbatch 100 is below"):
        check_ref_kl(config)
