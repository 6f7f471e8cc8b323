"""Trainer checkpoint save on N ranks / load on M ranks (the whole world is the trainer).

usage: reshard_world.py --model-dir MODEL_DIR --batch BATCH.safetensors --job CKPT_DIR OUT MODE
                        [--job CKPT_DIR OUT MODE ...]

Each ``--job`` (CKPT_DIR, OUT, MODE) runs in turn on a freshly built trainer in the same world (one
start-up for several checks). MODE: save|load|train|save-train|bad-groups|no-grad.
save: one training step, then ``save_checkpoint(CKPT_DIR)``. load: ``load_checkpoint(CKPT_DIR)``.
train: one training step only. save-train: ``save_checkpoint(CKPT_DIR)`` before any step, then one
step (a save must not change what the step does). bad-groups: ``train_on`` a batch without
``group_size`` and one missing a group's row; OUT is then a text file of the two error messages.
save-lora / load-lora: save / load with ``--trainer.lora.rank 4`` (OUT then holds the adapters under
their wire names and their AdamW state). no-grad: ``sequence_logprobs`` (the proximal forward, no backward follows); OUT is then a JSON
list of the parameters that are not DTensors afterwards (each rank: OUT.rank<r>).
Either way rank 0 then writes the full parameters and the full AdamW state (``exp_avg.<name>``,
``exp_avg_sq.<name>``, ``step.<name>``) to OUT, and the version in its metadata.
"""

import argparse
import json
import os
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch.distributed.tensor import DTensor

from llamarl.algorithms.config import AlgoConfig
from llamarl.channels.base import balanced_group_partition
from llamarl.executors.config import TrainerConfig
from llamarl.executors.trainer import TrainerExecutor
from llamarl.models.config import LoraConfig, ModelConfig
from llamarl.runtime.batch import TensorBatch
from llamarl.runtime.world import ExecutorContext, ExecutorSpec

MODES = ("save", "load", "train", "save-train", "bad-groups", "no-grad", "save-lora", "load-lora")


def full(t):
    return t.full_tensor() if isinstance(t, DTensor) else t


def run_mode(ctx, model_dir: str, batch: TensorBatch, ckpt: str, out: str, mode: str) -> None:
    """One MODE (see the module docstring) on a freshly built trainer."""
    lora = LoraConfig(rank=4) if mode.endswith("-lora") else LoraConfig()
    mode = mode.removesuffix("-lora")
    trainer = TrainerExecutor(ctx, model_config=ModelConfig(name=model_dir),
                              config=TrainerConfig(lr=1e-2, grad_clip=0.5, lora=lora), algo=AlgoConfig(), temperature=0.8)
    trainer.init()
    directory = Path(ckpt)
    shard = batch.select(balanced_group_partition(batch, ctx.local_world_size)[ctx.local_rank])
    if mode == "bad-groups":
        errors = []
        for bad in (TensorBatch(dict(batch.fields), {}), batch.select(list(range(1, len(batch))))):
            try:
                trainer.train_on(bad)
            except ValueError as exc:
                errors.append(str(exc))
        Path(out).write_text("\n".join(errors))
        return
    if mode == "no-grad":
        from llamarl.models.microbatch import sequence_logprobs

        with torch.no_grad():
            sequence_logprobs(trainer.model, trainer.prepare(shard), temperature=0.8, max_tokens_per_microbatch=4096,
                              group=ctx.group, device=ctx.device)
        whole = [n for n, p in trainer.model.named_parameters() if not isinstance(p, DTensor)]
        Path(f"{out}.rank{ctx.rank}").write_text(json.dumps(whole))
        return
    if mode == "load":
        trainer.load_checkpoint(directory)
    if mode == "save-train":
        directory.mkdir(parents=True, exist_ok=True)
        trainer.save_checkpoint(directory)
    if mode in ("save", "train", "save-train"):
        trainer.train_on(shard)
    if mode == "save":
        directory.mkdir(parents=True, exist_ok=True)
        trainer.save_checkpoint(directory)
    model = trainer.get_model()
    tensors = {name: full(p).detach() for name, p in model.named_parameters()}
    for name, p in model.named_parameters():
        for key, value in trainer.optimizer.state[p].items():
            tensors[f"{key}.{name}"] = full(value).detach().reshape(-1) if value.dim() == 0 else full(value).detach()
    if ctx.rank == 0:
        save_file({k: v.contiguous() for k, v in tensors.items()}, out,
                  metadata={"version": json.dumps(trainer.version)})


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--model-dir", required=True)
    parser.add_argument("--batch", required=True, help="the training batch (safetensors)")
    parser.add_argument("--job", nargs=3, action="append", required=True, metavar=("CKPT_DIR", "OUT", "MODE"),
                        help=f"run in turn, each on a fresh trainer; MODE: {'|'.join(MODES)}")
    args = parser.parse_args()
    for _, _, mode in args.job:
        if mode not in MODES:
            parser.error(f"--job MODE must be one of {'|'.join(MODES)}, got {mode!r}")
    return args


def main() -> None:
    args = parse_args()
    ctx = ExecutorContext.create([ExecutorSpec("trainer", int(os.environ["WORLD_SIZE"]))], timeout_s=60)
    batch = TensorBatch(load_file(args.batch), {"group_size": 2})
    for ckpt, out, mode in args.job:
        run_mode(ctx, args.model_dir, batch, ckpt, out, mode)
    ctx.destroy()


if __name__ == "__main__":
    main()
