"""The trainer part's section, one per shape (``train:<name>``), in a process of its own (a world
of one rank: the trainer's FSDP2 mesh needs a process group, which the report's process must not
hold).

Per shape, llamarl's own ``TrainerExecutor`` (``init``, then ``step``: plan, micro-batches, forward,
loss, backward, clipping, AdamW; ``--algo.loss`` AIPO, the default) on a random-init model of the
published shape. Only where the weights come from differs from a run: the trainer's loader
(``load_sharded_causal_lm``) is pointed at an empty directory, so it takes its whole-model path,
whose ``load_causal_lm`` is replaced by ``common.build_model`` on the device (``random_weights``);
the LoRA injection, the activation-checkpointing decision (``auto``), FSDP2 sharding and the
optimizer are the trainer's. ``--trainer.param-dtype bfloat16`` (bf16 compute), fp32 masters for
full fine-tuning, a bf16 base and fp32 adapters under LoRA.

A step's batch (``make_batch``): ``train_groups`` GRPO groups of ``train_group_size`` samples, each a
shared prompt of ``train_prompt_tokens`` random ids and a completion of ``train_completion_tokens``
(512 + 1536 = 2048 tokens a row: a group is one 16,384-token micro-batch per row, 12,800 tokens with
its prompt forwarded once), rewards alternating within each group (every group has signal). Each
case (a method: full fine-tuning or LoRA; shared prompts on, then off) runs ``train_warmup`` steps,
then ``train_steps`` timed ones, synchronised around ``TrainerExecutor.step``: sample tokens/s,
TFLOP/s from the trainer's own count (``llamarl/models/flops.py``: the forwarded tokens, shared
prompts once, ``train_tflops_per_s x train_seconds``), MFU over the data sheet's bf16 peak
(``flops.peak_tflops``, the trainer's ``peak_tflops``) and over the GEMM probe measured first in
the same process, peak memory (``torch.cuda.max_memory_allocated`` from the case's first step).
On the CPU (``--smoke``) the same code runs on the tiny shape, both methods, fp32, a 256-token
budget; its numbers mean nothing (no peak: MFU not measured). ``--train-compile`` (opt-in, outside
the 300 s plan): one more case, the shape's first method with ``--trainer.compile layers``, shared
prompts on, its compile seconds (the trainer's ``compile_seconds``) apart from the timed steps.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import logging
import math
import os
import socket
import time
from pathlib import Path

from gpu_check.common import SHAPES, Sizes, build_model, synchronize

METHODS = {"smollm2-135m": ("full",), "qwen2.5-1.5b": ("full",), "qwen2.5-7b": ("lora",), "tiny": ("full", "lora")}
"""Each shape's training methods: ``full`` (full fine-tuning, AdamW over every weight) or ``lora``
(``--trainer.lora.rank`` ``Sizes.train_lora_rank``, all linear layers, AdamW over the adapters)."""
GROUPS = {"qwen2.5-7b": 2}
"""Groups (micro-batches) a step where not ``Sizes.train_groups``: 7B's steps take seconds each."""


def make_batch(sizes: Sizes, *, groups: int, vocab: int, seed: int = 0):
    """The trainer's input (llamarl/executors/trainer.py's layout): ``groups`` groups of
    ``train_group_size`` rows, each row its group's prompt then its own completion, every token
    counted (no padding), behaviour log-probs at the uniform policy's, version 0, rewards 1, 0, 1,
    ... within each group."""
    import torch

    from llamarl.runtime.batch import TensorBatch

    size, prompt, completion = sizes.train_group_size, sizes.train_prompt_tokens, sizes.train_completion_tokens
    rows, width = groups * size, prompt + completion
    generator = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(3, vocab, (rows, width), generator=generator)
    for group in range(groups):
        input_ids[group * size:(group + 1) * size, :prompt] = input_ids[group * size, :prompt]
    loss_mask = torch.zeros(rows, width, dtype=torch.uint8)
    loss_mask[:, prompt:] = 1
    versions = torch.full((rows, width), -1, dtype=torch.int64)
    versions[:, prompt:] = 0
    return TensorBatch({"input_ids": input_ids, "loss_mask": loss_mask, "versions": versions,
                        "behav_logp": loss_mask.float() * -math.log(vocab),
                        "rewards": (torch.arange(rows) % 2).float(), "group_ids": torch.arange(rows) // size,
                        "num_tokens": torch.full((rows,), width)}, {"group_size": size})


@contextlib.contextmanager
def random_weights(shape: str, device: str):
    """The trainer's loader building a random-init ``shape`` on ``device`` where it would read a
    checkpoint (module docstring): ``sharded_loading.load_causal_lm`` replaced while inside."""
    from unittest import mock

    from llamarl.models import sharded_loading

    where = device  # the trainer's device: ``_full_load`` asks for the host, then shards onto it

    def load(name_or_path, *, dtype, device="cpu"):
        return build_model(shape, dtype=str(dtype).removeprefix("torch."), device=where, seed=0), None

    with mock.patch.object(sharded_loading, "load_causal_lm", load):
        yield


def world(device: str):
    """A world of one rank, this process (gloo on the CPU, NCCL on a GPU): the trainer's context."""
    from llamarl.runtime.world import ExecutorContext, ExecutorSpec

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update({"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1",
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    cpu = not device.startswith("cuda")
    return ExecutorContext.create([ExecutorSpec("trainer", 1, device="cpu" if cpu else "auto")], timeout_s=300,
                                  backend="gloo" if cpu else None)


def make_trainer(ctx, shape: str, method: str, sizes: Sizes, weights_dir: Path, *, compiled: bool = False):
    """llamarl's ``TrainerExecutor`` on a random-init ``shape``, ``init``-ed (module docstring);
    ``compiled``: ``--trainer.compile layers`` (inductor; the smoke's CPU: the ``eager`` backend)."""
    from llamarl.algorithms.config import AlgoConfig
    from llamarl.executors.config import TrainerConfig
    from llamarl.executors.trainer import TrainerExecutor
    from llamarl.models.config import LoraConfig, ModelConfig

    lora = method == "lora"
    # LoRA: the base is stored in param_dtype whatever --model.dtype, the adapters in fp32 (_adapt):
    # building the base in it directly skips an fp32 copy of 7B weights.
    dtype = sizes.dtype if lora else "float32"
    extra = {}
    if compiled:
        if "compile" not in {f.name for f in dataclasses.fields(TrainerConfig)}:
            raise RuntimeError("--train-compile: this llamarl's TrainerConfig has no --trainer.compile")
        extra = {"compile": "layers", "compile_backend": "eager" if sizes.smoke else "inductor"}
    config = TrainerConfig(max_tokens_per_microbatch=sizes.train_microbatch_tokens, param_dtype=sizes.dtype,
                           lora=LoraConfig(rank=sizes.train_lora_rank if lora else None), **extra)
    trainer = TrainerExecutor(ctx, model_config=ModelConfig(name=str(weights_dir), dtype=dtype), config=config,
                              algo=AlgoConfig(), temperature=1.0)
    with random_weights(shape, str(ctx.device)):
        trainer.init()
    return trainer


def plan_of(trainer, batch, *, share_prompts: bool) -> tuple[int, float]:
    """(micro-batches, forwarded tokens) of ``batch`` under the trainer's packing (host only)."""
    from llamarl.models.microbatch import plan_forwards, plan_microbatches

    microbatches, count = plan_microbatches(batch, max_tokens_per_microbatch=trainer.config.max_tokens_per_microbatch,
                                            group=trainer.ctx.group, share_prompts=share_prompts)
    plans = plan_forwards(batch, microbatches, count, share_prompts=share_prompts, model=trainer.model)
    return count, sum(plan.work[0] for plan in plans)


def measure_case(trainer, batch, sizes: Sizes, *, share_prompts: bool, gemm_tflops: float | None) -> dict:
    """``train_warmup`` then ``train_steps`` synchronised ``TrainerExecutor.step`` calls on ``batch``
    with ``--trainer.share-prompts`` as given: tokens/s, TFLOP/s, MFU, peak memory."""
    import torch

    device = str(trainer.ctx.device)
    trainer.config = dataclasses.replace(trainer.config, share_prompts=share_prompts)
    microbatches, forwarded = plan_of(trainer, batch, share_prompts=share_prompts)
    cuda = device.startswith("cuda")
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    seconds, flops, reported, compiling = [], [], [], 0.0
    for index in range(sizes.train_warmup + sizes.train_steps):
        trainer.inputs[trainer.input_name] = batch
        synchronize(device)
        start = time.perf_counter()
        trainer.step()
        synchronize(device)
        elapsed = time.perf_counter() - start
        metrics = trainer.metrics
        if metrics.get("optimizer_steps") != 1.0:
            raise RuntimeError(f"the step made no optimizer step: {metrics}")
        compiling += metrics.get("compile_seconds", 0.0)
        if index >= sizes.train_warmup:
            seconds.append(elapsed)
            flops.append(metrics["train_tflops_per_s"] * metrics["train_seconds"] * 1e12)
            reported.append({k: metrics.get(k) for k in ("train_seconds", "train_tokens_per_s", "train_tflops_per_s",
                                                         "trainer_mfu", "loss", "grad_norm")})
    mean = sum(seconds) / len(seconds)
    tflops = sum(flops) / len(flops) / mean / 1e12
    peak = trainer.peak_tflops
    memory = torch.cuda.max_memory_allocated() if cuda else None
    total = torch.cuda.get_device_properties(trainer.ctx.device).total_memory if cuda else None
    return {"share_prompts": share_prompts, "compiled": getattr(trainer.config, "compile", "off") != "off",
            "compile_s": compiling, "microbatches": microbatches, "forwarded_tokens": forwarded,
            "sample_tokens": float(batch["num_tokens"].sum()), "steps_s": seconds, "step_s": mean,
            "tokens_per_s": float(batch["num_tokens"].sum()) / mean, "tflops_per_s": tflops,
            "mfu": tflops / peak if peak else None, "mfu_vs_gemm": tflops / gemm_tflops if gemm_tflops else None,
            "peak_memory_gib": memory / 2**30 if cuda else None,
            "peak_memory_fraction": memory / total if cuda else None,
            "state_mib": trainer.metrics.get("state_mib"), "trainer_metrics": reported}


def release(device: str) -> None:
    """A trainer's memory back to the device before the next is built."""
    import torch

    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()


def train_section(name: str, sizes: Sizes, save, *, out_dir: Path) -> dict:
    """One shape (module docstring): ``{gemm_tflops, peak_tflops, methods: {method: {..., cases}}}``,
    saved after every case (a timeout keeps what was measured)."""
    import torch

    from gpu_check.probes import gemm_tflops
    from llamarl.models.sharding import decoder_layers

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    device = sizes.device
    _, shape = SHAPES[name]
    groups = GROUPS.get(name, sizes.train_groups)
    out: dict = {"shape": name, "dtype": sizes.dtype, "microbatch_tokens": sizes.train_microbatch_tokens,
                 "group_size": sizes.train_group_size, "groups": groups, "prompt_tokens": sizes.train_prompt_tokens,
                 "completion_tokens": sizes.train_completion_tokens, "warmup": sizes.train_warmup,
                 "steps": sizes.train_steps, "methods": {}}
    out["gemm_tflops"] = gemm_tflops(device, sizes.gemm_size)
    save(out)
    ctx = world(device)
    weights_dir = out_dir / f"train-{name}-no-checkpoint"  # empty: the loader's whole-model path
    weights_dir.mkdir(parents=True, exist_ok=True)
    batch = make_batch(sizes, groups=groups, vocab=shape["vocab_size"])
    try:
        for method in METHODS[name]:
            start = time.perf_counter()
            trainer = make_trainer(ctx, name, method, sizes, weights_dir)
            synchronize(device)
            params = {id(p): p for p in trainer.model.parameters()}.values()
            entry = {"method": method, "lora_rank": sizes.train_lora_rank if method == "lora" else None,
                     "init_s": time.perf_counter() - start, "params": sum(p.numel() for p in params),
                     "trainable": sum(p.numel() for p in params if p.requires_grad),
                     "activation_checkpointing": any("forward" in vars(layer) for layer in decoder_layers(trainer.model)),
                     "cases": []}
            out["methods"][method] = entry
            out["peak_tflops"] = trainer.peak_tflops
            if device.startswith("cuda"):
                out["device"] = torch.cuda.get_device_name()
                out["device_memory_gib"] = torch.cuda.get_device_properties(0).total_memory / 2**30
            save(out)
            for share in (True, False):
                entry["cases"].append(measure_case(trainer, batch, sizes, share_prompts=share,
                                                   gemm_tflops=out["gemm_tflops"]))
                save(out)
            del trainer, params
            release(device)
        if sizes.train_compile:  # opt-in (--train-compile): the first method again, layers compiled
            method = METHODS[name][0]
            trainer = make_trainer(ctx, name, method, sizes, weights_dir, compiled=True)
            out["methods"][method]["cases"].append(measure_case(trainer, batch, sizes, share_prompts=True,
                                                                gemm_tflops=out["gemm_tflops"]))
            save(out)
            del trainer
            release(device)
    finally:
        ctx.destroy()
        with contextlib.suppress(OSError):
            weights_dir.rmdir()
    return out
