"""What checkpoint digests cost (llamarl/runtime/checkpoint_files.py): a real trainer checkpoint of
SmolLM2-135M (fp32 weights + AdamW state, ``save_sharded_state``) written with and without its
digests, then verified ``full`` and ``size`` (``verify_checkpoint``), in one invocation, median of
repeats; the 7B figure is the measured full-verify throughput applied to a 7B checkpoint's bytes.

usage: .venv/bin/python benchmarks/checkpoint_verify.py [--repeats 3] [--threads 4]

Prints JSON: bytes, save seconds without / with digests (``digest_overhead`` their ratio), verify
seconds and GB/s for ``full`` and ``size``, and the 7B estimate. Reads are warm (the files were just
written, so they are in the page cache) unless ``--drop-caches`` works here (root, not a container):
a cold verify is bound by the disk's read speed, which the JSON then reports too.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from llamarl.models.loading import resolve_model_path
from llamarl.runtime.checkpoint_files import collect_files, recording, verify_checkpoint
from llamarl.runtime.sharded_state import save_sharded_state

SEVEN_B_PARAMS = 7.6e9  # Qwen2.5-7B
BYTES_PER_PARAM = 4 + 8  # fp32 master weights + AdamW's two fp32 moments


def build():
    model = AutoModelForCausalLM.from_pretrained(resolve_model_path("smollm2-135m-instruct"), dtype=torch.float32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    for p in model.parameters():
        p.grad = torch.randn_like(p) * 1e-3
    optimizer.step()  # AdamW state exists, as in any checkpoint after the first update
    return model, optimizer


def save(root: Path, model, optimizer, *, digests: bool) -> tuple[float, dict | None]:
    if root.exists():
        shutil.rmtree(root)
    start = time.perf_counter()
    if digests:
        with recording(root, rank=0):
            save_sharded_state(root / "trainer" / "state", model=model, optimizer=optimizer, rank=0, world_size=1)
        files = collect_files(root)
    else:
        save_sharded_state(root / "trainer" / "state", model=model, optimizer=optimizer, rank=0, world_size=1)
        files = None
    return time.perf_counter() - start, files


def drop_caches() -> bool:
    try:
        subprocess.run(["sync"], check=True)
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=4, help="verify's reader threads")
    parser.add_argument("--drop-caches", action="store_true", help="also time a cold verify (needs root)")
    args = parser.parse_args()
    model, optimizer = build()
    with tempfile.TemporaryDirectory(dir=".") as tmp:
        root = Path(tmp) / "step_1"
        plain, hashed, full, size, cold = [], [], [], [], []
        for _ in range(args.repeats):  # interleaved: plain and hashed saves see the same machine state
            plain.append(save(root, model, optimizer, digests=False)[0])
            seconds, files = save(root, model, optimizer, digests=True)
            hashed.append(seconds)
            marker = {"hash": "xxh3_128", "files": files}
            start = time.perf_counter()
            assert verify_checkpoint(root, marker, mode="full", threads=args.threads)
            full.append(time.perf_counter() - start)
            start = time.perf_counter()
            assert verify_checkpoint(root, marker, mode="size", threads=args.threads)
            size.append(time.perf_counter() - start)
            if args.drop_caches and drop_caches():
                start = time.perf_counter()
                assert verify_checkpoint(root, marker, mode="full", threads=args.threads)
                cold.append(time.perf_counter() - start)
        total = sum(entry["bytes"] for entry in files.values())
    full_s = statistics.median(full)
    report = {
        "model": "SmolLM2-135M fp32 + AdamW", "bytes": total, "files": len(files), "repeats": args.repeats,
        "save_seconds_plain": statistics.median(plain), "save_seconds_with_digests": statistics.median(hashed),
        "digest_overhead": statistics.median(hashed) / statistics.median(plain),
        "verify_full_seconds": full_s, "verify_full_gb_per_s": total / full_s / 1e9,
        "verify_size_seconds": statistics.median(size),
        "verify_full_cold_seconds": statistics.median(cold) if cold else None,
        "seven_b_bytes": SEVEN_B_PARAMS * BYTES_PER_PARAM,
        "seven_b_verify_full_seconds_warm_estimate": SEVEN_B_PARAMS * BYTES_PER_PARAM / (total / full_s),
    }
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
