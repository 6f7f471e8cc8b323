"""The single-process reference the trainer's parity tests compare against, in one place.

``tests/worlds/trainer_world.py`` runs ``TrainerExecutor.train_on`` on 1 or 2 gloo ranks with the
hyper-parameters below; the references here compute the same update on the whole batch in one
process, written from the paper formulas: AIPO, decoupled PPO (AReaL eq. 3) and A-3PO's log-linear
proximal policy. ``tests/test_trainer.py`` (one optimizer step) and ``tests/test_minibatches.py``
(``--trainer.num-minibatches k``: k SGD steps) use them.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from llamarl.models.loading import load_causal_lm

TEMPERATURE, LR, CLIP, RHO, EPS = 0.8, 1e-2, 0.5, 4.0, 0.2
CURRENT_VERSION = 3  # the trainer's version in the world; the batch's tokens are versions 1..3


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


def world_args(model_dir: Path, batch_path: Path, out: Path, *flags: str) -> list[str]:
    """``trainer_world.py``'s arguments: the model, the batch, the output file, then ``flags``."""
    return ["--model-dir", str(model_dir), "--batch", str(batch_path), "--out", str(out), *flags]


class TrainerWorlds:
    """A test module's ``trainer_world.py`` jobs, ``{name: (nproc, flags)}``, run on first use: every
    job of one rank count in one world (``launch(plan_file, nproc)`` runs ``trainer_world.py --plan``
    and raises when the world fails), so the process start, imports and process group are paid once
    per rank count, not once per job. ``worlds.out(name)`` is the job's output file (``read_update``
    reads it); a world that failed fails every test that asks for one of its jobs."""

    def __init__(self, tmp: Path, model_dir: Path, jobs: dict[str, tuple[int, list[str]]], launch) -> None:
        self.tmp, self.model_dir, self.jobs, self.launch = tmp, model_dir, jobs, launch
        self.failed: dict[int, str | None] = {}  # nproc -> None (ran) or the world's failure

    def out(self, name: str) -> Path:
        nproc = self.jobs[name][0]
        if nproc not in self.failed:
            plan = [world_args(self.model_dir, self.tmp / "batch.safetensors", self.tmp / f"{job}.safetensors", *flags)
                    for job, (n, flags) in self.jobs.items() if n == nproc]
            plan_file = self.tmp / f"plan_{nproc}.json"
            plan_file.write_text(json.dumps(plan))
            try:
                self.launch(plan_file, nproc)
                self.failed[nproc] = None
            except AssertionError as exc:
                self.failed[nproc] = str(exc)
        if self.failed[nproc] is not None:
            raise AssertionError(f"the {nproc}-rank trainer world failed:\n{self.failed[nproc]}")
        return self.tmp / f"{name}.safetensors"


def read_update(out: Path) -> tuple[dict, dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """What ``trainer_world.py``'s rank 0 wrote: ``(metrics, weights, gradients)``, by parameter name."""
    with safe_open(str(out), "pt") as f:
        metrics = json.loads(f.metadata()["metrics"])
        saved = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 - safe_open is not iterable
    grads = {k.removeprefix("grad."): v for k, v in saved.items() if k.startswith("grad.")}
    weights = {k: v for k, v in saved.items() if not k.startswith("grad.")}
    return metrics, weights, grads


def assert_grads_close(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> float:
    """fp32 sums in another order (CPUs, rank counts, micro-batch splits): a relative error ~1e-6 of
    the largest summand. Returns the largest reference gradient element."""
    largest = max(g.abs().max().item() for g in expected.values())
    for name, grad in expected.items():
        torch.testing.assert_close(got[name], grad, rtol=1e-4, atol=1e-5 * largest, msg=name)
    return largest


def reference_logp(model, input_ids, lengths):
    """Full forward, every position's logits: log p(x_t | x_<t) at every t >= 1."""
    attention = (torch.arange(input_ids.shape[1]) < lengths.unsqueeze(1)).long()
    logits = model(input_ids=input_ids, attention_mask=attention).logits.float() / TEMPERATURE
    logp = torch.log_softmax(logits[:, :-1], dim=-1).gather(-1, input_ids[:, 1:, None]).squeeze(-1)
    return torch.nn.functional.pad(logp, (1, 0))


def reference_entropy(model, input_ids, lengths):
    """Full forward: the entropy -sum_v p_v log p_v of the distribution predicting x_t, at every t >= 1."""
    attention = (torch.arange(input_ids.shape[1]) < lengths.unsqueeze(1)).long()
    logits = model(input_ids=input_ids, attention_mask=attention).logits.float() / TEMPERATURE
    log_probs = torch.log_softmax(logits[:, :-1], dim=-1)
    return torch.nn.functional.pad(-(log_probs.exp() * log_probs).sum(-1), (1, 0))


def grpo_advantages(batch) -> torch.Tensor:
    """GRPO over each group of samples (population std): one advantage per row."""
    adv = torch.zeros(len(batch["rewards"]))
    for g in set(batch["group_ids"].tolist()):
        idx = (batch["group_ids"] == g).nonzero().squeeze(1)
        r = batch["rewards"][idx]
        adv[idx] = (r - r.mean()) / (r.std(unbiased=False) + 1e-6)
    return adv


def aipo_per_token(logp, behav, A):
    """AIPO: the truncated importance weight min(pi / mu, rho), held constant, times A * log pi."""
    weight = torch.exp(logp - behav).clamp(max=RHO).detach()
    return -weight * A * logp


def decoupled_ppo_per_token(logp, prox, behav, A):
    """Decoupled PPO (AReaL eq. 3): the behaviour weight pi_prox / mu times PPO's clipped objective
    in the ratio pi / pi_prox."""
    w = torch.exp(prox - behav)
    u = torch.exp(logp - prox)
    return -w * torch.minimum(u * A, u.clamp(1 - EPS, 1 + EPS) * A)


def token_mean(per_token, mask):
    return (per_token * mask).sum() / mask.sum()


def aggregated(per_token, mask, loss_agg, length=16):
    """``--algo.loss-agg`` written out over the whole batch: the token mean; each sample's token mean,
    averaged over the samples with a loss token; each sample's sum over ``length``, averaged so."""
    if loss_agg == "token-mean":
        return token_mean(per_token, mask)
    rows = mask.sum(1) > 0
    sums = (per_token * mask).sum(1)
    if loss_agg == "seq-mean-token-mean":
        return (sums[rows] / mask.sum(1)[rows]).sum() / rows.sum()
    return sums[rows].sum() / (length * rows.sum())


def reference_gradients(model_dir, batch, loss_name, *, normalize_batch=False, loss_agg="token-mean",
                        entropy_coef=0.0):
    """Clipped gradients of the paper-formula loss on the whole batch (one optimizer step), and the loss;
    ``entropy_coef`` c: minus c times the entropy aggregated over every loss token as the loss is."""
    model, _ = load_causal_lm(str(model_dir))
    model.train()
    mask = batch["loss_mask"].float()
    # GRPO over each group of 2 (population std), ordered by group id as the trainer does.
    adv = grpo_advantages(batch)
    if normalize_batch:
        adv = (adv - adv.mean()) / (adv.std(unbiased=False) + 1e-6)
    logp = reference_logp(model, batch["input_ids"], batch["num_tokens"])
    behav = batch["behav_logp"]
    A = adv[:, None]
    if loss_name == "aipo":
        per_token = aipo_per_token(logp, behav, A)
    else:  # decoupled PPO with the log-linear prox; one minibatch: the weights are the proximal
        # policy's (v_theta = v_prox), so prox = sg[logp] on stale tokens and mu's on fresh ones (prox.py)
        d = (CURRENT_VERSION - batch["versions"]).float()
        prox = torch.where(d >= 1, logp.detach(), behav).detach()
        per_token = decoupled_ppo_per_token(logp, prox, behav, A)
    loss = aggregated(per_token, mask, loss_agg)
    if entropy_coef:
        loss = loss - entropy_coef * aggregated(reference_entropy(model, batch["input_ids"], batch["num_tokens"]),
                                                mask, loss_agg)
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
    adv = grpo_advantages(batch)[:, None]
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
        per_token = decoupled_ppo_per_token(logp, prox, behav, adv)
        loss = token_mean(per_token, mask)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
        opt.step()
        losses.append(float(loss.detach()))
        tokens += float(mask.sum())
        version += 1
    return {n: p.detach() for n, p in model.named_parameters()}, grads, losses, tokens, version - CURRENT_VERSION
