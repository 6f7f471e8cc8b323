"""FSDP2 trainer parity: 1 and 2 gloo ranks, with and without micro-batch packing, give the same
update as a single-process reference written from the paper formulas on the whole batch.

Compared on the clipped gradients, not through the weights after one AdamW step: Adam's first step
is about lr * sign(g), so a last-bit difference in a near-zero gradient (the summation order differs
between CPUs, rank counts and micro-batch splits) flips an element by 2 * lr. The optimizer step is
checked separately and exactly: AdamW applied to the trainer's own gradients must give its weights.
"""

import json
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).parent))
from launch import check, run_torchrun
from tiny_model import save_tiny_model

from llamarl.models.loading import load_causal_lm

TEMPERATURE, LR, CLIP, RHO, EPS = 0.8, 1e-2, 0.5, 4.0, 0.2
CURRENT_VERSION = 3


def make_batch(model) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    rows, width = 8, 12
    prompt_len = torch.tensor([3, 3, 5, 5, 4, 4, 6, 6])
    completion_len = torch.tensor([2, 5, 3, 4, 5, 1, 4, 3])
    input_ids = torch.zeros(rows, width, dtype=torch.int64)
    loss_mask = torch.zeros(rows, width, dtype=torch.uint8)
    versions = torch.full((rows, width), -1, dtype=torch.int64)
    for r in range(rows):
        n = int(prompt_len[r] + completion_len[r])
        input_ids[r, :n] = torch.randint(3, 100, (n,), generator=gen)
        if r % 2:  # a GRPO group: both samples answer the same prompt (the trainer forwards it once)
            input_ids[r, :prompt_len[r]] = input_ids[r - 1, :prompt_len[r]]
        loss_mask[r, prompt_len[r]:n] = 1
        versions[r, prompt_len[r]:n] = torch.randint(1, CURRENT_VERSION + 1, (int(completion_len[r]),), generator=gen)
    with torch.no_grad():
        logp = reference_logp(model, input_ids, prompt_len + completion_len)
    behav = (logp + 0.5 * torch.randn(rows, width, generator=gen)) * loss_mask
    return {"input_ids": input_ids, "loss_mask": loss_mask, "behav_logp": behav, "versions": versions,
            "rewards": torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 0.0, 1.0]),
            "group_ids": torch.tensor([7, 7, 3, 3, 9, 9, 1, 1]), "num_tokens": prompt_len + completion_len}


def reference_logp(model, input_ids, lengths):
    """Full forward, every position's logits: log p(x_t | x_<t) at every t >= 1."""
    attention = (torch.arange(input_ids.shape[1]) < lengths.unsqueeze(1)).long()
    logits = model(input_ids=input_ids, attention_mask=attention).logits.float() / TEMPERATURE
    logp = torch.log_softmax(logits[:, :-1], dim=-1).gather(-1, input_ids[:, 1:, None]).squeeze(-1)
    return torch.nn.functional.pad(logp, (1, 0))


def reference_gradients(model_dir, batch, loss_name, *, normalize_batch=False):
    """Clipped gradients of the paper-formula loss on the whole batch, and the loss."""
    model, _ = load_causal_lm(str(model_dir))
    model.train()
    mask = batch["loss_mask"].float()
    rewards = batch["rewards"]
    # GRPO over each group of 2 (population std), ordered by group id as the trainer does.
    adv = torch.zeros(8)
    for g in set(batch["group_ids"].tolist()):
        idx = (batch["group_ids"] == g).nonzero().squeeze(1)
        r = rewards[idx]
        adv[idx] = (r - r.mean()) / (r.std(unbiased=False) + 1e-6)
    if normalize_batch:
        adv = (adv - adv.mean()) / (adv.std(unbiased=False) + 1e-6)
    logp = reference_logp(model, batch["input_ids"], batch["num_tokens"])
    behav = batch["behav_logp"]
    A = adv[:, None]
    if loss_name == "aipo":
        weight = torch.exp(logp - behav).clamp(max=RHO).detach()
        per_token = -weight * A * logp
    else:  # decoupled PPO with the log-linear prox; one minibatch: the weights are the proximal
        # policy's (v_theta = v_prox), so prox = sg[logp] on stale tokens and mu's on fresh ones (prox.py)
        d = (CURRENT_VERSION - batch["versions"]).float()
        prox = torch.where(d >= 1, logp.detach(), behav).detach()
        w = torch.exp(prox - behav)
        u = torch.exp(logp - prox)
        per_token = -w * torch.minimum(u * A, u.clamp(1 - EPS, 1 + EPS) * A)
    loss = (per_token * mask).sum() / mask.sum()
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
    return {n: p.grad.detach() for n, p in model.named_parameters()}, float(loss.detach())


def adamw_step(model_dir, grads):
    """The weights one AdamW step (the trainer's hyper-parameters) makes from ``grads``."""
    model, _ = load_causal_lm(str(model_dir))
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    for name, p in model.named_parameters():
        p.grad = grads[name].clone()
    opt.step()
    return {n: p.detach() for n, p in model.named_parameters()}


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("trainer")
    model_dir = save_tiny_model(tmp / "model")
    model, _ = load_causal_lm(str(model_dir))
    batch = make_batch(model)
    save_file(batch, str(tmp / "batch.safetensors"))
    return tmp, model_dir, batch


@pytest.mark.parametrize("loss_name", ["aipo", "decoupled_ppo"])
@pytest.mark.parametrize(("nproc", "budget"), [(1, 4096), (2, 4096), (2, 12), (1, "rows3")])
def test_fsdp_update_matches_single_process_reference(setup, nproc, budget, loss_name):
    tmp, model_dir, batch = setup
    out = tmp / f"out_{nproc}_{budget}_{loss_name}.safetensors"
    check(run_torchrun("trainer_world.py", nproc=nproc,
                       args=[str(model_dir), str(tmp / "batch.safetensors"), str(out), str(budget), loss_name]))
    expected_grads, expected_loss = reference_gradients(model_dir, batch, loss_name)
    with safe_open(str(out), "pt") as f:
        metrics = json.loads(f.metadata()["metrics"])
        saved = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 - safe_open is not iterable
    got_grads = {k.removeprefix("grad."): v for k, v in saved.items() if k.startswith("grad.")}
    got_weights = {k: v for k, v in saved.items() if not k.startswith("grad.")}
    assert sorted(got_grads) == sorted(expected_grads) == sorted(got_weights)
    largest = max(g.abs().max().item() for g in expected_grads.values())
    assert largest > 1e-3, "the reference gradient is ~0; the test would be vacuous"
    for name, grad in expected_grads.items():
        # fp32 sums in another order: relative error ~1e-6 of the largest summand.
        torch.testing.assert_close(got_grads[name], grad, rtol=1e-4, atol=1e-5 * largest, msg=name)
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


@pytest.mark.parametrize(("nproc", "budget"), [(1, 4096), (2, 12)])
def test_a_loss_registered_by_user_code_is_used_with_its_declared_reductions(setup, nproc, budget):
    """``aipo_x2`` (registered in the world script) doubles AIPO's loss; its ``rows`` metric is a
    sum over micro-batches and ranks: the 4 samples with signal, however they are split."""
    tmp, model_dir, batch = setup
    out = tmp / f"x2_{nproc}_{budget}.safetensors"
    check(run_torchrun("trainer_world.py", nproc=nproc,
                       args=[str(model_dir), str(tmp / "batch.safetensors"), str(out), str(budget), "aipo_x2"]))
    _, expected_loss = reference_gradients(model_dir, batch, "aipo")
    with safe_open(str(out), "pt") as f:
        metrics = json.loads(f.metadata()["metrics"])
    assert metrics["loss"] == pytest.approx(2 * expected_loss, rel=1e-4, abs=1e-6)
    assert metrics["rows"] == 4 and "importance_weight_max" not in metrics


def test_unknown_names_list_the_registered_ones():
    from llamarl.algorithms.registry import get_advantage, get_policy_loss, register_policy_loss
    from llamarl.config import AlgoConfig

    with pytest.raises(ValueError, match=r"unknown policy loss 'nope'; registered: \['aipo', 'decoupled_ppo', 'ppo'"):
        get_policy_loss("nope")
    with pytest.raises(ValueError, match=r"registered: \['grpo', 'mean', 'rloo'\]"):
        get_advantage("nope")
    with pytest.raises(ValueError, match="--algo.loss 'nope' is not registered; known:"):
        AlgoConfig(loss="nope")
    with pytest.raises(ValueError, match="already registered"):
        register_policy_loss("aipo", metrics={})(lambda **kw: None)
    with pytest.raises(ValueError, match="reductions must be one of"):
        register_policy_loss("other", metrics={"x": "median"})


@pytest.mark.parametrize("nproc", [1, 2])
def test_max_staleness_drops_rows_counts_them_and_reports_staleness_over_kept_tokens(setup, nproc):
    """eta = 1 with the trainer at version 3: rows holding a version-1 token are dropped, counted,
    and the update is the reference's on the other rows (advantages still from whole groups)."""
    tmp, model_dir, batch = setup
    out = tmp / f"stale_{nproc}.safetensors"
    check(run_torchrun("trainer_world.py", nproc=nproc, args=[
        str(model_dir), str(tmp / "batch.safetensors"), str(out), "4096", "aipo", "1"]))
    mask = batch["loss_mask"].bool()
    staleness = (CURRENT_VERSION - batch["versions"]).masked_fill(~mask, 0)
    stale_rows = (staleness > 1).any(dim=1)
    assert 0 < int(stale_rows.sum()) < len(stale_rows), "the fixture must have stale and fresh rows"
    kept = dict(batch, loss_mask=batch["loss_mask"] * (~stale_rows).unsqueeze(1).to(torch.uint8))
    expected_grads, expected_loss = reference_gradients(model_dir, kept, "aipo")
    with safe_open(str(out), "pt") as f:
        metrics = json.loads(f.metadata()["metrics"])
        grads = {k.removeprefix("grad."): f.get_tensor(k) for k in f.keys() if k.startswith("grad.")}  # noqa: SIM118
    kept_mask = kept["loss_mask"].bool()
    assert metrics["dropped_stale_samples"] == float(stale_rows.sum())
    assert metrics["num_loss_tokens"] == float(kept_mask.sum())
    assert metrics["staleness_max"] == 1.0
    assert metrics["staleness_mean"] == pytest.approx(float(staleness[kept_mask].float().mean()))
    assert metrics["loss"] == pytest.approx(expected_loss, rel=1e-4, abs=1e-6)
    largest = max(g.abs().max().item() for g in expected_grads.values())
    for name, grad in expected_grads.items():
        torch.testing.assert_close(grads[name], grad, rtol=1e-4, atol=1e-5 * largest, msg=name)


def test_top_p_and_top_k_are_refused_for_training():
    from llamarl.config import GeneratorConfig, RLConfig

    with pytest.raises(ValueError, match="--generator.top-p 0.9 / --generator.top-k 0: training needs"):
        RLConfig(generator=GeneratorConfig(top_p=0.9))
    with pytest.raises(ValueError, match="top-k 5"):
        RLConfig(generator=GeneratorConfig(top_k=5))


@pytest.mark.parametrize(("nproc", "budget"), [(1, 4096), (2, 12)])
def test_normalize_batch_uses_the_whole_batch_on_any_number_of_ranks(setup, nproc, budget):
    """Batch-normalised advantages come from the statistics of the whole batch (one all-reduce),
    so 1 and 2 trainer ranks give the reference's update."""
    tmp, model_dir, batch = setup
    out = tmp / f"norm_{nproc}_{budget}.safetensors"
    check(run_torchrun("trainer_world.py", nproc=nproc, args=[
        str(model_dir), str(tmp / "batch.safetensors"), str(out), str(budget), "aipo", "none", "normalize"]))
    expected_grads, expected_loss = reference_gradients(model_dir, batch, "aipo", normalize_batch=True)
    with safe_open(str(out), "pt") as f:
        metrics = json.loads(f.metadata()["metrics"])
        grads = {k.removeprefix("grad."): f.get_tensor(k) for k in f.keys() if k.startswith("grad.")}  # noqa: SIM118
    assert metrics["loss"] == pytest.approx(expected_loss, rel=1e-4, abs=1e-6)
    largest = max(g.abs().max().item() for g in expected_grads.values())
    for name, grad in expected_grads.items():
        torch.testing.assert_close(grads[name], grad, rtol=1e-4, atol=1e-5 * largest, msg=name)
