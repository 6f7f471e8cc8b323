"""The trainer's metrics: what each one reduces to over ranks (``TRAINER_METRICS``), how the
minibatches of one batch combine into the batch's record (``combine_minibatch_metrics``), and the
device-side timer behind ``prox_seconds`` (``device_timer``)."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from llamarl.boxes import local_tensor
from llamarl.metrics import MetricSpec

__all__ = ["TRAINER_METRICS", "combine_minibatch_metrics", "device_timer", "state_bytes"]

# The step reduces these over the trainer's ranks itself (identical on every rank: "max" keeps them),
# except this rank's throughput, which the runner sums.
TRAINER_METRICS = {
    **{key: MetricSpec("optim", "max") for key in ("grad_norm", "version", "optimizer_steps", "num_minibatches",
                                                   "nonfinite_steps", "skipped", "skipped_no_signal",
                                                   "skipped_nonfinite")},
    **{key: MetricSpec("data", "max") for key in ("num_loss_tokens", "zero_advantage_samples",
                                                  "dropped_stale_samples")},
    "staleness_mean": MetricSpec("staleness", "max"), "staleness_max": MetricSpec("staleness", "max"),
    "loss": MetricSpec("loss", "max"),
    "train_seconds": MetricSpec("throughput", "max"), "train_tokens_per_s": MetricSpec("throughput", "sum"),
    # Time this rank spent producing proximal log-probs (recompute: the extra forward; loglinear:
    # A-3PO's interpolation inside each micro-batch). Only for losses that use a proximal policy.
    "prox_seconds": MetricSpec("throughput", "max"),
    # Parameters, gradients and optimizer state this rank holds after the step (local shards), MiB,
    # summed over the trainer's ranks: what LoRA shrinks (the base has neither gradients nor moments).
    "state_mib": MetricSpec("memory", "sum"),
}

_SUMMED = frozenset({"num_loss_tokens", "dropped_stale_samples", "zero_advantage_samples", "skipped",
                     "skipped_no_signal", "skipped_nonfinite"})
_LAST = frozenset({"version", "nonfinite_steps"})


def state_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """Bytes of ``model``'s parameters and gradients and ``optimizer``'s state on this rank (each
    DTensor's local shard; a tied parameter once)."""
    total = 0
    for param in model.parameters():
        total += local_tensor(param).numel() * param.element_size()
        if param.grad is not None:
            total += local_tensor(param.grad).numel() * param.grad.element_size()
    for entries in optimizer.state.values():
        for value in entries.values():
            if isinstance(value, torch.Tensor):
                total += local_tensor(value).numel() * value.element_size()
    return total


def combine_minibatch_metrics(results: list[dict[str, float]], *, loss_metrics: dict[str, str]) -> dict[str, float]:
    """Per-batch metrics from the minibatches' (in order). ``loss_metrics`` maps the policy loss's
    declared metrics to their reduction (``mean`` / ``max`` / ``sum``).

    Counts (tokens, dropped, zero-advantage and skipped samples or steps, ``sum`` metrics) are
    summed; ``max`` metrics and ``staleness_max`` are maxima; ``staleness_mean`` is over every
    trained token (weighted by each minibatch's ``num_loss_tokens``); ``version`` and
    ``nonfinite_steps`` are the last; the rest (loss, grad norm, ``mean`` metrics) are means over
    the minibatches that report them (those with an optimizer step).
    """
    summed = _SUMMED | {k for k, v in loss_metrics.items() if v == "sum"}
    maxed = {"staleness_max"} | {k for k, v in loss_metrics.items() if v == "max"}
    out: dict[str, float] = {}
    for key in sorted({k for r in results for k in r}):
        values = [r[key] for r in results if key in r]
        if key in summed:
            out[key] = float(sum(values))
        elif key in maxed:
            out[key] = float(max(values))
        elif key in _LAST:
            out[key] = values[-1]
        elif key == "staleness_mean":
            tokens = [r["num_loss_tokens"] for r in results if key in r]
            out[key] = sum(v * t for v, t in zip(values, tokens)) / max(sum(tokens), 1.0)
        else:
            out[key] = sum(values) / len(values)
    return out


def device_timer(device: torch.device) -> Callable[[], Callable[[], float]]:
    """Start timing work on ``device``; calling the returned ``stop()`` ends the span and returns a
    zero-argument callable giving its seconds, read after the step (on CUDA from events, so no host
    sync in the middle of the step; elsewhere from the host clock)."""
    if device.type != "cuda":
        start = time.perf_counter()

        def stop_host() -> Callable[[], float]:
            elapsed = time.perf_counter() - start
            return lambda: elapsed
        return stop_host
    begin = torch.cuda.Event(enable_timing=True)
    begin.record()

    def stop() -> Callable[[], float]:
        end = torch.cuda.Event(enable_timing=True)
        end.record()

        def seconds() -> float:
            end.synchronize()
            return begin.elapsed_time(end) / 1000
        return seconds
    return stop
