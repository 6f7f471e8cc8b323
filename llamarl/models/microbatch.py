"""Collective-safe micro-batch loops over a sharded (FSDP2) causal LM.

Under FSDP2 every forward (and backward) is a collective over the model's mesh: each rank must run
the same number of them, even a rank whose share of the batch is smaller or empty. These helpers
are what any executor holding such a model uses (the trainer for its update and its recomputed
proximal log-probs; a reference-policy executor for the log-probs of samples):

* ``plan_microbatches`` packs this rank's rows into micro-batches under a token budget (first-fit
  decreasing, ``llamarl/data/packing.py``) and agrees with the other ranks (one MAX all-reduce) on
  how many forwards everyone runs;
* ``microbatch_inputs`` turns one micro-batch's rows into trimmed model inputs, or into a 2-token
  dummy with zero loss weight for a rank that has run out of rows;
* ``microbatch_logprobs`` is the forward of one micro-batch: per-row, or with each shared prompt
  forwarded once (``llamarl/models/shared_prefix.py``) when ``share_prompts`` is on;
* ``sequence_logprobs`` runs them for a no-grad pass: the per-token completion log-probs of every
  row of a batch.

No device value is read back inside the loops: ``plan_forwards`` turns a host copy of the batch
(lengths, loss masks, tokens for the shared contexts) into one ``Microbatch`` per forward (rows,
trimmed length, first loss column, loss-token count, the shared-prompt ``PackedLayout``), and
``device_inputs`` / ``microbatch_logprobs`` then only index device tensors with host numbers.

With ``share_prompts`` the planner packs whole context groups (a group costs its prompt once plus
its completions) so that a micro-batch holds a group's rows together.

Batch layout (the trainer's input, see llamarl/executors/trainer.py): right-padded
``input_ids`` [N, L] (prompt then completion), ``loss_mask`` [N, L] (1 on completion tokens) and
``num_tokens`` [N] (prompt + completion length of each row).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from llamarl.data.packing import check_token_counts, pack_microbatches
from llamarl.models import shared_prefix
from llamarl.models.flops import work_of
from llamarl.models.logprobs import completion_logprobs
from llamarl.models.sharding import reshard_after_no_grad
from llamarl.runtime.batch import TensorBatch

__all__ = ["Microbatch", "device_inputs", "microbatch_inputs", "microbatch_logprobs", "plan_forwards",
           "plan_microbatches", "sequence_logprobs"]


@dataclass
class Microbatch:
    """One forward's plan, from host values (``plan_forwards``): ``rows`` of the batch (None: the
    dummy of a rank with nothing left), the trimmed ``length``, ``start`` (first loss column),
    ``loss_tokens`` (its loss-mask sum over those columns), with shared prompts the ``layout``, and
    its ``work``: ``(tokens, pairs, predicted)`` for ``llamarl/models/flops.py`` (zero for a dummy)."""

    rows: list[int] | None
    length: int
    start: int
    loss_tokens: float
    layout: shared_prefix.PackedLayout | None = None
    work: tuple[float, float, float] = (0.0, 0.0, 0.0)


def microbatch_inputs(batch: TensorBatch, rows: list[int] | None, *, device: torch.device | str):
    """Model inputs of the micro-batch ``rows`` of ``batch``.

    Returns ``(input_ids, attention_mask, loss_mask, start, sub_batch)``: ``input_ids`` (int64) and
    ``attention_mask`` (1 on each row's first ``num_tokens``) are ``[b, length]`` with ``length``
    the longest row of the micro-batch (padding columns beyond it are cut); ``loss_mask`` is the
    rows' loss mask over the same columns, as float; ``start`` is the first column holding a loss
    token in any row (the log-probs before it need not be computed); ``sub_batch`` is
    ``batch.select(rows)`` (every field, untrimmed).

    ``rows=None`` is the dummy micro-batch of a rank with nothing left to forward: one row of two
    zero tokens on ``device``, an all-zero loss mask, ``start=1`` and ``sub_batch=None``. A loss on
    it must be multiplied by zero, not skipped, so that its backward still takes part in the
    collectives. ``device`` is used only for the dummy; real rows stay on ``batch``'s device.
    """
    if rows is None:
        ids = torch.zeros(1, 2, dtype=torch.long, device=device)
        return ids, torch.ones_like(ids), torch.zeros(1, 2, device=device), 1, None
    sub = batch.select(rows)
    length = int(sub["num_tokens"].max())
    start = int(sub["loss_mask"][:, :length].float().argmax(dim=1).min())
    ids = sub["input_ids"][:, :length].long()
    attention = (torch.arange(length, device=ids.device).unsqueeze(0) < sub["num_tokens"].unsqueeze(1)).long()
    return ids, attention, sub["loss_mask"][:, :length].float(), start, sub


def plan_forwards(host: TensorBatch, microbatches: list[list[int]], count: int, *, share_prompts: bool,
                  model: torch.nn.Module) -> list[Microbatch]:
    """``count`` forwards' ``Microbatch`` plans (``plan_microbatches``' output; past the end of
    ``microbatches``, dummies), each read from ``host``, a host (CPU) copy of the batch: the
    numbers ``microbatch_inputs`` would read from the device, and the shared-prompt layout when
    ``share_prompts`` and the model supports it."""
    shared = share_prompts and shared_prefix.supports(model)
    plans = []
    for index in range(count):
        rows = microbatches[index] if index < len(microbatches) else None
        ids, attention, mask, start, _ = microbatch_inputs(host, rows, device="cpu")
        lengths = attention.sum(dim=1).tolist()
        layout = shared_prefix.packed_layout(ids, lengths, mask) if shared else None
        work = (0.0, 0.0, 0.0) if rows is None else work_of(lengths, start, None if layout is None else layout.segments)
        plans.append(Microbatch(rows, ids.shape[1], start, float(mask.sum()), layout, work))
    return plans


def device_inputs(batch: TensorBatch, plan: Microbatch, *, device: torch.device | str):
    """``microbatch_inputs(batch, plan.rows, device=device)`` with ``plan``'s host numbers instead of
    reads of ``batch`` (on the device): the same ``(input_ids, attention_mask, loss_mask, start,
    sub_batch)``."""
    if plan.rows is None:
        return microbatch_inputs(batch, None, device=device)
    sub = batch.select(plan.rows)
    length = plan.length
    ids = sub["input_ids"][:, :length].long()
    attention = (torch.arange(length, device=ids.device).unsqueeze(0) < sub["num_tokens"].unsqueeze(1)).long()
    return ids, attention, sub["loss_mask"][:, :length].float(), plan.start, sub


def microbatch_logprobs(model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                        loss_mask: torch.Tensor, *, start: int, temperature: float,
                        share_prompts: bool, chunk_tokens: int = 0, entropy_out: list | None = None,
                        layout: shared_prefix.PackedLayout | None = None, entropy_grad: bool = False) -> torch.Tensor:
    """Per-token completion log-probs ``[b, length]`` of one micro-batch (``microbatch_inputs``'s
    first four outputs), differentiable. ``share_prompts`` forwards each distinct context once when
    the model supports it (``shared_prefix.supports``), else the rows as they are; the values agree
    on every loss position up to summation order. ``chunk_tokens > 0``: no more than that many
    tokens' logits alive at once (``llamarl.models.logprob_chunks``; same values and gradients).
    ``entropy_out``: gets the ``[b, length]`` entropies appended (``completion_logprobs``; differentiable
    with ``entropy_grad``);
    ``layout``: the rows' host-built ``PackedLayout`` (``plan_forwards``), so nothing is read here."""
    if share_prompts and shared_prefix.supports(model):
        return shared_prefix.shared_prefix_logprobs(model, input_ids, attention_mask, loss_mask,
                                                    temperature=temperature, chunk_tokens=chunk_tokens,
                                                    entropy_out=entropy_out, layout=layout,
                                                    entropy_grad=entropy_grad)
    return completion_logprobs(model, input_ids, attention_mask, start=start, temperature=temperature,
                               chunk_tokens=chunk_tokens, entropy_out=entropy_out, entropy_grad=entropy_grad)


def plan_microbatches(batch: TensorBatch, *, max_tokens_per_microbatch: int, group: dist.ProcessGroup | None,
                      share_prompts: bool = False, microbatch_rows: int = 0) -> tuple[list[list[int]], int]:
    """Pack this rank's rows; agree with the other ranks of ``group`` on the number of forwards.

    Returns ``(microbatches, num_microbatches_all_ranks)``: ``microbatches`` are lists of row
    indices of ``batch`` (``pack_microbatches`` on ``num_tokens``: none holds more than
    ``max_tokens_per_microbatch`` tokens; ``[]`` for an empty batch) and
    ``num_microbatches_all_ranks`` is their largest count over ``group``. A caller runs exactly that
    many forwards, index ``i`` on ``microbatches[i]`` or, past the end of its own list, on a dummy
    (``microbatch_inputs(batch, None, ...)``).

    Collective over ``group`` (one all-reduce; every rank of it must call this, in the same order
    relative to its other collectives), which the caller's model must be sharded over. Without an
    initialised process group it is local. Raises ValueError if one row exceeds the budget.

    ``share_prompts``: the budget counts packed tokens (each context once, then its rows'
    completions) and rows of one context stay in one micro-batch unless together they exceed it.
    ``microbatch_rows > 0``: fixed micro-batches of that many consecutive rows instead (the budget
    is not checked).
    """
    lengths = batch["num_tokens"].tolist() if len(batch) else []
    if microbatch_rows > 0:
        microbatches = [list(range(i, min(i + microbatch_rows, len(lengths))))
                        for i in range(0, len(lengths), microbatch_rows)]
    elif not lengths:
        microbatches = []
    elif not share_prompts:
        microbatches = pack_microbatches(lengths, max_tokens_per_microbatch=max_tokens_per_microbatch)
    else:
        # Per row, before groups are packed: an error names the row, not a group.
        check_token_counts(lengths, max_tokens_per_microbatch=max_tokens_per_microbatch)
        groups, context_lengths = shared_prefix.context_groups(batch["input_ids"], lengths, batch["loss_mask"])
        items = shared_prefix.pack_groups(groups, context_lengths, lengths, max_tokens=max_tokens_per_microbatch)
        bins = pack_microbatches([cost for _, cost in items], max_tokens_per_microbatch=max_tokens_per_microbatch)
        microbatches = sorted((sorted(row for item in chosen for row in items[item][0]) for chosen in bins),
                              key=lambda rows: rows[0])
    count = len(microbatches)
    if dist.is_available() and dist.is_initialized():
        tensor = torch.tensor([float(count)], dtype=torch.float64, device=_group_device(group))
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=group)
        count = int(tensor.item())
    return microbatches, count


def _group_device(group: dist.ProcessGroup | None) -> torch.device:
    """The device a collective over ``group`` runs on: the current CUDA device under NCCL."""
    backend = dist.get_backend(group)
    if backend == "nccl" and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


@torch.no_grad()
def sequence_logprobs(model: torch.nn.Module, batch: TensorBatch, *, temperature: float,
                      max_tokens_per_microbatch: int, group: dist.ProcessGroup | None,
                      device: torch.device | str, share_prompts: bool = False,
                      microbatch_rows: int = 0, chunk_tokens: int = 0) -> torch.Tensor:
    """No-grad per-token log-probs ``[N, L]`` (float32) of every row's completion under ``model``.

    ``out[r, t] = log p(input_ids[r, t] | input_ids[r, :t])`` with logits divided by
    ``temperature`` (``completion_logprobs``), on every ``loss_mask`` position of row ``r``; 0 on
    every other position. Rows are packed into micro-batches of at most
    ``max_tokens_per_microbatch`` tokens; collective over ``group`` like ``plan_microbatches``:
    every rank of the group must call it (a rank with an empty batch runs dummy forwards and gets
    an empty ``[0, L]`` tensor). Each value is exactly what the same micro-batch's forward gives
    inside a training loop with the same packing. The model is used in whatever train / eval mode
    it is in, and an FSDP2 model is left resharded (``reshard_after_no_grad``). ``device``: where the result (and a dummy's inputs) live; the batch should be there.
    ``share_prompts``: forward each distinct context once (``microbatch_logprobs``);
    ``microbatch_rows``: fixed micro-batches (``plan_microbatches``); ``chunk_tokens``: see
    ``microbatch_logprobs``.
    """
    host = batch.to("cpu")  # the plan's numbers, read on the host (a no-op for a host batch)
    microbatches, count = plan_microbatches(host, max_tokens_per_microbatch=max_tokens_per_microbatch,
                                            group=group, share_prompts=share_prompts, microbatch_rows=microbatch_rows)
    plans = plan_forwards(host, microbatches, count, share_prompts=share_prompts, model=model)
    batch = batch.to(device)
    width = batch["input_ids"].shape[1] if "input_ids" in batch else 0
    out = torch.zeros(len(batch), width, dtype=torch.float32, device=device)
    for plan in plans:
        ids, attention, mask, start, _ = device_inputs(batch, plan, device=device)
        logp = microbatch_logprobs(model, ids, attention, mask, start=start, temperature=temperature,
                                   share_prompts=share_prompts, chunk_tokens=chunk_tokens, layout=plan.layout)
        if plan.rows is not None:
            index_rows = torch.tensor(plan.rows, dtype=torch.long, device=out.device)
            out[index_rows, : ids.shape[1]] = torch.where(mask.bool(), logp.float(), 0.0).to(out.device)
    reshard_after_no_grad(model)  # no backward follows these forwards
    return out
