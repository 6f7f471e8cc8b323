"""Peak host memory of the trainer's log-probs, whole micro-batch vs token chunks (CPU).

Not a test. Usage::

    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/logprob_memory.py [--tokens 2048] [--vocab 151936] \
        [--chunks 0,1024,256]

One forward and backward of ``completion_logprobs`` (the trainer's per-row path) over one row of
``--tokens`` tokens (a 1-token prompt, the rest the completion) on a random-init Llama of SmolLM2's
width (hidden 576, 9 heads / 3 KV heads, MLP 1536) with ``--layers`` layers and a ``--vocab``-id
vocabulary (151,936: Qwen2/3's), fp32, untied. Each ``--chunks`` value (``--trainer.logprob-chunk-tokens``;
0 = the whole micro-batch at once) runs in a fresh process, which reports its peak resident memory
(``ru_maxrss``) after the model and inputs exist and after the backward: the difference is the
log-probs' own peak, of which the parameter gradients (the same in every variant; the embedding's and
the LM head's dominate at this vocabulary) are given apart. The bound printed beside it is one fp32 copy of the micro-batch's logits
(``tokens x vocab x 4`` bytes), what the unchunked path materialises at least once, computed, not
measured. Every variant's log-prob sum and LM-head gradient norm must equal the unchunked one's
(rel. 1e-4), or the run fails: the memory saved is for the same result.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _peak_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def worker(args: argparse.Namespace) -> dict:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from llamarl.models.logprobs import completion_logprobs

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=args.vocab, hidden_size=576, intermediate_size=1536,
                         num_hidden_layers=args.layers, num_attention_heads=9, num_key_value_heads=3,
                         max_position_embeddings=args.tokens + 8, tie_word_embeddings=False)
    model = LlamaForCausalLM(config).to(torch.float32).train()
    ids = torch.randint(0, args.vocab, (1, args.tokens), generator=torch.Generator().manual_seed(1))
    attention = torch.ones_like(ids)
    before = _peak_mib()
    start = time.perf_counter()
    logp = completion_logprobs(model, ids, attention, start=1, temperature=1.0, chunk_tokens=args.chunk)
    logp.sum().backward()
    seconds = time.perf_counter() - start
    return {"chunk": args.chunk, "peak_mib": _peak_mib() - before, "seconds": seconds,
            "logp_sum": float(logp.sum()), "head_grad_norm": float(model.lm_head.weight.grad.norm()),
            "tokens": int(logp.shape[1]) - 1,
            "grad_mib": sum(p.grad.numel() * p.grad.element_size() for p in model.parameters()) / 2**20}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--vocab", type=int, default=151_936)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--chunks", default="0,1024,256")
    parser.add_argument("--chunk", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(args)))
        return
    chunks = [int(c) for c in args.chunks.split(",")]
    if chunks[0] != 0:
        raise SystemExit("--chunks must start with 0 (the unchunked reference)")
    rows = []
    for chunk in chunks:
        out = subprocess.run([sys.executable, __file__, "--worker", "--chunk", str(chunk), "--tokens", str(args.tokens),
                              "--vocab", str(args.vocab), "--layers", str(args.layers)],
                             capture_output=True, text=True, check=True)
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
    reference = rows[0]
    for row in rows[1:]:
        for key in ("logp_sum", "head_grad_norm"):
            if abs(row[key] - reference[key]) > 1e-4 * abs(reference[key]):
                raise SystemExit(f"chunk {row['chunk']}: {key} {row[key]} != {reference[key]} (unchunked)")
    bound = args.tokens * args.vocab * 4 / 2**20
    print(f"{args.tokens} tokens x {args.vocab} ids; one fp32 copy of the logits = {bound:.0f} MiB")
    print("| --trainer.logprob-chunk-tokens | peak MiB (fwd + bwd) | of which parameter gradients | rest | "
          "rest x one logits copy | seconds |")
    print("|---|---|---|---|---|---|")
    for row in rows:
        rest = row["peak_mib"] - row["grad_mib"]
        print(f"| {row['chunk'] or 'whole (0)'} | {row['peak_mib']:.0f} | {row['grad_mib']:.0f} | {rest:.0f} | "
              f"{rest / bound:.2f} | {row['seconds']:.2f} |")


if __name__ == "__main__":
    main()
