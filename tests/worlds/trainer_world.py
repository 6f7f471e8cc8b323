"""One TrainerExecutor step on N ranks (the whole world is the trainer).

usage: trainer_world.py MODEL_DIR BATCH.safetensors OUT.safetensors MAX_TOKENS_PER_MICROBATCH LOSS [MAX_STALENESS|none] [normalize]
Rank 0 writes the full updated parameters, their gradients (``grad.<name>``, after clipping) and
the step's metrics (as a JSON string in metadata).
"""

import json
import sys

from safetensors.torch import load_file, save_file
from torch.distributed.tensor import DTensor

from llamarl.algorithms.losses import aipo_loss
from llamarl.algorithms.registry import register_policy_loss
from llamarl.batch import TensorBatch
from llamarl.channels.base import balanced_group_partition
from llamarl.config import AlgoConfig, ModelConfig, TrainerConfig
from llamarl.executors.trainer import TrainerExecutor
from llamarl.models.sharding import full_named_parameters
from llamarl.world import ExecutorContext, ExecutorSpec


@register_policy_loss("aipo_x2", metrics={"rows": "sum", "clip_fraction": "mean"})
def aipo_x2(*, logp, behav_logp, prox_logp, advantages, mask, algo, num_loss_tokens):
    """A loss registered from user code: twice AIPO, with a summed metric (rows per micro-batch)."""
    loss, metrics = aipo_loss(logp=logp, behav_logp=behav_logp, advantages=advantages, mask=mask, rho=algo.rho,
                              num_loss_tokens=num_loss_tokens)
    return 2 * loss, {"rows": float(logp.shape[0]), "clip_fraction": metrics["clip_fraction"]}


def budget_config(budget: str) -> dict:
    """``"12"``: dynamic micro-batches of at most 12 tokens; ``"rows3"``: fixed micro-batches of 3 rows."""
    if budget.startswith("rows"):
        return {"microbatch_rows": int(budget.removeprefix("rows"))}
    return {"max_tokens_per_microbatch": int(budget)}


def main() -> None:
    model_dir, batch_path, out_path, budget, loss = sys.argv[1:6]
    max_staleness = int(sys.argv[6]) if len(sys.argv) > 6 and sys.argv[6] != "none" else None
    normalize_batch = len(sys.argv) > 7 and sys.argv[7] == "normalize"
    ctx = ExecutorContext.create([ExecutorSpec("trainer", int(__import__("os").environ["WORLD_SIZE"]))], timeout_s=60)
    trainer = TrainerExecutor(ctx, model_config=ModelConfig(name=model_dir),
                              config=TrainerConfig(lr=1e-2, grad_clip=0.5, **budget_config(budget)),
                              algo=AlgoConfig(loss=loss, prox="loglinear", max_staleness=max_staleness,
                                             normalize_batch=normalize_batch), temperature=0.8)
    trainer.init()
    trainer.version = 3  # versions in the batch are 1..3: exercises staleness and log-linear prox
    full = TensorBatch(load_file(batch_path), {"group_size": 2})
    part = full.select(balanced_group_partition(full, ctx.local_world_size)[ctx.local_rank])
    metrics = trainer.train_on(part)
    model = trainer.get_model()
    params = full_named_parameters(model)
    # The optimizer keeps the clipped gradients after its step (zero_grad runs before the next one).
    grads = {f"grad.{name}": (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad)
             for name, p in model.named_parameters()}
    if ctx.rank == 0:
        save_file({k: v.detach().contiguous() for k, v in {**params, **grads}.items()}, out_path,
                  metadata={"metrics": json.dumps(metrics)})
    ctx.destroy()


if __name__ == "__main__":
    main()
