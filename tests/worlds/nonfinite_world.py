"""Non-finite training steps on N trainer ranks (the whole world is the trainer).

usage: nonfinite_world.py --model-dir MODEL_DIR --batch BATCH.safetensors --out OUT.json --pattern PATTERN
                          --max-nonfinite N
PATTERN is a string of ``n`` (a batch whose first row's behaviour log-prob is NaN: only the rank
holding that row sees it) and ``f`` (the finite batch), one ``train_on`` per letter. Rank 0 writes
the metrics of every step and whether each step changed the weights.
"""

import argparse
import json
import os

import torch
from safetensors.torch import load_file

from llamarl.algorithms.config import AlgoConfig
from llamarl.channels.base import balanced_group_partition
from llamarl.executors.config import TrainerConfig
from llamarl.executors.trainer import TrainerExecutor
from llamarl.models.config import ModelConfig
from llamarl.models.sharding import full_named_parameters
from llamarl.runtime.batch import TensorBatch
from llamarl.runtime.world import ExecutorContext, ExecutorSpec


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--model-dir", required=True)
    parser.add_argument("--batch", required=True, help="the finite batch (safetensors)")
    parser.add_argument("--out", required=True, help="rank 0's JSON records")
    parser.add_argument("--pattern", required=True, help="one train_on per letter: n (NaN batch) or f (finite)")
    parser.add_argument("--max-nonfinite", type=int, required=True, help="--trainer.max-nonfinite-steps")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    ctx = ExecutorContext.create([ExecutorSpec("trainer", int(os.environ["WORLD_SIZE"]))], timeout_s=60)
    trainer = TrainerExecutor(ctx, model_config=ModelConfig(name=args.model_dir),
                              config=TrainerConfig(lr=1e-2, max_nonfinite_steps=args.max_nonfinite),
                              algo=AlgoConfig(), temperature=0.8)
    trainer.init()
    finite = TensorBatch(load_file(args.batch), {"group_size": 2})
    poisoned = TensorBatch(dict(finite.fields), {"group_size": 2})
    behav = poisoned["behav_logp"].clone()
    behav[0, poisoned["loss_mask"][0].bool()] = float("nan")
    poisoned.fields["behav_logp"] = behav
    records = []
    for letter in args.pattern:
        batch = poisoned if letter == "n" else finite
        before = {k: v.clone() for k, v in full_named_parameters(trainer.get_model()).items()}
        metrics = trainer.train_on(batch.select(balanced_group_partition(batch, ctx.local_world_size)[ctx.local_rank]))
        after = full_named_parameters(trainer.get_model())
        changed = any(not torch.equal(before[k], after[k]) for k in before)
        records.append({"metrics": metrics, "changed": changed})
    if ctx.rank == 0:
        with open(args.out, "w") as f:
            f.write(json.dumps(records))
    ctx.destroy()


if __name__ == "__main__":
    main()
