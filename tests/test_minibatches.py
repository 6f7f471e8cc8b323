"""``--trainer.num-minibatches k``: k optimizer steps per batch, prompt groups whole, the recomputed
proximal policy computed once before the first, the same update on 1 and 2 trainer ranks as a
single-process reference written here from the paper formula (decoupled PPO, AReaL eq. 3).

The trainer's AdamW is swapped for SGD in the world (below), as the parity tests of
tests/test_trainer.py compare gradients: Adam's first step is about lr * sign(g), so a last-bit
difference of a near-zero gradient between CPUs or rank counts would flip an element by 2 * lr,
and with two sequential steps the second gradient would inherit it. With SGD the weights after
both steps, and the second step's gradient, are compared to the reference at float tolerance.

This file is also the torchrun world it launches (``python tests/test_minibatches.py ...``).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

sys.path.insert(0, str(Path(__file__).parent))
from launch import check, run_torchrun
from test_trainer import CLIP, CURRENT_VERSION, EPS, LR, TEMPERATURE, make_batch, reference_logp
from tiny_model import save_tiny_model

from llamarl.algorithms.losses import decoupled_ppo_loss
from llamarl.algorithms.registry import register_policy_loss
from llamarl.models.loading import load_causal_lm

WORLD = "../" + Path(__file__).name  # run_torchrun resolves scripts under tests/worlds/
PROBES: list[tuple[int, float]] = []  # (minibatch, max |logp - prox| on loss tokens), per micro-batch
MINIBATCH = [0]


def _probe(*, logp, behav_logp, prox_logp, advantages, mask, algo, num_loss_tokens):
    """Decoupled PPO, recording how far the proximal log-probs are from the current ones
    (registered as ``probe_decoupled_ppo`` in the world only)."""
    gap = torch.where(mask.bool(), (logp.detach() - prox_logp).abs(), 0.0).max()
    PROBES.append((MINIBATCH[0], float(gap)))
    return decoupled_ppo_loss(logp=logp, prox_logp=prox_logp, behav_logp=behav_logp, advantages=advantages, mask=mask,
                              eps_clip=algo.eps_clip, num_loss_tokens=num_loss_tokens)


def world_main() -> None:
    """usage: test_minibatches.py MODEL_DIR BATCH OUT K BUDGET PROX [LR]. Rank 0 writes the full weights
    and gradients (``grad.<name>``, of the last step) and the batch's metrics; every rank writes its
    probes to ``OUT.rank<r>.json``."""
    from torch.distributed.tensor import DTensor

    from llamarl.batch import TensorBatch
    from llamarl.channels.base import balanced_group_partition
    from llamarl.config import AlgoConfig, ModelConfig, TrainerConfig
    from llamarl.executors.trainer import TrainerExecutor
    from llamarl.models.sharding import full_named_parameters
    from llamarl.world import ExecutorContext, ExecutorSpec

    register_policy_loss("probe_decoupled_ppo", needs_prox=True, metrics={
        "importance_weight_mean": "mean", "importance_weight_max": "max", "approx_kl": "mean",
        "clip_fraction": "mean", "behav_weight_mean": "mean", "behav_capped_fraction": "mean"})(_probe)
    model_dir, batch_path, out_path, k, budget, prox = sys.argv[1:7]
    lr = float(sys.argv[7]) if len(sys.argv) > 7 else LR
    ctx = ExecutorContext.create([ExecutorSpec("trainer", int(os.environ["WORLD_SIZE"]))], timeout_s=60)
    trainer = TrainerExecutor(ctx, model_config=ModelConfig(name=model_dir),
                              config=TrainerConfig(lr=LR, grad_clip=CLIP, max_tokens_per_microbatch=int(budget),
                                                   num_minibatches=int(k)),
                              algo=AlgoConfig(loss="probe_decoupled_ppo", prox=prox, eps_clip=EPS),
                              temperature=TEMPERATURE)
    trainer.init()
    trainer.optimizer = torch.optim.SGD(trainer.model.parameters(), lr=lr)
    trainer.version = CURRENT_VERSION
    train_minibatch = trainer.train_minibatch

    def counted(part):
        out = train_minibatch(part)
        MINIBATCH[0] += 1
        return out

    trainer.train_minibatch = counted
    full = TensorBatch(load_file(batch_path), {"group_size": 2})
    part = full.select(balanced_group_partition(full, ctx.local_world_size)[ctx.local_rank])
    metrics = trainer.train_on(part)
    model = trainer.get_model()
    params = full_named_parameters(model)
    grads = {f"grad.{name}": (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad)
             for name, p in model.named_parameters()}
    if ctx.rank == 0:
        save_file({k: v.detach().contiguous() for k, v in {**params, **grads}.items()}, out_path,
                  metadata={"metrics": json.dumps(metrics)})
    Path(f"{out_path}.rank{ctx.local_rank}.json").write_text(json.dumps(PROBES))
    ctx.destroy()


def grpo(batch) -> torch.Tensor:
    adv = torch.zeros(len(batch["rewards"]))
    for g in set(batch["group_ids"].tolist()):
        idx = (batch["group_ids"] == g).nonzero().squeeze(1)
        r = batch["rewards"][idx]
        adv[idx] = (r - r.mean()) / (r.std(unbiased=False) + 1e-6)
    return adv


def reference_minibatch_sgd(model_dir, batch, k, prox_mode):
    """k minibatches of whole groups (sorted group ids cut into k runs, sizes differing by <= 1),
    one SGD step each on the decoupled PPO loss (AReaL eq. 3) with the minibatch's own token mean.
    ``recompute``: pi_prox is the policy before the first step, for every minibatch; ``loglinear``:
    A-3PO's interpolation between the token's version and the trainer's at that step, at the
    version before the first step. A minibatch whose samples all
    have zero advantage makes no step. Returns the weights, the last step's clipped gradients, the
    losses, the loss tokens of the steps and the number of steps."""
    model, _ = load_causal_lm(str(model_dir))
    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    adv = grpo(batch)[:, None]
    behav = batch["behav_logp"]
    with torch.no_grad():
        prox_before = reference_logp(model, batch["input_ids"], batch["num_tokens"])
    groups = sorted(set(batch["group_ids"].tolist()))
    version, grads, losses, tokens = CURRENT_VERSION, None, [], 0.0
    for j in range(k):
        chosen = [g for i, g in enumerate(groups) if i * k // len(groups) == j]
        rows = torch.isin(batch["group_ids"], torch.tensor(chosen))
        mask = batch["loss_mask"].float() * rows[:, None]
        if not bool(((adv[:, 0] != 0) & rows).any()):
            continue
        opt.zero_grad()
        logp = reference_logp(model, batch["input_ids"], batch["num_tokens"])
        if prox_mode == "recompute":
            prox = prox_before
        else:
            # AReaL's definition (prox.py): the policy before the first step, version CURRENT_VERSION,
            # interpolated between the token's version and this step's.
            d = (version - batch["versions"]).float()
            gap = (CURRENT_VERSION - batch["versions"]).float()
            alpha = torch.where(d >= 1, gap / d.clamp(min=1), torch.zeros_like(d)).clamp(0, 1)
            prox = (behav + alpha * (logp.detach() - behav)).detach()
        w = torch.exp(prox - behav)
        u = torch.exp(logp - prox)
        per_token = -w * torch.minimum(u * adv, u.clamp(1 - EPS, 1 + EPS) * adv)
        loss = (per_token * mask).sum() / mask.sum()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
        opt.step()
        losses.append(float(loss.detach()))
        tokens += float(mask.sum())
        version += 1
    return {n: p.detach() for n, p in model.named_parameters()}, grads, losses, tokens, version - CURRENT_VERSION


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("minibatches")
    model_dir = save_tiny_model(tmp / "model")
    model, _ = load_causal_lm(str(model_dir))
    batch = make_batch(model)
    save_file(batch, str(tmp / "batch.safetensors"))
    return tmp, model_dir, batch


def run_world(setup, *, nproc, k, budget, prox, lr=LR):
    tmp, model_dir, _ = setup
    out = tmp / f"out_{nproc}_{k}_{budget}_{prox}_{lr}.safetensors"
    check(run_torchrun(WORLD, nproc=nproc, args=[str(model_dir), str(tmp / "batch.safetensors"), str(out),
                                                  str(k), str(budget), prox, str(lr)]))
    with safe_open(str(out), "pt") as f:
        metrics = json.loads(f.metadata()["metrics"])
        saved = {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118 - safe_open is not iterable
    probes = [p for r in range(nproc) for p in json.loads(Path(f"{out}.rank{r}.json").read_text())]
    grads = {n.removeprefix("grad."): t for n, t in saved.items() if n.startswith("grad.")}
    weights = {n: t for n, t in saved.items() if not n.startswith("grad.")}
    return metrics, weights, grads, probes


# Groups of make_batch, sorted: 1 (signal), 3 (all 0), 7 (signal), 9 (all 1). k = 2: {1, 3}, {7, 9};
# k = 3: {1, 3}, {7}, {9}: the last has no signal, so 2 steps. On 2 ranks (LPT by tokens) rank 0
# holds groups 1 and 7, rank 1 groups 3 and 9: it forwards nothing and runs dummy micro-batches.
@pytest.mark.parametrize(("nproc", "k", "budget", "prox"), [
    (1, 2, 4096, "recompute"), (2, 2, 12, "recompute"), (2, 3, 4096, "recompute"), (2, 2, 12, "loglinear")])
def test_minibatch_updates_match_the_sequential_reference_on_1_and_2_ranks(setup, nproc, k, budget, prox):
    _, model_dir, batch = setup
    metrics, weights, grads, _ = run_world(setup, nproc=nproc, k=k, budget=budget, prox=prox)
    expected_weights, expected_grads, losses, tokens, steps = reference_minibatch_sgd(model_dir, batch, k, prox)
    assert steps == 2 and metrics["version"] == CURRENT_VERSION + steps
    largest = max(g.abs().max().item() for g in expected_grads.values())
    assert largest > 1e-3, "the reference gradient is ~0; the test would be vacuous"
    for name, grad in expected_grads.items():
        torch.testing.assert_close(grads[name], grad, rtol=1e-4, atol=1e-5 * largest, msg=name)
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


def test_recomputed_prox_is_the_policy_before_the_first_minibatch(setup):
    """k = 2, recompute: the first minibatch trains at the proximal policy's weights (ratio 1 up to
    the float noise of another packing), the second after one update, so the clip can act there
    (a large SGD step, so that some ratio leaves [1 - eps, 1 + eps])."""
    metrics, _, _, probes = run_world(setup, nproc=1, k=2, budget=4096, prox="recompute", lr=10.0)
    first = [gap for mb, gap in probes if mb == 0]
    second = [gap for mb, gap in probes if mb == 1]
    assert first and second
    assert max(first) < 1e-4
    assert max(second) > 0.2  # |log u| beyond log(1 + eps)
    assert metrics["clip_fraction"] > 0  # the mean over the two minibatches: only the second clips


def test_num_minibatches_is_validated():
    from llamarl.config import TrainerConfig

    with pytest.raises(ValueError, match="--trainer.num-minibatches must be >= 1, got 0"):
        TrainerConfig(num_minibatches=0)


if __name__ == "__main__":
    world_main()


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
