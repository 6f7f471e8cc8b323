"""TrainerExecutor: the policy under FSDP2 on the trainer mesh, ``--trainer.num-minibatches`` k
optimizer steps per received batch (one per tick when k = 1).

Input (channel ``scored``, SCATTERed so prompt groups are whole on each rank): right-padded
``input_ids`` [N, L] (prompt then completion), ``loss_mask`` [N, L] (1 on completion tokens),
``behav_logp`` [N, L] and ``versions`` [N, L] (-1 off the completion) at the same positions,
``rewards`` [N], ``group_ids`` [N], ``num_tokens`` [N]; metadata ``group_size``.

Each batch (the algorithm's steps, local to a rank, are ``llamarl/algorithms/update.py``'s; this
executor places the data, runs the forward / backward, the optimizer and every collective between
them):
1. advantages from the group baseline (``--algo.advantage``), over whole groups;
2. the proximal policy is the one before the batch's first optimizer step (``algorithms/prox.py``,
   AReaL's definition): with ``--algo.prox recompute`` its log-probs of every row the loss will
   forward, ONCE (no-grad, ``sequence_logprobs``); A-3PO's ``loglinear`` approximates them inside
   each micro-batch from the behaviour log-probs, the current log-probs and the versions of the
   token, of the proximal policy and of the current weights;
3. the prompt groups of the whole batch (every rank's) are cut into k minibatches in group-id order
   (``minibatches``: the split does not depend on the number of ranks), and each is one optimizer
   step (``train_minibatch``), every rank taking part in each, with or without rows of it:
   a. staleness measured per token against the trainer's version at that step; rows holding a
      token older than ``--algo.max-staleness`` lose their loss mask (``dropped_stale_samples``);
   b. the global count of the minibatch's loss tokens over all DP ranks (one all-reduce), so its
      loss is a global token mean however its samples are split into micro-batches and ranks;
   c. dynamic micro-batches (first-fit decreasing by token count, ``max_tokens_per_microbatch``);
      every rank runs the same number of micro-batches (padding with zero-weight dummies) because
      each FSDP2 forward / backward is collective (``llamarl/models/microbatch.py``, which any
      executor holding a sharded model can use);
   d. the loss registered as ``--algo.loss`` (``llamarl/algorithms/registered.py``: AIPO, decoupled
      PPO, PPO built in), backward, gradient clipping, AdamW; version += 1. Its metrics are reduced
      over micro-batches and ranks as the loss declared them (token-weighted mean, max or sum).
   A minibatch without loss tokens, without a sample carrying signal or with a non-finite loss or
   gradient makes no step (the same decision on every rank, from all-reduced values).
4. per-batch metrics (``combine_minibatch_metrics`` in ``trainer_metrics.py``: sums of counts,
   maxima, means over the minibatches that stepped, ``staleness_mean`` over every trained token,
   ``entropy`` of the policy over the trained tokens); ``step`` adds ``num_minibatches``,
   ``optimizer_steps`` and ``train_tflops_per_s`` (``llamarl/models/flops.py``: the micro-batches'
   work, shared prompts once; ``trainer_mfu`` where the device's peak is known).

Host reads: steps 1-3c are planned on the batch's host copy (``plan_batch`` / ``plan_minibatch``);
the forwards, losses and metric sums stay on the device and each optimizer step reads them once
(``read_step``: metrics, gradient norm, the non-finite decision). ``tests/test_trainer_host_reads.py``.

Versions: ``version`` counts optimizer steps, so a batch advances it by up to k. A token's
staleness is the trainer's version at the optimizer step that trains it minus the version of the
weights that generated it: with k minibatches, the tokens of minibatch j of a batch are j versions
staler than those of minibatch 0, and the generator's weights (synced once per tick) trail by k
versions per tick of pipeline lag. ``--algo.max-staleness`` counts in the same versions.

FSDP2 averages gradients over the mesh; the loss is multiplied by the DP size to turn that
average back into the sum that a global token mean needs.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from pathlib import Path

import torch
import torch.distributed as dist

from llamarl.algorithms.config import AlgoConfig
from llamarl.algorithms.lr_schedule import lr_at
from llamarl.algorithms.update import (
    MINIBATCH_COUNTS,
    PolicyUpdate,
    advantage_moments,
    filter_stale,
    forwarded_rows,
    minibatch_counts,
    normalize_advantages,
    split_minibatches,
)
from llamarl.executors.config import TrainerConfig
from llamarl.executors.no_signal import SignalWatch
from llamarl.executors.trainer_metrics import (
    ENTROPY_SUM,
    TRAINER_METRICS,
    CompileClock,
    accumulate_on_device,
    combine_minibatch_metrics,
    device_timer,
    read_step,
    state_bytes,
)
from llamarl.models.colocated_memory import EngineFootprint
from llamarl.models.config import ModelConfig
from llamarl.models.export import export_hf
from llamarl.models.flops import ModelFlops, peak_tflops
from llamarl.models.lora import AdapterView
from llamarl.models.lora_export import export_adapter
from llamarl.models.microbatch import (
    device_inputs,
    microbatch_logprobs,
    plan_forwards,
    plan_microbatches,
    sequence_logprobs,
)
from llamarl.models.sharded_loading import load_sharded_causal_lm
from llamarl.runtime.batch import TensorBatch
from llamarl.runtime.checkpoint import load_rng, read_json, save_rng, write_json
from llamarl.runtime.executor import Executor
from llamarl.runtime.metrics import MetricSpec
from llamarl.runtime.sharded_state import load_sharded_state, save_sharded_state

logger = logging.getLogger("llamarl.trainer")


class TrainerExecutor(Executor):
    """Policy optimisation on the trainer's ranks. ``version`` counts optimizer steps."""


    @property
    def metric_specs(self) -> dict[str, MetricSpec]:
        """The step's metrics and those the registered loss declares (section ``loss``)."""
        return {**self.update.metric_specs, **TRAINER_METRICS}

    @property
    def num_threads(self) -> int:
        """``--trainer.num-threads``, set by the controller before each step."""
        return self.config.num_threads

    def __init__(self, ctx, *, model_config: ModelConfig, config: TrainerConfig, algo: AlgoConfig,
                 temperature: float, input_name: str = "scored", seed: int = 0,
                 stop_on_no_signal: int | None = None, engine_state: EngineFootprint | None = None) -> None:
        """``stop_on_no_signal``: ``--run.stop-on-no-signal`` (llamarl/executors/no_signal.py).
        ``engine_state``: what a colocated engine keeps on this device while the trainer runs
        (``--generator.torch.no-sleep``), counted by ``auto`` activation checkpointing."""
        super().__init__(ctx)
        self.model_config, self.config, self.algo = model_config, config, algo
        self.signal_watch = SignalWatch(stop_after=stop_on_no_signal, reports=ctx.local_rank == 0)
        self.update = PolicyUpdate(algo)  # the algorithm (algorithms/update.py); the loss looked up once
        self.temperature, self.input_name, self.seed = temperature, input_name, seed
        self.engine_state = engine_state
        self.compile_clock = CompileClock() if config.compile == "layers" else None
        self.version = 0
        self.model = None
        self.nonfinite_streak = self.nonfinite_total = 0
        self._prox_timings: list = []  # this batch's proximal-policy timings (``prox_seconds``)
        self._prox_version = 0  # the version before this batch's first optimizer step (prox.py)
        self._prox: torch.Tensor | None = None  # recomputed proximal log-probs by row_index (device)
        self._batch_tokens = 0.0  # this rank's tokens of the batch in training (host count)
        self._step_flops = 0.0  # this rank's training FLOPs of the step (llamarl/models/flops.py)

    def init(self) -> None:
        torch.set_num_threads(self.config.num_threads)
        torch.manual_seed(self.seed)
        dtype = getattr(torch, self.model_config.dtype)
        # Built on the meta device, sharded, then each rank reads only its own rows of each
        # weight onto ctx.device: no rank ever holds the full model (models/sharded_loading.py).
        # Under LoRA the base is frozen in param_dtype and only the adapters (masters in dtype)
        # train, checkpoint, sync and export (llamarl/models/lora.py).
        self.lora = self.config.lora.spec()
        self.model, self.tokenizer = load_sharded_causal_lm(
            self.model_config.name, dtype=dtype, mesh=self.ctx.mesh, device=self.ctx.device,
            param_dtype=getattr(torch, self.config.param_dtype), lora=self.lora, seed=self.seed,
            activation_checkpointing=self.config.activation_checkpointing,
            microbatch_tokens=self.config.max_tokens_per_microbatch * max(1, self.config.microbatch_rows),
            engine_state=self.engine_state,
            compile_backend=self.config.compile_backend if self.config.compile == "layers" else None)
        self.model.train()
        self.trainable = [p for p in self.model.parameters() if p.requires_grad]
        # The work a step does, for TFLOP/s and MFU (llamarl/models/flops.py); the peak where known.
        self.flops = ModelFlops.from_config(self.model.config)
        self.peak_tflops = peak_tflops(torch.cuda.get_device_name(self.ctx.device)) \
            if self.ctx.device.type == "cuda" else None
        self.optimizer = torch.optim.AdamW(self.trainable, lr=self.config.learning_rate(),
                                           weight_decay=self.config.weight_decay)

    def set_lr(self) -> float:
        """Set every parameter group's learning rate to the schedule's for the next optimizer step
        (``--trainer.lr-schedule``: a pure function of ``version``, llamarl/algorithms/lr_schedule.py)
        and return it."""
        c = self.config
        lr = lr_at(self.version, lr=c.learning_rate(), schedule=c.lr_schedule, warmup_steps=c.warmup_steps,
                   decay_steps=c.lr_decay_steps)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        return lr

    def get_model(self) -> torch.nn.Module:
        """What the weights channel moves: the policy, or under LoRA its adapters alone (the
        generator merges them into its own copy of the base)."""
        return self.model if self.lora is None else AdapterView(self.model)

    def save_checkpoint(self, directory: Path) -> None:
        """Sharded model + AdamW (every trainer rank, safetensors + JSON, reshardable), version and
        the torch RNG state. The learning rate is constant (no schedule to save). The HF export is
        separate (``export``), so a checkpoint never gathers the full model."""
        super().save_checkpoint(directory)
        save_sharded_state(directory / "state", model=self.model, optimizer=self.optimizer,
                           rank=self.ctx.local_rank, world_size=self.ctx.local_world_size)
        save_rng(directory / f"rng_rank{self.ctx.local_rank}.safetensors", torch.default_generator)
        if self.ctx.local_rank == 0:
            write_json(directory / "state.json", {"version": self.version, "nonfinite_total": self.nonfinite_total,
                                                  "nonfinite_streak": self.nonfinite_streak,
                                                  **self.signal_watch.state()})

    def load_checkpoint(self, directory: Path) -> None:
        """Restore ``save_checkpoint``'s state, onto any number of trainer ranks."""
        # A rank that did not exist at save time (more trainer ranks now) has no pending-outputs
        # file; the trainer sends nothing, so there is nothing to restore there.
        if (directory / f"outputs_rank{self.ctx.local_rank}.safetensors").is_file():
            super().load_checkpoint(directory)
        load_sharded_state(directory / "state", model=self.model, optimizer=self.optimizer)
        rng = directory / f"rng_rank{self.ctx.local_rank}.safetensors"
        if rng.is_file():  # a resharded resume has no file for a new rank: its RNG keeps the seed
            load_rng(rng, torch.default_generator)
        state = read_json(directory / "state.json")
        self.version = int(state["version"])
        self.nonfinite_total = int(state.get("nonfinite_total", 0))
        self.nonfinite_streak = int(state.get("nonfinite_streak", 0))
        self.signal_watch.load(state)

    def export(self, directory: Path) -> None:
        """The policy as an HF directory (``from_pretrained`` / vLLM load it as-is), written by the
        trainer's first rank shard by shard; collective over the trainer. Under LoRA: a PEFT
        adapter directory (``PeftModel.from_pretrained(base, directory)``), and with
        ``--trainer.lora.export-merged`` the merged model in ``directory / "merged"``."""
        if self.lora is None:
            export_hf(directory, model=self.model, tokenizer=self.tokenizer, writer=self.ctx.local_rank == 0)
            return
        export_adapter(directory, model=self.model, spec=self.lora, base=self.model_config.name,
                       tokenizer=self.tokenizer, writer=self.ctx.local_rank == 0,
                       merged=self.config.lora.export_merged, dtype=getattr(torch, self.model_config.dtype))

    # ----- one step -----
    # Host reads: everything a step decides before its forwards (advantages, staleness, counts, the
    # minibatch split, micro-batch packing, shared-prompt layouts) is computed from a host copy of
    # the batch (``batch.to("cpu")``: no copy for a batch on the host; on a GPU the received batch's
    # one device-to-host copy, before the step queues any work), with host collectives over a gloo
    # group (on an NCCL-only group, a device round trip). Device values (losses, metrics, the
    # gradient norm) stay on the device until the optimizer step's one read, which also takes the
    # non-finite decision (``train_minibatch``).
    def step(self) -> None:
        batch = self.inputs.pop(self.input_name, TensorBatch())
        start = time.perf_counter()
        version_before = self.version
        metrics = self.train_on(batch)
        seconds = time.perf_counter() - start
        metrics["train_seconds"] = seconds
        metrics["num_minibatches"] = float(self.config.num_minibatches)
        metrics["optimizer_steps"] = float(self.version - version_before)
        if len(batch) and self.version != version_before:  # no tokens/s for a batch without an update
            metrics["train_tokens_per_s"] = self._batch_tokens / seconds
        if self._step_flops:  # the micro-batches' forward and backward (flops.py), this rank's
            metrics["train_tflops_per_s"] = self._step_flops / seconds / 1e12
            if self.peak_tflops:
                metrics["trainer_mfu"] = metrics["train_tflops_per_s"] / self.peak_tflops
        metrics["state_mib"] = state_bytes(self.model, self.optimizer) / 2**20
        self.metrics = metrics
        self._watch_signal(batch, metrics, stepped=self.version != version_before)

    def _watch_signal(self, batch: TensorBatch, metrics: dict[str, float], *, stepped: bool) -> None:
        """This tick for ``SignalWatch``: the skip counts are global (every rank decides alike); the
        reward mean and ended fraction, read only on a tick without signal, are this rank's part."""
        quiet = metrics.get("skipped_no_signal", 0.0) > 0 and not stepped and not metrics.get("skipped_nonfinite")
        reward_mean = ended = 0.0
        if quiet and len(batch):
            reward_mean = float(batch["rewards"].float().mean())
            ended = float(batch["finish_stop"].float().mean()) if "finish_stop" in batch else 0.0
        self.signal_watch.observe(had_batch=quiet or stepped or bool(metrics.get("skipped_nonfinite")),
                                  signal=not quiet, reward_mean=reward_mean, ended_fraction=ended,
                                  version=self.version)

    @property
    def _collective_device(self) -> torch.device:
        """Where host values are all-reduced: the host under gloo (no device read), else the device."""
        backend = str(dist.get_backend(self.ctx.group)) if dist.is_initialized() else "gloo"
        return torch.device("cpu") if "gloo" in backend else self.ctx.device

    def _all_reduce(self, values: list[float], op=dist.ReduceOp.SUM) -> list[float]:
        """Host values reduced over the trainer's ranks (as float64); alone, the values themselves."""
        if not dist.is_initialized() or self.ctx.local_world_size == 1:
            return [float(v) for v in values]
        tensor = torch.tensor(values, dtype=torch.float64, device=self._collective_device)
        dist.all_reduce(tensor, op=op, group=self.ctx.group)
        return tensor.tolist()

    def prepare(self, batch: TensorBatch) -> TensorBatch:
        """Rows sorted by group, with ``advantages`` from whole groups (``PolicyUpdate.advantages``;
        collective with ``--algo.normalize-batch``: the statistics are those of the batch over every
        trainer rank, so the update does not depend on how many ranks the batch was split over).
        The trainer calls it on the batch's host copy."""
        if not len(batch):
            if self.algo.normalize_batch:
                self._all_reduce([0.0, 0.0, 0.0])  # the batch statistics are collective
            return batch
        batch = self.update.advantages(batch)
        if self.algo.normalize_batch:
            moments = self._all_reduce(advantage_moments(batch["advantages"]))
            batch.fields["advantages"] = normalize_advantages(batch["advantages"], *moments)
        return batch

    def filter_stale(self, batch: TensorBatch) -> tuple[TensorBatch, dict[str, float]]:
        """``algorithms.update.filter_stale`` at the current version: ``--algo.max-staleness`` masks
        rows holding an older token (``dropped_stale_samples``), under either ``--algo.stale-policy``
        (with ``wait`` the generator should have left none: this is the guarantee, and a drop is
        warned about)."""
        return filter_stale(batch, self.version, self.algo.max_staleness)

    def minibatches(self, batch: TensorBatch) -> list[TensorBatch]:
        """This rank's rows of each of the ``--trainer.num-minibatches`` k minibatches, in order
        (``split_minibatches``: whole prompt groups, the split independent of the number of ranks).
        Collective when k > 1: the group ids of every trainer rank's part are gathered here."""
        k = self.config.num_minibatches
        if k == 1:
            return [batch]
        device = self._collective_device
        local = torch.unique(batch["group_ids"]) if len(batch) else torch.zeros(0, dtype=torch.int64, device="cpu")
        local = local.to(device=device, dtype=torch.int64)
        width = int(self._all_reduce([float(local.numel())], op=dist.ReduceOp.MAX)[0])
        row = torch.zeros(width + 1, dtype=torch.int64, device=device)
        row[0], row[1 : local.numel() + 1] = local.numel(), local
        rows = [torch.empty_like(row) for _ in range(self.ctx.local_world_size)]
        dist.all_gather(rows, row, group=self.ctx.group)
        return split_minibatches(batch, [g for r in rows for g in r[1 : int(r[0]) + 1].tolist()], k)

    def train_on(self, batch: TensorBatch) -> dict[str, float]:
        """``--trainer.num-minibatches`` optimizer steps on this rank's part of the batch (collective
        over the trainer); per-batch metrics (``combine_minibatch_metrics``)."""
        batch, parts = self.plan_batch(batch)
        self._step_flops = 0.0
        spec = self.update.loss
        self._prox_timings = []
        # The proximal policy is the one before this batch's first optimizer step (prox.py).
        self._prox_version = self.version
        self._prox = None
        # --trainer.compile layers: the compiles of this batch's forwards (the first; a recompile's).
        with self.compile_clock.running() if self.compile_clock else contextlib.nullcontext():
            if spec.needs_prox and self.algo.prox == "recompute":
                timer = device_timer(self.ctx.device)
                # Once, with the weights before the first minibatch's update. Rows the loop can forward:
                # those with signal that the staleness filter keeps at this version (later minibatches,
                # at later versions, keep a subset).
                fresh, _ = self.filter_stale(batch)
                rows = forwarded_rows(fresh, every_loss_row=self.update.every_loss_row) if len(batch) \
                    else torch.zeros(0, dtype=torch.long, device="cpu")
                logp = sequence_logprobs(self.model, fresh.select(rows) if len(batch) else batch,
                                         temperature=self.temperature, group=self.ctx.group, device=self.ctx.device,
                                         max_tokens_per_microbatch=self.config.max_tokens_per_microbatch,
                                         share_prompts=self.config.share_prompts,
                                         microbatch_rows=self.config.microbatch_rows,
                                         chunk_tokens=self.config.logprob_chunk_tokens)
                if len(batch):
                    # By the host batch's ``row_index``: each micro-batch takes its rows' (``_device_part``).
                    self._prox = torch.zeros(batch["input_ids"].shape, dtype=torch.float32, device=self.ctx.device)
                    self._prox[rows.to(self.ctx.device)] = logp
                self._prox_timings.append(timer())
            results = [self.train_minibatch(part) for part in parts]
        metrics = results[0] if len(results) == 1 else combine_minibatch_metrics(results, loss_metrics=spec.metrics)
        compiled = self.compile_clock.take() if self.compile_clock else 0.0
        if compiled:
            metrics["compile_seconds"] = compiled
        if spec.needs_prox:
            metrics["prox_seconds"] = sum(seconds() for seconds in self._prox_timings)
        self._prox = None
        return metrics

    def plan_batch(self, batch: TensorBatch) -> tuple[TensorBatch, list[TensorBatch]]:
        """The batch's host part of a step (no device value is read): its host copy, ``prepare``d,
        each row numbered (``row_index``), and this rank's rows of each minibatch."""
        batch = self.prepare(batch.to("cpu"))
        self._batch_tokens = float(batch["num_tokens"].sum()) if len(batch) else 0.0
        if len(batch):
            batch.fields["row_index"] = torch.arange(len(batch), device="cpu")
        return batch, self.minibatches(batch)

    def plan_minibatch(self, batch: TensorBatch) -> tuple[TensorBatch, list, dict[str, float]]:
        """The minibatch's host part (no device value is read; collective over the trainer): the
        staleness filter at this version, the rows with signal, the counts over every rank
        (``MINIBATCH_COUNTS`` and ``staleness_max``, maxed), and every forward's ``Microbatch`` plan (the
        same number on every rank)."""
        batch, stats = self.filter_stale(batch)
        # This rank's rows with signal; the counts over every trainer rank (``MINIBATCH_COUNTS``:
        # loss tokens, the global token mean's denominator, staleness sum, zero-advantage samples,
        # rows forwarded, dropped samples).
        batch, local_counts = minibatch_counts(batch, stats, every_loss_row=self.update.every_loss_row)
        counts = dict(zip(MINIBATCH_COUNTS, self._all_reduce(local_counts)))
        self.update.begin_minibatch(counts)  # the --algo.loss-agg denominators
        microbatches, max_mbs = plan_microbatches(batch, max_tokens_per_microbatch=self.config.max_tokens_per_microbatch,
                                                  group=self.ctx.group, share_prompts=self.config.share_prompts,
                                                  microbatch_rows=self.config.microbatch_rows)
        plans = plan_forwards(batch, microbatches, max_mbs, share_prompts=self.config.share_prompts, model=self.model)
        counts["staleness_max"] = self._all_reduce([stats.get("staleness_max", 0.0)], op=dist.ReduceOp.MAX)[0]
        return batch, plans, counts

    def train_minibatch(self, batch: TensorBatch) -> dict[str, float]:
        """One optimizer step on this rank's rows of one minibatch (a host batch; collective over the
        trainer): every rank calls it, an empty part included, and all take the same skip decisions.
        One device value is read (``read_step``), after the backward."""
        batch, plans, counts = self.plan_minibatch(batch)
        total_tokens, dropped_stale, zero_adv = counts["tokens"], counts["dropped_stale"], counts["zero_advantage"]
        if dropped_stale and self.ctx.local_rank == 0:
            wait = self.algo.stale_policy == "wait"
            (logger.warning if wait else logger.info)(
                "%d samples dropped at trainer version %d: a token more than --algo.max-staleness %d versions old%s",
                dropped_stale, self.version, self.algo.max_staleness,
                " (--algo.stale-policy wait: the generator's expected lag was too short)" if wait else "")
        if total_tokens == 0:
            return {"skipped": 1.0, "version": float(self.version), "dropped_stale_samples": dropped_stale}
        if counts["signal"] == 0:
            # Every group scored alike: the gradient is exactly zero, and an AdamW step on it would
            # still move the weights along stale momentum. Skip the update (and the version bump).
            return {"skipped_no_signal": 1.0, "zero_advantage_samples": zero_adv, "version": float(self.version),
                    "dropped_stale_samples": dropped_stale}
        self.optimizer.zero_grad(set_to_none=True)
        sums, maxes = self._accumulate_gradients(self._device_part(batch), plans, total_tokens)
        grad_norm = torch.nn.utils.clip_grad_norm_(self.trainable,
                                                   self.config.grad_clip if self.config.grad_clip > 0 else float("inf"))
        if isinstance(grad_norm, torch.distributed.tensor.DTensor):
            grad_norm = grad_norm.full_tensor()
        # Reduced before the step: the non-finite decision below must be the same on every rank.
        summed, maxed, grad_norm, entropy = read_step(self.update, sums, maxes, grad_norm, group=self.ctx.group,
                                                      ranks=self.ctx.local_world_size)
        loss, loss_metrics = self.update.reduced_metrics(summed, maxed)
        if not (math.isfinite(loss) and math.isfinite(grad_norm)):
            return self._skip_nonfinite(loss=loss, grad_norm=grad_norm)
        self.nonfinite_streak = 0
        lr = self.set_lr()
        self.optimizer.step()
        self.version += 1
        out = {"loss": loss, "grad_norm": grad_norm, "num_loss_tokens": total_tokens,
               "nonfinite_steps": float(self.nonfinite_total),
               "staleness_mean": counts["staleness_sum"] / total_tokens, "version": float(self.version),
               "zero_advantage_samples": zero_adv, "dropped_stale_samples": dropped_stale, "lr": lr, **loss_metrics}
        out["staleness_max"] = counts["staleness_max"]
        if entropy is not None:
            out["entropy"] = entropy
        return out

    def _device_part(self, batch: TensorBatch) -> TensorBatch:
        """The rows of host ``batch`` on the device, with their recomputed proximal log-probs."""
        part = batch.to(self.ctx.device)
        if self._prox is not None and len(part):
            part.fields["prox_logp"] = self._prox.index_select(0, part["row_index"])
        return part

    def _accumulate_gradients(self, batch: TensorBatch, plans: list, total_tokens: float) -> tuple[dict, dict]:
        """Forward and backward every planned micro-batch (as many on every rank: a rank with fewer
        runs dummy ones, FSDP2 needs every rank in every collective); returns this rank's metric
        sums and maxes, device tensors (``accumulate_on_device``)."""
        dp_size = self.ctx.local_world_size
        sums: dict = {}
        maxes: dict = {}
        for plan in plans:
            tokens, pairs, predicted = plan.work
            self._step_flops += self.flops.training(tokens=tokens, pairs=pairs, predicted=predicted,
                                                    frozen_weights=self.lora is not None)
            loss, metrics, entropy = self._microbatch_loss(batch, plan, total_tokens)
            (loss * dp_size).backward()
            accumulate_on_device(self.update, sums, maxes, metrics, loss, plan.loss_tokens)
            if entropy is not None:
                sums[ENTROPY_SUM] = sums.get(ENTROPY_SUM, 0.0) + entropy
        return sums, maxes

    def _skip_nonfinite(self, *, loss: float, grad_norm: float) -> dict[str, float]:
        """No optimizer step on a non-finite loss or gradient (identical decision on every rank,
        from all-reduced values); ``--trainer.max-nonfinite-steps`` in a row end the run."""
        self.optimizer.zero_grad(set_to_none=True)
        self.nonfinite_streak += 1
        self.nonfinite_total += 1
        if self.nonfinite_streak >= self.config.max_nonfinite_steps:
            raise RuntimeError(f"{self.nonfinite_streak} consecutive non-finite training steps (last: loss {loss}, "
                               f"grad norm {grad_norm}) at trainer version {self.version}; "
                               f"--trainer.max-nonfinite-steps is {self.config.max_nonfinite_steps}")
        logger.warning("non-finite loss %s / grad norm %s at trainer version %d: update skipped (%d in a row)",
                       loss, grad_norm, self.version, self.nonfinite_streak)
        return {"skipped_nonfinite": 1.0, "nonfinite_steps": float(self.nonfinite_total),
                "version": float(self.version)}

    def _microbatch_loss(self, batch, plan, total_tokens):
        """One micro-batch's loss (a device scalar), its loss metrics and the sum of the entropy
        over its loss tokens (float64 device scalar; None for a dummy)."""
        ids, attention, mask, start, sub = device_inputs(batch, plan, device=self.ctx.device)
        entropies: list = []
        logp = microbatch_logprobs(self.model, ids, attention, mask, start=start, temperature=self.temperature,
                                   share_prompts=self.config.share_prompts,
                                   chunk_tokens=self.config.logprob_chunk_tokens, entropy_out=entropies,
                                   layout=plan.layout, entropy_grad=self.update.every_loss_row)
        if sub is None:
            return logp.sum() * 0.0, {}, None
        loss, metrics = self.update.loss_on(sub, logp, mask, num_loss_tokens=total_tokens, version=self.version,
                                            prox_version=self._prox_version, timed=self._timed_prox,
                                            entropy=entropies[0])
        return loss, metrics, (entropies[0].detach() * mask).sum().double()

    def _timed_prox(self, compute):
        """``compute()``, its device time added to this batch's ``prox_seconds``."""
        timer = device_timer(self.ctx.device)
        out = compute()
        self._prox_timings.append(timer())
        return out
