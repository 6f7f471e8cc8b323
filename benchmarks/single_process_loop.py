"""The "60-line single-process loop a user could write": the external baseline of async_speedup.py.

    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/single_process_loop.py --out runs/async_speedup/single_loop

Deliberately outside the library: HF ``generate`` sampling (temperature 1.0, top-k / top-p off) on
the training model itself, group-normalised REINFORCE (advantage ``(r - mean_g) / (std_g + 1e-6)``
over each prompt's samples, no importance weight, one update per batch: on-policy), token-mean loss
over the completion tokens (up to and including the first EOS), fp32 weights, ``torch.optim.AdamW``
lr 1e-5 (no weight decay), gradient-norm clip 1.0, ``--threads`` torch threads. Same task and prompts
as ``recipes.arithmetic``: ``ArithmeticTask(seed).sample(step * prompts + i)`` in the recipe's chat
format (``recipes.arithmetic.prompt_fn``), scored by ``llamarl.rewards.arithmetic.score``; greedy
accuracy every ``--eval-every`` steps on ``ArithmeticTask.heldout(100)``, the problems the llamarl
runs evaluate on. Every step's seconds exclude evaluations (and the model load), so
``time_to_target_s`` is comparable with the llamarl runs' training seconds.

Writes ``<out>/single_loop.json``: per-step seconds, completion tokens, reward; the evaluations
(step, train_seconds, wall_seconds, accuracy) and the time to ``--target``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))


def left_pad(seqs: list[list[int]], pad: int):
    """``(input_ids, attention_mask)`` of ``seqs`` padded on the left (what ``generate`` expects)."""
    import torch

    width = max(map(len, seqs))
    ids = torch.full((len(seqs), width), pad, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, width - len(s):] = torch.tensor(s)
        mask[i, width - len(s):] = 1
    return ids, mask


def completion_mask(completion, eos: int):
    """1 on the completion's tokens up to and including its first EOS, 0 after (generate pads with EOS)."""
    is_eos = completion == eos
    seen = is_eos.long().cumsum(1)
    return ((seen == 0) | ((seen == 1) & is_eos)).long()


def group_advantages(rewards, samples: int, eps: float = 1e-6):
    groups = rewards.view(-1, samples)
    return ((groups - groups.mean(1, keepdim=True)) / (groups.std(1, unbiased=False, keepdim=True) + eps)).view(-1)


def run(args) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from llamarl.data.arithmetic import ArithmeticTask
    from llamarl.models.loading import resolve_model_path
    from llamarl.rewards.arithmetic import score
    from recipes.arithmetic import prompt_fn

    wall_start = time.time()
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    path = resolve_model_path(args.model)
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    eos = tok.eos_token_id
    pad = tok.pad_token_id if tok.pad_token_id is not None else eos
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    task = ArithmeticTask(num_digits=2, seed=args.seed)
    heldout = task.heldout(args.heldout)
    load_seconds = time.time() - wall_start

    def sample(prompts, *, greedy: bool):
        ids, attn = left_pad(prompts, pad)
        kwargs = {"do_sample": False} if greedy else {"do_sample": True, "temperature": args.temperature,
                                                      "top_k": 0, "top_p": 1.0}
        with torch.no_grad():
            out = model.generate(input_ids=ids, attention_mask=attn, max_new_tokens=args.max_new_tokens,
                                 pad_token_id=pad, **kwargs)
        return ids, attn, out[:, ids.shape[1]:]

    def evaluate() -> float:
        model.eval()
        _, _, comp = sample([prompt_fn(tok, p.question) for p in heldout], greedy=True)
        texts = tok.batch_decode(comp, skip_special_tokens=True)
        return sum(score(t, p.answer) for t, p in zip(texts, heldout)) / len(heldout)

    evals, steps, train_seconds = [], [], 0.0

    def record_eval(step: int) -> None:
        accuracy = evaluate()
        evals.append({"step": step, "train_seconds": train_seconds, "wall_seconds": time.time() - wall_start,
                      "accuracy": accuracy})
        print(f"single_loop: step {step}: held-out greedy accuracy {accuracy:.2f} "
              f"({train_seconds:.0f} s of training)", flush=True)

    record_eval(0)
    for step in range(args.steps):
        t0 = time.perf_counter()
        problems = [task.sample(step * args.prompts + i) for i in range(args.prompts)]
        prompts = [prompt_fn(tok, p.question) for p in problems for _ in range(args.samples)]
        ids, attn, comp = sample(prompts, greedy=False)
        t_gen = time.perf_counter()
        texts = tok.batch_decode(comp, skip_special_tokens=True)
        rewards = torch.tensor([score(t, p.answer) for t, p in zip(texts, (p for p in problems
                                                                          for _ in range(args.samples)))])
        adv = group_advantages(rewards, args.samples)
        t_score = time.perf_counter()
        model.train()
        cmask = completion_mask(comp, eos)
        full, full_attn = torch.cat([ids, comp], 1), torch.cat([attn, cmask], 1)
        positions = (full_attn.cumsum(1) - 1).clamp(min=0)
        logits = model(input_ids=full, attention_mask=full_attn, position_ids=positions).logits
        logits = logits[:, ids.shape[1] - 1:-1].float() / args.temperature
        logp = logits.log_softmax(-1).gather(-1, comp.unsqueeze(-1)).squeeze(-1)
        loss = -(adv[:, None] * logp * cmask).sum() / cmask.sum().clamp(min=1)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        t_end = time.perf_counter()
        train_seconds += t_end - t0
        steps.append({"step": step, "seconds": t_end - t0, "gen_seconds": t_gen - t0, "reward_seconds": t_score - t_gen,
                      "train_seconds": t_end - t_score, "completion_tokens": int(cmask.sum()),
                      "samples": len(prompts), "reward_mean": float(rewards.mean()), "loss": float(loss)})
        print(f"single_loop: step {step}: {t_end - t0:.1f} s, reward {rewards.mean():.2f}", flush=True)
        if (step + 1) % args.eval_every == 0 or step + 1 == args.steps:
            record_eval(step + 1)
    reached = [e for e in evals if e["accuracy"] >= args.target]
    return {"system": "single-process loop (HF generate + REINFORCE, fp32)", "args": vars(args) | {"out": str(args.out)},
            "load_seconds": load_seconds, "steps": steps, "evals": evals, "target": args.target,
            "time_to_target_s": reached[0]["train_seconds"] if reached else None,
            "wall_to_target_s": reached[0]["wall_seconds"] if reached else None,
            "steps_to_target": reached[0]["step"] if reached else None,
            "final_accuracy": evals[-1]["accuracy"], "wall_seconds": time.time() - wall_start}


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True, help="directory for single_loop.json")
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--samples", type=int, default=4)
    p.add_argument("--max-new-tokens", type=int, default=12)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--eval-every", type=int, default=5)
    p.add_argument("--heldout", type=int, default=100)
    p.add_argument("--target", type=float, default=0.70)
    p.add_argument("--seed", type=int, default=0)
    return p


def main() -> None:
    args = parser().parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    result = run(args)
    (args.out / "single_loop.json").write_text(json.dumps(result, indent=2))
    print(f"single_loop: final accuracy {result['final_accuracy']:.2f}; time to {args.target:.2f}: "
          f"{result['time_to_target_s']} s of training", flush=True)


if __name__ == "__main__":
    main()
