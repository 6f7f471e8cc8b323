"""Peak private memory of a trainer rank while its model loads: whole then sharded, vs shard by shard.

Not a test. Usage::

    .venv/bin/python benchmarks/load_memory.py [--ranks 4] [--layers 24] [--hidden 1024] [--out DIR]

Writes a random-init Llama (``--hidden`` wide, ``--layers`` deep, 32,000-id vocabulary, untied) as a
bf16 safetensors checkpoint, as Llama / Qwen / Mistral checkpoints ship, and loads it into fp32
FSDP2 master weights (the trainer's default ``--model.dtype float32``) on ``--ranks`` gloo ranks two
ways, each in its own torchrun world: ``full`` (``load_causal_lm`` then ``shard_model``: what the
trainer did before ``llamarl/models/sharded_loading.py``) and ``sharded``
(``load_sharded_causal_lm``). Each rank samples its anonymous resident memory (``RssAnon``: private
pages, not the page cache a memory-mapped checkpoint occupies) every 5 ms while it loads and
reports the peak above what it held before. The bound printed beside it is one rank's share of the
fp32 model (the parameters' bytes / ranks). Each world also checks its gathered weights against the
checkpoint's, cast to fp32, so both ways loaded the same model.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _anon_mib() -> float:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no RssAnon in /proc/self/status (Linux only)")


def worker(mode: str, path: str) -> None:
    import threading
    import time

    import torch
    import torch.distributed as dist
    from safetensors.torch import load_file
    from torch.distributed.device_mesh import init_device_mesh

    from llamarl.models.loading import load_causal_lm
    from llamarl.models.sharded_loading import load_sharded_causal_lm
    from llamarl.models.sharding import full_named_parameters, shard_model

    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    peak, done = [0.0], threading.Event()

    def poll() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], _anon_mib())
            time.sleep(0.005)

    base = _anon_mib()
    thread = threading.Thread(target=poll, daemon=True)
    thread.start()
    if mode == "sharded":
        model, _ = load_sharded_causal_lm(path, dtype=torch.float32, mesh=mesh, device=torch.device("cpu"))
    else:
        model, _ = load_causal_lm(path, dtype=torch.float32)
        model = shard_model(model, mesh)
    done.set()
    thread.join()
    full = full_named_parameters(model)  # collective; after the measurement
    same = True
    if dist.get_rank() == 0:
        expected = load_file(str(Path(path) / "model.safetensors"))
        same = all(torch.equal(full[name], tensor.float()) for name, tensor in expected.items())
    num_bytes = sum(p.numel() * 4 for p in full.values())
    print(json.dumps({"rank": dist.get_rank(), "peak_mib": peak[0] - base, "same": same,
                      "fp32_mib": num_bytes / 2**20}), flush=True)
    # Every rank done before any tears the group down. Then leave without the interpreter's
    # teardown: with the sampling thread, one rank in a few aborted there ("terminate called without
    # an active exception", after its report was printed) under both loads; the trainer's own
    # worlds end through ExecutorContext.destroy and have not shown it.
    del model, full
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--out", type=Path, default=None, help="where the checkpoint goes (default: a temp dir)")
    parser.add_argument("--worker", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(*args.worker)
        return
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from tests.tiny_model import tiny_tokenizer

    out = args.out or Path(tempfile.mkdtemp(prefix="load-memory-"))
    config = LlamaConfig(vocab_size=32_000, hidden_size=args.hidden, intermediate_size=args.hidden * 11 // 4,
                         num_hidden_layers=args.layers, num_attention_heads=args.hidden // 64,
                         num_key_value_heads=max(args.hidden // 256, 1), tie_word_embeddings=False)
    torch.manual_seed(0)
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(out, safe_serialization=True)
    tiny_tokenizer().save_pretrained(out)
    rows = {}
    for mode in ("full", "sharded"):
        proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                               f"--nproc-per-node={args.ranks}", __file__, "--worker", mode, str(out)],
                              capture_output=True, text=True, check=False, cwd=ROOT,
                              env={**os.environ, "OMP_NUM_THREADS": "1",
                                   "PYTHONPATH": str(ROOT)})
        if proc.returncode != 0:
            raise SystemExit(f"the {mode} world failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
        reports = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
        if len(reports) != args.ranks or not all(r["same"] for r in reports):
            raise SystemExit(f"{mode}: {len(reports)} reports of {args.ranks}, or weights differ from the checkpoint")
        rows[mode] = reports
    share = rows["full"][0]["fp32_mib"] / args.ranks
    print(f"{rows['full'][0]['fp32_mib']:.0f} MiB of fp32 parameters (bf16 checkpoint) on {args.ranks} ranks; "
          f"one rank's share {share:.0f} MiB")
    print("| load | peak private MiB per rank (max over ranks) | x one rank's share |")
    print("|---|---|---|")
    for mode, reports in rows.items():
        peak = max(r["peak_mib"] for r in reports)
        print(f"| {mode} | {peak:.0f} | {peak / share:.2f} |")


if __name__ == "__main__":
    main()
