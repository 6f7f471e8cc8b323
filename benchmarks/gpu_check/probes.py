"""The GPU's own numbers every figure is divided by, measured in the same process and minutes:
device copy bandwidth (GB/s, read + write), bf16 GEMM TFLOPS, and microseconds per kernel of a
replayed CUDA graph (the floor of a step bound by its kernel count). On the CPU (``--smoke``) the
same code runs with the wall clock and without a graph, so the dry run covers it; its numbers mean
nothing."""

from __future__ import annotations

import time


def _timed(fn, *, device: str, repeats: int) -> float:
    """Median seconds of ``fn()`` over ``repeats`` runs after one warm-up (CUDA events on a GPU)."""
    import torch

    fn()
    times = []
    for _ in range(repeats):
        if device.startswith("cuda"):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1000)
        else:
            begin = time.perf_counter()
            fn()
            times.append(time.perf_counter() - begin)
    return sorted(times)[len(times) // 2]


def copy_bandwidth_gbps(device: str, nbytes: int, repeats: int = 10) -> float:
    """GB/s of a ``nbytes`` device-to-device copy, counting its read and its write."""
    import torch

    src = torch.ones(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    seconds = _timed(lambda: dst.copy_(src), device=device, repeats=repeats)
    return 2 * nbytes / max(seconds, 1e-9) / 1e9


def gemm_tflops(device: str, size: int, *, dtype: str = "bfloat16", repeats: int = 10) -> float:
    """TFLOPS of a ``size`` x ``size`` x ``size`` matmul in ``dtype`` (2 size^3 FLOPs)."""
    import torch

    a = torch.randn(size, size, device=device).to(getattr(torch, dtype))
    b = torch.randn(size, size, device=device).to(getattr(torch, dtype))
    out = torch.empty_like(a)
    seconds = _timed(lambda: torch.mm(a, b, out=out), device=device, repeats=repeats)
    return 2 * size**3 / max(seconds, 1e-12) / 1e12


def us_per_replayed_kernel(device: str, kernels: int, repeats: int = 10) -> float:
    """Microseconds per kernel of a CUDA graph of ``kernels`` tiny dependent kernels (an in-place
    add on 256 floats each), replayed: what a step bound by its kernel count pays per kernel. On
    the CPU: per eager op, no graph."""
    import torch

    x = torch.zeros(256, device=device)
    if not device.startswith("cuda"):
        def ops():
            for _ in range(kernels):
                x.add_(1.0)
        return 1e6 * _timed(ops, device=device, repeats=repeats) / kernels
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        x.add_(1.0)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(kernels):
            x.add_(1.0)
    seconds = _timed(graph.replay, device=device, repeats=repeats)
    del graph
    return 1e6 * seconds / kernels


def probes(device: str, *, copy_bytes: int, gemm_size: int, replay_kernels: int) -> dict:
    """All three, with their sizes: ``{copy_gbps, gemm_tflops, us_per_kernel, ...}``."""
    return {"copy_bytes": copy_bytes, "copy_gbps": copy_bandwidth_gbps(device, copy_bytes),
            "gemm_size": gemm_size, "gemm_tflops": gemm_tflops(device, gemm_size),
            "replay_kernels": replay_kernels, "us_per_kernel": us_per_replayed_kernel(device, replay_kernels)}
