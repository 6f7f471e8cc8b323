"""Trainer checkpoint save on N ranks / load on M ranks (the whole world is the trainer).

usage: reshard_world.py MODEL_DIR BATCH.safetensors CKPT_DIR OUT.safetensors save|load
save: one training step, then ``save_checkpoint(CKPT_DIR)``. load: ``load_checkpoint(CKPT_DIR)``.
Either way rank 0 then writes the full parameters and the full AdamW state (``exp_avg.<name>``,
``exp_avg_sq.<name>``, ``step.<name>``) to OUT, and the version in its metadata.
"""

import json
import os
import sys
from pathlib import Path

from safetensors.torch import load_file, save_file
from torch.distributed.tensor import DTensor

from llamarl.batch import TensorBatch
from llamarl.channels.base import balanced_group_partition
from llamarl.config import AlgoConfig, ModelConfig, TrainerConfig
from llamarl.executors.trainer import TrainerExecutor
from llamarl.world import ExecutorContext, ExecutorSpec


def full(t):
    return t.full_tensor() if isinstance(t, DTensor) else t


def main() -> None:
    model_dir, batch_path, ckpt, out, mode = sys.argv[1:6]
    ctx = ExecutorContext.create([ExecutorSpec("trainer", int(os.environ["WORLD_SIZE"]))], timeout_s=60)
    trainer = TrainerExecutor(ctx, model_config=ModelConfig(name=model_dir),
                              config=TrainerConfig(lr=1e-2, grad_clip=0.5), algo=AlgoConfig(), temperature=0.8)
    trainer.init()
    directory = Path(ckpt)
    if mode == "save":
        batch = TensorBatch(load_file(batch_path), {"group_size": 2})
        trainer.train_on(batch.select(balanced_group_partition(batch, ctx.local_world_size)[ctx.local_rank]))
        directory.mkdir(parents=True, exist_ok=True)
        trainer.save_checkpoint(directory)
    else:
        trainer.load_checkpoint(directory)
    model = trainer.get_model()
    tensors = {name: full(p).detach() for name, p in model.named_parameters()}
    for name, p in model.named_parameters():
        for key, value in trainer.optimizer.state[p].items():
            tensors[f"{key}.{name}"] = full(value).detach().reshape(-1) if value.dim() == 0 else full(value).detach()
    if ctx.rank == 0:
        save_file({k: v.contiguous() for k, v in tensors.items()}, out,
                  metadata={"version": json.dumps(trainer.version)})
    ctx.destroy()


if __name__ == "__main__":
    main()
