"""One GRPO step's gradient: llamarl's trainer vs TRL 1.16's GRPOTrainer on the same batch.

    .venv/bin/python benchmarks/grad_parity.py --trl-venv /work/trl-venv   # table on stdout; runs/grad_parity/

What benchmarks/vs_trl.py compares over 12 steps, reduced to one update on one fixed batch, so a
difference in the update (advantages, log-prob temperature, loss aggregation, precision, the AIPO
weight) shows up as a number instead of as seed noise in an accuracy curve:

1. The batch: llamarl's first colocated step of ``vs_trl.py`` at ``--seed`` -- the first ``--prompts``
   prompts of ``ArithmeticTask(seed)``, ``--samples`` completions each sampled by llamarl's
   ``TorchEngine`` on a bf16 copy (the generator's dtype and RNG seed), scored by
   ``llamarl.rewards.arithmetic.score``. The behaviour log-probs are the bf16 generator's.
2. llamarl: the real ``TrainerExecutor.train_on`` (FSDP2 on a one-rank gloo world, the recipe's
   bf16 compute with fp32 master weights, AIPO, shared-prompt micro-batches), gradient clip off,
   the gradient read before AdamW's step (which is skipped). Variants that isolate one factor each:
   ``llamarl_ratio1`` (behaviour log-probs := the trainer's own, so the AIPO weight is exactly 1) and
   ``llamarl_fp32`` (``--trainer.param-dtype float32``).
3. TRL (in its own venv, ``--trl-venv``): ``GRPOTrainer.train()`` for one step with the exact
   ``GRPOConfig`` of ``benchmarks/trl_grpo_worker.py`` (``grpo_config``), its generation replaced by
   the same completions and its reward by the same rewards, clip off (``max_grad_norm=0``), the
   gradient read in ``on_pre_optimizer_step``. ``trl_fp32``: the same with ``bf16=False``. The
   prompt token ids TRL builds are checked equal to llamarl's.
4. ``reference``: the objective both claim, computed independently here in fp32 on the plain HF
   model: ``-sum_t A_i log pi(y_t) / (all completion tokens)`` with logits / temperature and llamarl's
   group advantages (population std); on-policy, so the PPO / AIPO ratio is 1 and its gradient is the
   REINFORCE one.

Reported: advantages (TRL uses the unbiased group std and eps 1e-4, llamarl the population std
and eps 1e-6), per-token log-probs of each side against fp32 (and the bf16 generator's), loss
values, and for each pair of gradients: global cosine, norm ratio, per-parameter cosine (median /
min), and the fraction of elements whose sign agrees (AdamW's first step is ~lr * sign(g), so sign
agreement is what the first update is made of), plus that fraction weighted by |reference grad|.
Written to ``<out>/grad_parity.json``; gradients as safetensors under ``<out>`` (~0.5 GB each).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TEMPERATURE = 0.8


# ----------------------------------------------------------------------------------------------
# TRL side (runs in the TRL venv: no llamarl import but the pure-Python scorer is not needed either)
# ----------------------------------------------------------------------------------------------
def trl_side(batch_dir: Path, bf16: bool, name: str) -> None:
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOTrainer

    sys.path.insert(0, str(REPO / "benchmarks"))
    from trl_grpo_worker import grpo_config, prompt_dataset

    data = json.loads((batch_dir / "batch.json").read_text())
    spec = data["spec"]
    torch.set_num_threads(spec["threads"])
    out = batch_dir / name
    out.mkdir(exist_ok=True)
    args = grpo_config(spec, out, max_steps=1, max_grad_norm=0.0, bf16=bf16, logging_steps=1)
    model = AutoModelForCausalLM.from_pretrained(spec["model"], dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(spec["model"])
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    completions, rewards = data["completion_ids"], data["rewards"]
    captured: dict = {}

    class Capture(TrainerCallback):
        def on_pre_optimizer_step(self, args, state, control, **kwargs):
            grads = {k: p.grad.detach().float().contiguous().clone() for k, p in trainer.model.named_parameters()
                     if p.grad is not None}
            save_file(grads, str(batch_dir / f"grad_{name}.safetensors"))
            captured["grad_norm"] = math.sqrt(sum(float(g.double().square().sum()) for g in grads.values()))
            inputs = captured["inputs"]
            ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)
            mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
            with torch.no_grad():
                logps, _, _ = trainer._get_per_token_logps_and_entropies(
                    trainer.model, ids, mask, inputs["completion_ids"].size(1))
            cmask = inputs["completion_mask"].bool()
            captured["logp"] = [row[m].tolist() for row, m in zip(logps.float(), cmask)]

    trainer = GRPOTrainer(model=model, reward_funcs=[lambda completions, **kw: [0.0] * len(completions)],
                          args=args, train_dataset=prompt_dataset(spec), processing_class=tokenizer,
                          callbacks=[Capture()])

    def generate_single_turn(prompt_ids, images, multimodal_fields, num_generations):
        # Row i of the generation batch is prompt i // samples (TRL repeats each prompt, in order).
        captured["prompt_ids"] = [list(map(int, p)) for p in prompt_ids]
        assert len(prompt_ids) == len(completions), (len(prompt_ids), len(completions))
        return [list(c) for c in completions], None

    def calculate_rewards(inputs, prompts, completions_, completion_ids_list):
        return torch.tensor(rewards, dtype=torch.float32).unsqueeze(1)

    score = trainer._generate_and_score_completions

    def generate_and_score(inputs):
        result = score(inputs)
        captured["inputs"] = {k: v.detach().clone() if torch.is_tensor(v) else v for k, v in result.items()}
        return result

    trainer._generate_single_turn = generate_single_turn
    trainer._calculate_rewards = calculate_rewards
    trainer._generate_and_score_completions = generate_and_score
    losses = []
    original_compute_loss = trainer.compute_loss

    def compute_loss(*a, **kw):
        loss = original_compute_loss(*a, **kw)
        losses.append(float(loss.detach()))
        return loss

    trainer.compute_loss = compute_loss
    t0 = time.perf_counter()
    trainer.train()
    inputs = captured["inputs"]
    result = {"name": name, "bf16": bf16, "seconds": time.perf_counter() - t0,
              "prompt_ids_match": captured["prompt_ids"] == data["prompt_ids"],
              "advantages": inputs["advantages"].tolist(), "num_items_in_batch": float(inputs["num_items_in_batch"]),
              "completion_ids_match": [row[m.bool()].tolist() for row, m in
                                       zip(inputs["completion_ids"], inputs["completion_mask"])] == completions,
              "loss": losses[0], "grad_norm": captured["grad_norm"], "logp": captured["logp"]}
    (batch_dir / f"{name}.json").write_text(json.dumps(result))
    print(f"grad_parity[{name}]: loss {losses[0]:.6g}, grad norm {captured['grad_norm']:.6g}, "
          f"prompts match {result['prompt_ids_match']}", flush=True)


# ----------------------------------------------------------------------------------------------
# llamarl side (project venv)
# ----------------------------------------------------------------------------------------------
def make_batch(args, out: Path):
    """The first colocated step's batch of vs_trl.py at ``args.seed``; returns (TensorBatch, record)."""
    import torch

    from llamarl.data.arithmetic import ArithmeticTask
    from llamarl.data.prompts import ARITHMETIC_INSTRUCTION
    from llamarl.engines.base import Request, SamplingParams
    from llamarl.engines.torch_engine import TorchEngine
    from llamarl.executors.generator import completions_to_batch
    from llamarl.models.loading import load_causal_lm, resolve_model_path, stop_token_ids
    from llamarl.rewards.arithmetic import score
    from recipes.arithmetic import prompt_fn

    model, tokenizer = load_causal_lm("smollm2-135m-instruct", dtype=torch.bfloat16)
    model.eval()
    eos = stop_token_ids(model, tokenizer)
    engine = TorchEngine(model, eos_token_ids=eos, pad_token_id=tokenizer.pad_token_id)
    task = ArithmeticTask(num_digits=2, seed=args.seed)
    problems = [task.sample(i) for i in range(args.prompts)]
    n = args.samples
    requests = [Request(sample_id=i * n + j, prompt_ids=list(prompt_fn(tokenizer, p.question)))
                for i, p in enumerate(problems) for j in range(n)]
    rng = torch.Generator().manual_seed(args.seed * 1000)  # the generator executor's seed (dp rank 0)
    outs = engine.generate(requests, sampling=SamplingParams(temperature=TEMPERATURE, max_new_tokens=12),
                           version=0, generator=rng)
    outs = sorted(outs, key=lambda c: c.sample_id)
    texts = tokenizer.batch_decode([c.completion_ids for c in outs], skip_special_tokens=True)
    rewards = [score(t, problems[c.sample_id // n].answer) for t, c in zip(texts, outs)]
    batch = completions_to_batch(outs, group_ids=[c.sample_id // n for c in outs],
                                 references=[problems[c.sample_id // n].answer for c in outs], texts=texts,
                                 pad_token_id=tokenizer.pad_token_id, group_size=n)
    batch.fields["rewards"] = torch.tensor(rewards, dtype=torch.float32)
    spec = {"repo": str(REPO), "model": str(resolve_model_path("smollm2-135m-instruct")),
            "prompts": str(out / "prompts.jsonl"), "out": str(out), "instruction": ARITHMETIC_INSTRUCTION,
            "steps": 1, "eval_every": 1, "prompts_per_step": args.prompts, "samples_per_prompt": n,
            "max_new_tokens": 12, "temperature": TEMPERATURE, "lr": args.lr, "threads": args.threads,
            "seed": args.seed}
    (out / "prompts.jsonl").write_text("".join(json.dumps({"question": p.question, "answer": p.answer}) + "\n"
                                               for p in problems))
    record = {"spec": spec, "prompt_ids": [c.prompt_ids for c in outs],
              "completion_ids": [c.completion_ids for c in outs], "behav_logp": [c.logprobs for c in outs],
              "texts": texts, "rewards": rewards}
    (out / "batch.json").write_text(json.dumps(record))
    return batch, record


def llamarl_side(args, out: Path, batch, *, name: str, param_dtype: str, ratio1: bool) -> dict:
    """The trainer's real ``train_on`` on ``batch`` (one-rank world), clip off, no AdamW step."""
    from safetensors.torch import save_file
    from torch.distributed.tensor import DTensor

    from llamarl.algorithms.config import AlgoConfig
    from llamarl.executors.config import TrainerConfig
    from llamarl.executors.trainer import TrainerExecutor
    from llamarl.models.config import ModelConfig
    from llamarl.models.microbatch import sequence_logprobs
    from llamarl.runtime.batch import TensorBatch
    from llamarl.runtime.world import ExecutorContext, ExecutorSpec

    with socket.socket() as s:  # a one-rank gloo world for the trainer executor, on a fresh port each time
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": "0", "WORLD_SIZE": "1",
                       "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1"})
    ctx = ExecutorContext.create([ExecutorSpec("trainer", 1)], timeout_s=600)
    try:
        trainer = TrainerExecutor(ctx, model_config=ModelConfig(name="smollm2-135m-instruct"),
                                  config=TrainerConfig(lr=args.lr, grad_clip=0.0, param_dtype=param_dtype,
                                                       num_threads=args.threads),
                                  algo=AlgoConfig(loss="aipo"), temperature=TEMPERATURE, seed=args.seed)
        trainer.init()
        batch = TensorBatch(dict(batch.fields), dict(batch.metadata))
        # The trainer's own log-probs of every completion token (its micro-batching, no grad).
        own = sequence_logprobs(trainer.model, batch, temperature=TEMPERATURE, group=ctx.group, device=ctx.device,
                                max_tokens_per_microbatch=trainer.config.max_tokens_per_microbatch,
                                share_prompts=trainer.config.share_prompts)
        if ratio1:
            batch.fields["behav_logp"] = own.clone()
        grads: dict = {}

        def capture_step(*a, **kw):  # the update is not taken: only its gradient is wanted
            for key, p in trainer.model.named_parameters():
                if p.grad is not None:
                    g = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
                    grads[key] = g.detach().float().contiguous().clone()

        trainer.optimizer.step = capture_step
        t0 = time.perf_counter()
        metrics = trainer.train_on(batch)
        seconds = time.perf_counter() - t0
        save_file(grads, str(out / f"grad_{name}.safetensors"))
        mask = batch["loss_mask"].bool()
        advantages = trainer.prepare(TensorBatch(dict(batch.fields), dict(batch.metadata)))["advantages"]
        return {"name": name, "param_dtype": param_dtype, "ratio1": ratio1, "seconds": seconds,
                "loss": metrics.get("loss"), "grad_norm": metrics.get("grad_norm"), "metrics": metrics,
                "advantages": advantages.tolist(), "logp": [row[m].tolist() for row, m in zip(own, mask)]}
    finally:
        ctx.destroy()


def reference_side(args, out: Path, batch) -> dict:
    """fp32, plain HF model, per-row forwards: -sum A_i log pi(y_t) / (all completion tokens)."""
    import torch
    from safetensors.torch import save_file

    from llamarl.algorithms.advantages import group_advantages
    from llamarl.models.loading import load_causal_lm
    from llamarl.models.logprobs import completion_logprobs

    torch.set_num_threads(args.threads)
    model, _ = load_causal_lm("smollm2-135m-instruct", dtype=torch.float32)
    model.train()
    adv = group_advantages(batch["rewards"], int(batch.metadata["group_size"]))
    mask = batch["loss_mask"].bool()
    total = float(mask.sum())
    logps, loss_value = [], 0.0
    for row in range(len(batch)):  # one row at a time: no padding anywhere
        length = int(batch["num_tokens"][row])
        ids = batch["input_ids"][row : row + 1, :length]
        start = int(batch["prompt_len"][row])
        logp = completion_logprobs(model, ids, torch.ones_like(ids), start=start, temperature=TEMPERATURE)[0, start:]
        logps.append(logp.detach().tolist())
        loss = -(adv[row] * logp).sum() / total
        if adv[row] != 0:
            loss.backward()
        loss_value += float(loss.detach())
    grads = {k: p.grad.detach().float().contiguous().clone() for k, p in model.named_parameters()
             if p.grad is not None}
    save_file(grads, str(out / "grad_reference.safetensors"))
    return {"name": "reference", "loss": loss_value, "advantages": adv.tolist(), "logp": logps,
            "grad_norm": math.sqrt(sum(float(g.double().square().sum()) for g in grads.values()))}


def compare(out: Path, a: str, b: str) -> dict:
    """Gradient ``a`` against ``b`` (``b`` the reference of the sign weighting)."""
    import torch
    from safetensors import safe_open

    fa, fb = (safe_open(str(out / f"grad_{x}.safetensors"), "pt") for x in (a, b))
    names = sorted(set(fa.keys()) & set(fb.keys()))
    missing = sorted(set(fa.keys()) ^ set(fb.keys()))
    dot = na = nb = 0.0
    agree = total = weighted_agree = weight = 0.0
    per_param = {}
    for key in names:
        x, y = fa.get_tensor(key).double(), fb.get_tensor(key).double()
        d, nx, ny = float((x * y).sum()), float(x.square().sum()), float(y.square().sum())
        dot, na, nb = dot + d, na + nx, nb + ny
        per_param[key] = d / math.sqrt(nx * ny) if nx > 0 and ny > 0 else float("nan")
        nonzero = (x != 0) | (y != 0)
        same = (torch.sign(x) == torch.sign(y)) & nonzero
        agree += float(same.sum())
        total += float(nonzero.sum())
        weighted_agree += float((y.abs() * same).sum())
        weight += float((y.abs() * nonzero).sum())
    cosines = sorted(v for v in per_param.values() if not math.isnan(v))
    worst = sorted(per_param.items(), key=lambda kv: kv[1])[:3]
    return {"a": a, "b": b, "cosine": dot / math.sqrt(na * nb), "norm_ratio": math.sqrt(na / nb),
            "param_cosine_median": cosines[len(cosines) // 2], "param_cosine_min": cosines[0],
            "worst_params": worst, "sign_agreement": agree / total, "sign_agreement_weighted": weighted_agree / weight,
            "missing": missing}


def logp_stats(a: list[list[float]], b: list[list[float]]) -> dict:
    diffs = [x - y for ra, rb in zip(a, b) for x, y in zip(ra, rb)]
    if not diffs:
        return {}
    absd = sorted(abs(d) for d in diffs)
    return {"mean_diff": sum(diffs) / len(diffs), "mean_abs": sum(absd) / len(absd),
            "p90_abs": absd[int(0.9 * (len(absd) - 1))], "max_abs": absd[-1], "tokens": len(diffs)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("runs/grad_parity"))
    parser.add_argument("--trl-venv", type=Path,
                        default=Path(os.environ.get("LLAMARL_TRL_VENV", Path.home() / ".cache" / "llamarl" / "trl-venv")))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--lr", type=float, default=1.5e-5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--trl-side", choices=["trl", "trl_fp32"], help=argparse.SUPPRESS)
    parser.add_argument("--batch-dir", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.trl_side:
        trl_side(args.batch_dir, bf16=args.trl_side == "trl", name=args.trl_side)
        return

    sys.path.insert(0, str(REPO))
    import torch

    torch.set_num_threads(args.threads)
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    batch, record = make_batch(args, out)
    print(f"grad_parity: batch of {len(batch)} samples, rewards {sum(record['rewards']):.0f}/{len(batch)}, "
          f"{int(batch['loss_mask'].sum())} completion tokens", flush=True)
    # A rerun on the same batch (same seed and sizes) reuses the sides already computed.
    previous = json.loads((out / "sides.json").read_text()) if (out / "sides.json").exists() else {}
    if previous.get("batch") != record:
        previous = {"batch": record}
    results = previous.setdefault("results", {})

    def keep(name, compute):
        if name not in results or not (out / f"grad_{name}.safetensors").exists():
            results[name] = compute()
            (out / "sides.json").write_text(json.dumps(previous))
        return results[name]

    keep("reference", lambda: reference_side(args, out, batch))
    for name, dtype, ratio1 in (("llamarl", "bfloat16", False), ("llamarl_ratio1", "bfloat16", True),
                                ("llamarl_fp32", "float32", False)):
        keep(name, lambda name=name, dtype=dtype, ratio1=ratio1: llamarl_side(
            args, out, batch, name=name, param_dtype=dtype, ratio1=ratio1))
        print(f"grad_parity[{name}]: loss {results[name]['loss']:.6g}, grad norm {results[name]['grad_norm']:.6g}",
              flush=True)
    sys.path.insert(0, str(REPO / "benchmarks"))
    from vs_trl import ensure_trl_venv

    python = ensure_trl_venv(args.trl_venv)
    # Not the one-rank world's variables: accelerate would join (or re-make) it.
    world = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")
    env = {**{k: v for k, v in os.environ.items() if k not in world}, "OMP_NUM_THREADS": str(args.threads),
           "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1", "PYTHONPATH": ""}
    for side in ("trl", "trl_fp32"):
        subprocess.run([str(python), str(Path(__file__).resolve()), "--trl-side", side, "--batch-dir", str(out)],
                       env=env, check=True)
        results[side] = json.loads((out / f"{side}.json").read_text())
    behav = record["behav_logp"]
    ref_logp = results["reference"]["logp"]
    logps = {name: logp_stats(r["logp"], ref_logp) for name, r in results.items() if name != "reference"}
    logps["generator_bf16 (behaviour)"] = logp_stats(behav, ref_logp)
    logps["llamarl trainer vs generator (AIPO log-ratio)"] = logp_stats(results["llamarl"]["logp"], behav)
    ratios = [math.exp(x - y) for ra, rb in zip(results["llamarl"]["logp"], behav) for x, y in zip(ra, rb)]
    adv_l, adv_t = torch.tensor(results["reference"]["advantages"]), torch.tensor(results["trl"]["advantages"])
    signal = adv_l != 0
    pairs = [("llamarl", "trl"), ("llamarl", "reference"), ("trl", "reference"), ("trl_fp32", "reference"),
             ("llamarl_fp32", "reference"), ("llamarl_ratio1", "reference"), ("llamarl", "llamarl_ratio1"),
             ("trl", "trl_fp32"), ("llamarl_fp32", "trl_fp32")]
    comparisons = [compare(out, a, b) for a, b in pairs]
    summary = {
        "batch": {"samples": len(batch), "correct": sum(record["rewards"]),
                  "groups_with_signal": int(signal.reshape(-1, args.samples).any(dim=1).sum()),
                  "completion_tokens": int(batch["loss_mask"].sum())},
        "advantages": {"llamarl": results["llamarl"]["advantages"], "trl": results["trl"]["advantages"],
                       "trl_over_llamarl": float((adv_t[signal] / adv_l[signal]).mean()) if signal.any() else None},
        "trl_num_items_in_batch": results["trl"]["num_items_in_batch"],
        "trl_prompt_ids_match": results["trl"]["prompt_ids_match"],
        "trl_completion_ids_match": results["trl"]["completion_ids_match"],
        "loss": {name: r["loss"] for name, r in results.items()},
        "grad_norm": {name: r["grad_norm"] for name, r in results.items()},
        "logp_vs_fp32_reference": logps,
        "aipo_weight": {"mean": sum(ratios) / len(ratios), "min": min(ratios), "max": max(ratios),
                        "std": (sum((r - sum(ratios) / len(ratios)) ** 2 for r in ratios) / len(ratios)) ** 0.5},
        "llamarl_metrics": results["llamarl"]["metrics"],
        "comparisons": comparisons,
    }
    (out / "grad_parity.json").write_text(json.dumps(summary, indent=2))
    print(json.dumps({k: v for k, v in summary.items() if k not in ("advantages", "comparisons")}, indent=1))
    print(f"\nadvantages TRL / llamarl (samples with signal): {summary['advantages']['trl_over_llamarl']:.4f}")
    print("\n| a | b | cosine | norm a / b | per-param cosine median (min) | sign agreement | |b|-weighted |")
    print("|---|---|---|---|---|---|---|")
    for c in comparisons:
        print(f"| {c['a']} | {c['b']} | {c['cosine']:.4f} | {c['norm_ratio']:.4f} | {c['param_cosine_median']:.4f} "
              f"({c['param_cosine_min']:.4f}) | {c['sign_agreement']:.3f} | {c['sign_agreement_weighted']:.3f} |")


if __name__ == "__main__":
    main()
