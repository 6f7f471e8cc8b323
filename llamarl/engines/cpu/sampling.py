"""The sampler on the CPU: the general sampler (llamarl/engines/sampling.py) with C fast paths for
bf16 logits (``cpu_kernels.sample`` / ``cpu_kernels.softmax``, ``csrc/softmax.c``).

``sample_tokens_cpu`` has ``sample_tokens``'s contract and draws: the unfiltered draw at T = 1 of
bf16 CPU logits runs in C (the same inverse-CDF draw up to rounding at an interval's edge, the
log-prob within ~1e-6); every other case (greedy, filtered, another temperature or dtype, no
kernels here) is ``sample_tokens`` itself. ``TorchEngine`` samples through it when the logits are
on the CPU.
"""

from __future__ import annotations

import threading

import torch

from llamarl.engines.base import SamplingParams
from llamarl.engines.cpu import cpu_kernels
from llamarl.engines.sampling import draw_with_logprobs, sample_tokens, unfiltered

_scratch = threading.local()  # the C softmax's fp32 buffer, reused across steps (one per thread)
_SCRATCH_MAX = 16 * 2**20
"""Probabilities (fp32) up to which that buffer is kept between steps (64 MiB: 64 rows of a 256k
vocabulary); a larger batch's softmax writes a new tensor, whose page faults matter less there."""


def _softmax(logits: torch.Tensor) -> torch.Tensor:
    """``torch.softmax(logits, -1, dtype=torch.float32)``; for bf16 CPU logits through the C kernel
    (``cpu_kernels.softmax``, within ~2e-6 relative) into a per-thread buffer reused by the next
    call, so the result must be consumed before then (``sample_tokens_cpu`` does). Why: the fresh
    12.6 MB that torch.softmax allocates per step for 64 rows of a 49k vocabulary costs its page
    faults: 9 ms a step against 1.4 ms (one thread, Intel Xeon)."""
    if logits.dtype != torch.bfloat16 or logits.device.type != "cpu" or logits.dim() != 2 \
            or not cpu_kernels.available():
        return torch.softmax(logits, dim=-1, dtype=torch.float32)
    size = logits.numel()
    if size > _SCRATCH_MAX:  # kept for the next step only up to _SCRATCH_MAX: beyond, a new one each time
        return cpu_kernels.softmax(logits.contiguous())
    buffer = getattr(_scratch, "buffer", None)
    if buffer is None or buffer.numel() < size:
        buffer = _scratch.buffer = torch.empty(size, dtype=torch.float32, device=logits.device)
    return cpu_kernels.softmax(logits.contiguous(), out=buffer[:size].view(logits.shape))


def sample_tokens_cpu(
    logits: torch.Tensor, *, sampling: SamplingParams, uniforms: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
):
    """``sample_tokens`` (the same contract and draws; module docstring), with the unfiltered draw
    of bf16 CPU logits at T = 1 in C where the kernels are available."""
    # At T = 1 the general sampler draws from the logits as they are (bf16 here); at any other
    # temperature from logits.float() / T, which the C kernels do not take.
    if not (sampling.temperature == 1.0 and unfiltered(sampling, vocab=logits.shape[-1])
            and logits.dtype == torch.bfloat16 and logits.device.type == "cpu" and logits.dim() == 2
            and cpu_kernels.available()):
        return sample_tokens(logits, sampling=sampling, uniforms=uniforms, generator=generator)
    if uniforms is None:  # the general sampler's draw of one uniform per row
        uniforms = torch.rand(logits.shape[0], generator=generator, dtype=torch.float64, device=logits.device)
    # The draw and its log-prob in C without writing the probabilities (one pass for the max, one
    # for the block sums): 64 rows of a 49k vocabulary, one thread, 2.1 -> 1.2 ms.
    drawn = cpu_kernels.sample(logits.contiguous(), uniforms.to(torch.float64).contiguous())
    if drawn is not None:
        return drawn
    # A vocabulary over the C draw's 2M: the general draw, over the C softmax.
    return draw_with_logprobs(_softmax(logits), uniforms)
