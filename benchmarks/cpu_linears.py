"""The linear layers of one decode step on CPU: the C GEMM (``cpu_kernels.linear``) against oneDNN.

Not a test. Usage::

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/cpu_linears.py --rows 1,16,64 [--threads 1]

Runs every projection of a SmolLM2-135M decode step (``FusedDecoder``'s fused q/k/v, o, gate/up and
down of each layer, then the LM head), once per timed pass, at each row count: PyTorch as the fused
step runs it without the C GEMM (oneDNN over its pre-packed weights, ``_linear_pointwise``; at one
row ``F.linear``, see ``fused_decode._Linear``) and the AVX512-BF16 GEMM over its packed weights,
interleaved, median of ``--repeats``.
The weights are the checkpoint's own (269 MB: they stream from memory each pass, as in a step). The
bound is the same as ``generation.py --decode-scaling``'s, measured in this invocation: the weight
bytes over the read probe, or the FLOPs over the matmul probe, the larger. Each pass's outputs are
checked against the other path's (bf16 rounding apart), so a timing of nothing fails.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from generation import bound_ms, hardware_bound

from llamarl.engines.cpu import cpu_kernels
from llamarl.models import load_causal_lm


def step_weights(model) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
    """The (weight, bias) of every projection a fused decode step runs, in its order."""
    fused = []
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        for parts in ((attn.q_proj, attn.k_proj, attn.v_proj), (attn.o_proj,), (mlp.gate_proj, mlp.up_proj),
                      (mlp.down_proj,)):
            weight = torch.cat([p.weight for p in parts]).contiguous()
            biases = [p.bias for p in parts]
            fused.append((weight, None if biases[0] is None else torch.cat(biases)))
    fused.append((model.lm_head.weight.contiguous(), model.lm_head.bias))
    return fused


def time_linears(weights, *, rows: int, repeats: int) -> tuple[float, float]:
    """Median ms of one pass over ``weights`` at ``rows`` rows: (PyTorch, C GEMM)."""
    onednn = [torch.ops.mkldnn._reorder_linear_weight(w, rows) for w, _ in weights]
    packed = [cpu_kernels.pack(w) for w, _ in weights]
    inputs = {w.shape[1]: torch.randn(rows, w.shape[1], generator=torch.Generator().manual_seed(rows),
                                      device="cpu").to(torch.bfloat16) for w, _ in weights}

    def run_onednn():
        if rows == 1:  # what FusedDecoder runs there (fused_decode._Linear: oneDNN's pre-packed is slow)
            return [torch.nn.functional.linear(inputs[w.shape[1]], w, b) for w, b in weights]
        return [torch.ops.mkldnn._linear_pointwise(inputs[w.shape[1]], p, b, "none", [], "")
                for (w, b), p in zip(weights, onednn)]

    def run_gemm():
        return [cpu_kernels.linear(inputs[w.shape[1]], p, b) for (w, b), p in zip(weights, packed)]

    seconds: dict[str, list[float]] = {"onednn": [], "gemm": []}
    for _ in range(repeats):
        results = {}
        for name, run in (("onednn", run_onednn), ("gemm", run_gemm)):
            start = time.perf_counter()
            results[name] = run()
            seconds[name].append(time.perf_counter() - start)
        for ours, theirs in zip(results["gemm"], results["onednn"]):
            if ours.shape != (rows, theirs.shape[1]) or not torch.allclose(ours.float(), theirs.float(),
                                                                           rtol=2e-2, atol=2e-2):
                raise RuntimeError(f"the C GEMM and oneDNN disagree at {rows} rows: the timing is not of "
                                   "the same computation")
    return tuple(1000 * statistics.median(seconds[name]) for name in ("onednn", "gemm"))


def main() -> None:
    """Print the table (module docstring)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--rows", default="1,16,64", help="comma-separated row counts")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    if not cpu_kernels.gemm_available():
        raise SystemExit("the C GEMM needs a CPU with AVX512-BF16 and a C compiler (cpu_kernels.gemm_available())")
    torch.set_num_threads(args.threads)
    model, _ = load_causal_lm(args.model, dtype=torch.bfloat16)
    weights = step_weights(model)
    bound = hardware_bound(model)
    print(f"all linears of a decode step ({len(weights)} matmuls), {args.threads} threads, median of {args.repeats}")
    print(f"bound probes: {bound['read_gbps']:.1f} GB/s reading, {bound['matmul_gflops']:.0f} GFLOPS matmul")
    print(f"{'rows':>6} {'PyTorch ms':>10} {'GEMM ms':>8} {'speed-up':>9} {'bound ms':>9} {'GEMM x bound':>13}")
    for rows in sorted(int(r) for r in args.rows.split(",")):
        onednn_ms, gemm_ms = time_linears(weights, rows=rows, repeats=args.repeats)
        least = bound_ms(bound, rows)
        print(f"{rows:>6} {onednn_ms:>10.1f} {gemm_ms:>8.1f} {onednn_ms / gemm_ms:>8.2f}x {least:>9.1f} "
              f"{gemm_ms / least:>13.2f}")


if __name__ == "__main__":
    main()
