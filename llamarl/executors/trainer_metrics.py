"""The trainer's metrics: what each one reduces to over ranks (``TRAINER_METRICS``), how the
minibatches of one batch combine into the batch's record (``combine_minibatch_metrics``), the
device-side sums of an optimizer step and its one host read (``accumulate_on_device``,
``read_step``), and the device-side timer behind ``prox_seconds`` (``device_timer``)."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist

from llamarl.runtime.boxes import local_tensor
from llamarl.runtime.metrics import MetricSpec

__all__ = ["ENTROPY_SUM", "TRAINER_METRICS", "CompileClock", "accumulate_on_device", "combine_minibatch_metrics", "device_timer",
           "read_step", "state_bytes"]

ENTROPY_SUM = "_entropy_sum"
"""The key of the step's entropy sum over its loss tokens in ``accumulate_on_device``'s sums."""

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
    # The learning rate of the step's (last) optimizer step (--trainer.lr-schedule).
    "lr": MetricSpec("optim", "max"),
    # The policy's entropy -sum_v p_v log p_v (after the temperature), mean over the loss tokens trained on.
    "entropy": MetricSpec("loss", "max"),
    "train_seconds": MetricSpec("throughput", "max"), "train_tokens_per_s": MetricSpec("throughput", "sum"),
    # The micro-batches' matmul FLOPs (llamarl/models/flops.py: each token once, shared prompts once,
    # the pairs each token attends to) over the step's seconds, and over the device's bf16 peak
    # where it is known (llamarl/models/flops.py's table; none on a CPU).
    "train_tflops_per_s": MetricSpec("throughput", "sum"), "trainer_mfu": MetricSpec("throughput", "mean"),
    # Time this rank spent producing proximal log-probs (recompute: the extra forward; loglinear:
    # A-3PO's interpolation inside each micro-batch). Only for losses that use a proximal policy.
    "prox_seconds": MetricSpec("throughput", "max"),
    # Parameters, gradients and optimizer state this rank holds after the step (local shards), MiB,
    # summed over the trainer's ranks: what LoRA shrinks (the base has neither gradients nor moments).
    "state_mib": MetricSpec("memory", "sum"),
    # --trainer.compile layers: seconds this step spent compiling (dynamo, the backend, a lazy
    # backward), reported on the steps that compiled (the first; a recompile's); the slowest rank's.
    "compile_seconds": MetricSpec("throughput", "max"),
}

_SUMMED = frozenset({"num_loss_tokens", "dropped_stale_samples", "zero_advantage_samples", "skipped",
                     "skipped_no_signal", "skipped_nonfinite"})
_LAST = frozenset({"version", "nonfinite_steps", "lr"})


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


def _on(device: torch.device, value) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        return value.detach().to(device=device, dtype=torch.float64)
    return torch.tensor(float(value), dtype=torch.float64, device=device)


def accumulate_on_device(update, sums: dict, maxes: dict, metrics: dict, loss: torch.Tensor,
                         num_tokens: float) -> None:
    """``PolicyUpdate.accumulate`` (``update``) without reading anything: one micro-batch with
    ``num_tokens`` loss tokens (a host count) added to ``sums`` / ``maxes`` as float64 device
    scalars: ``loss``, ``metric_tokens``, and each declared metric, ``mean`` ones weighted by
    ``num_tokens``, ``sum`` ones added, ``max`` ones by ``torch.maximum``. Float64 in the same order
    as the host version, so the values read at the step's end are the same. A metric the loss did
    not declare is a ValueError."""
    device = loss.device
    for key, value in metrics.items():
        reduction = update.loss.metrics.get(key)
        if reduction is None:
            raise ValueError(f"policy loss {update.loss.name!r} reported metric {key!r} it did not declare "
                             f"(declared: {sorted(update.loss.metrics)})")
        value = _on(device, value)
        if reduction == "max":
            maxes[key] = torch.maximum(maxes[key], value) if key in maxes else value
        elif reduction == "sum":
            sums[key] = sums.get(key, 0.0) + value
        else:  # token-weighted mean
            sums[key] = sums.get(key, 0.0) + value * num_tokens
    sums["loss"] = sums.get("loss", 0.0) + _on(device, loss)
    sums["metric_tokens"] = sums.get("metric_tokens", 0.0) + num_tokens


def read_step(update, sums: dict, maxes: dict, grad_norm: torch.Tensor, *, group, ranks: int):
    """The optimizer step's one host read: ``update.metric_vectors(sums, maxes)`` summed / maxed
    over the ``ranks`` of ``group`` on the device, the entropy sum (``ENTROPY_SUM``) and the
    gradient norm, in one ``tolist``. Returns ``(summed, maxed, grad_norm, entropy)``: the first two
    as ``PolicyUpdate.reduced_metrics`` takes them, floats; ``entropy`` the mean over the loss
    tokens trained on (None when no rank trained on one)."""
    summed, maxed = update.metric_vectors(sums, maxes)
    device = grad_norm.device
    total = torch.stack([_on(device, v) for v in [*summed, sums.get(ENTROPY_SUM, 0.0)]])
    top = torch.stack([_on(device, v) for v in maxed]) if maxed else total.new_zeros(0)
    if ranks > 1:
        dist.all_reduce(total, op=dist.ReduceOp.SUM, group=group)
        if maxed:
            dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)
    values = torch.cat([total, top, _on(device, grad_norm).reshape(1)]).tolist()
    count = len(summed)
    summed_host, entropy_sum = values[:count], values[count]
    entropy = entropy_sum / summed_host[1] if summed_host[1] > 0 else None
    return summed_host, values[count + 1 : count + 1 + len(maxed)], values[-1], entropy


def combine_minibatch_metrics(results: list[dict[str, float]], *, loss_metrics: dict[str, str]) -> dict[str, float]:
    """Per-batch metrics from the minibatches' (in order). ``loss_metrics`` maps the policy loss's
    declared metrics to their reduction (``mean`` / ``max`` / ``sum``).

    Counts (tokens, dropped, zero-advantage and skipped samples or steps, ``sum`` metrics) are
    summed; ``max`` metrics and ``staleness_max`` are maxima; ``staleness_mean`` is over every
    trained token (weighted by each minibatch's ``num_loss_tokens``); ``version``,
    ``nonfinite_steps`` and ``lr`` are the last; the rest (loss, grad norm, ``mean`` metrics) are means over
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


class CompileClock:
    """Wall seconds torch.compile spends compiling inside ``running()`` (``--trainer.compile``'s
    ``compile_seconds``): dynamo's start / end callbacks, which torch runs once around the
    outermost compile of a frame, its backend and a lazily compiled backward included. The
    callbacks are the process's (registered at the first clock, never removed): compiles outside
    every clock's ``running()`` (a colocated engine's compiled decode) are not counted."""

    _registered = False
    _running: CompileClock | None = None
    _started: float | None = None

    def __init__(self) -> None:
        self._seconds = 0.0
        if not CompileClock._registered:
            from torch._dynamo.callback import callback_handler

            callback_handler.register_start_callback(CompileClock._start)
            callback_handler.register_end_callback(CompileClock._end)
            CompileClock._registered = True

    @staticmethod
    def _start(*_) -> None:
        CompileClock._started = time.perf_counter()

    @staticmethod
    def _end(*_) -> None:
        clock, started = CompileClock._running, CompileClock._started
        if clock is not None and started is not None:
            clock._seconds += time.perf_counter() - started
        CompileClock._started = None

    @contextlib.contextmanager
    def running(self) -> Iterator[None]:
        """A context in which compiles count on this clock."""
        CompileClock._running = self
        try:
            yield
        finally:
            CompileClock._running = None

    def take(self) -> float:
        """Seconds counted since the last ``take``."""
        seconds, self._seconds = self._seconds, 0.0
        return seconds
