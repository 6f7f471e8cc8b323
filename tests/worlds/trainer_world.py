"""``TrainerExecutor.train_on`` on N ranks (the whole world is the trainer), each on its part of one batch.

usage: trainer_world.py --model-dir MODEL_DIR --batch BATCH.safetensors --out OUT.safetensors
                        [--budget 4096|rowsN] [--loss aipo] [--max-staleness ETA|none] [--normalize-batch]
                        [--prox recompute|loglinear] [--num-minibatches K] [--lr LR] [--optimizer adamw|sgd]
                        [--probes]
       trainer_world.py --plan JOBS.json

``--plan``: a JSON list of such argument lists, each a whole job (its own trainer, optimizer and
``--out``), run one after the other in this one world: the process start, imports and process
group are paid once for all the jobs of a rank count (the tests' parity cases: ``run_trainer_jobs``
in tests/trainer_reference.py).

The trainer runs at version ``CURRENT_VERSION`` (the batch's tokens are versions 1..3: exercises
staleness and the log-linear prox) with the hyper-parameters of ``tests/trainer_reference.py``.
Rank 0 writes the full updated parameters, their gradients (``grad.<name>``, after clipping; of the
last optimizer step) and the batch's metrics (as a JSON string in metadata). ``--probes`` (with
``--loss probe_decoupled_ppo``): every rank also writes ``OUT.rank<r>.json``, per micro-batch
(minibatch index, max |logp - prox| over its loss tokens). ``--count-host-reads``: every rank writes
``OUT.reads<r>.json``, ``{"device": n, "host": m, "optimizer": o, "params": p}``: the host reads
(``tests/fake_cuda.py``'s ``OpCounter``) of its ``train_on``, those of the trainer's host planning
(``plan_batch`` / ``plan_minibatch``, which work on the batch's host copy) and of the optimizer's
step counted apart (``count_host_reads``); ``p`` trainable parameters.
"""

import argparse
import json
import os
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch.distributed.tensor import DTensor
from trainer_reference import CLIP, CURRENT_VERSION, EPS, LR, RHO, TEMPERATURE

from llamarl.algorithms.config import AlgoConfig
from llamarl.algorithms.losses import aipo_loss, decoupled_ppo_loss
from llamarl.algorithms.registered import register_policy_loss
from llamarl.channels.base import balanced_group_partition
from llamarl.executors.config import TrainerConfig
from llamarl.executors.trainer import TrainerExecutor
from llamarl.models.config import ModelConfig
from llamarl.models.sharding import full_named_parameters
from llamarl.runtime.batch import TensorBatch
from llamarl.runtime.world import ExecutorContext, ExecutorSpec

PROBES: list[tuple[int, float]] = []  # (minibatch, max |logp - prox| on loss tokens), per micro-batch
MINIBATCH = [0]


@register_policy_loss("aipo_x2", metrics={"rows": "sum", "clip_fraction": "mean"})
def aipo_x2(*, logp, behav_logp, prox_logp, advantages, mask, algo, num_loss_tokens):
    """A loss registered from user code: twice AIPO, with a summed metric (rows per micro-batch)."""
    loss, metrics = aipo_loss(logp=logp, behav_logp=behav_logp, advantages=advantages, mask=mask, rho=algo.rho,
                              num_loss_tokens=num_loss_tokens)
    return 2 * loss, {"rows": float(logp.shape[0]), "clip_fraction": metrics["clip_fraction"]}


@register_policy_loss("probe_decoupled_ppo", needs_prox=True, metrics={
    "importance_weight_mean": "mean", "importance_weight_max": "max", "approx_kl": "mean",
    "clip_fraction": "mean", "behav_weight_mean": "mean", "behav_capped_fraction": "mean"})
def probe_decoupled_ppo(*, logp, behav_logp, prox_logp, advantages, mask, algo, num_loss_tokens):
    """Decoupled PPO, recording how far the proximal log-probs are from the current ones."""
    gap = torch.where(mask.bool(), (logp.detach() - prox_logp).abs(), 0.0).max()
    PROBES.append((MINIBATCH[0], float(gap)))
    return decoupled_ppo_loss(logp=logp, prox_logp=prox_logp, behav_logp=behav_logp, advantages=advantages, mask=mask,
                              eps_clip=algo.eps_clip, num_loss_tokens=num_loss_tokens)


def budget_config(budget: str) -> dict:
    """``"12"``: dynamic micro-batches of at most 12 tokens; ``"rows3"``: fixed micro-batches of 3 rows."""
    if budget.startswith("rows"):
        return {"microbatch_rows": int(budget.removeprefix("rows"))}
    return {"max_tokens_per_microbatch": int(budget)}


def staleness(text: str) -> int | None:
    """``--algo.max-staleness``: an int, or ``none`` (no limit)."""
    return None if text == "none" else int(text)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--model-dir", required=True)
    parser.add_argument("--batch", required=True, help="the whole batch (safetensors); each rank trains its part")
    parser.add_argument("--out", required=True, help="rank 0's weights, gradients and metrics (safetensors)")
    parser.add_argument("--budget", default="4096",
                        help="micro-batches: at most N tokens (dynamic), or rowsN: N rows each (fixed)")
    parser.add_argument("--loss", default="aipo", help="--algo.loss (aipo_x2, probe_decoupled_ppo: registered here)")
    parser.add_argument("--max-staleness", type=staleness, default=None, help="--algo.max-staleness (none: no limit)")
    parser.add_argument("--normalize-batch", action="store_true", help="--algo.normalize-batch")
    parser.add_argument("--loss-agg", default="token-mean", help="--algo.loss-agg")
    parser.add_argument("--entropy-coef", type=float, default=0.0, help="--algo.entropy-coef")
    parser.add_argument("--loss-agg-length", type=int, default=16, help="--algo.loss-agg-length")
    parser.add_argument("--prox", choices=["recompute", "loglinear"], default="loglinear", help="--algo.prox")
    parser.add_argument("--num-minibatches", type=int, default=1, help="--trainer.num-minibatches")
    parser.add_argument("--lr", type=float, default=LR, help="the optimizer's learning rate")
    parser.add_argument("--optimizer", choices=["adamw", "sgd"], default="adamw",
                        help="sgd: the trainer's AdamW is swapped for plain SGD (the same lr) after init")
    parser.add_argument("--logprob-chunk-tokens", type=int, default=TrainerConfig().logprob_chunk_tokens,
                        help="--trainer.logprob-chunk-tokens (default: its default, the fused head)")
    parser.add_argument("--compile", action="store_true",
                        help="--trainer.compile layers with the aot_eager backend (each decoder layer compiled)")
    parser.add_argument("--probes", action="store_true", help="every rank writes OUT.rank<r>.json (see above)")
    parser.add_argument("--count-host-reads", action="store_true",
                        help="every rank writes OUT.reads<r>.json: the host reads of its train_on (see above)")
    return parser.parse_args(argv)


def main() -> None:
    plan = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    plan.add_argument("--plan", default=None)
    known, rest = plan.parse_known_args()
    if known.plan is None:
        jobs = [parse_args(rest)]
    else:
        with open(known.plan) as f:
            jobs = [parse_args(job) for job in json.load(f)]
    ctx = ExecutorContext.create([ExecutorSpec("trainer", int(os.environ["WORLD_SIZE"]))], timeout_s=60)
    for args in jobs:
        train(ctx, args)
    ctx.destroy()


def train(ctx: ExecutorContext, args: argparse.Namespace) -> None:
    """One job: a fresh trainer from the model on disk, one ``train_on`` of this rank's part, rank 0's output."""
    PROBES.clear()
    MINIBATCH[0] = 0
    trainer = TrainerExecutor(ctx, model_config=ModelConfig(name=args.model_dir),
                              config=TrainerConfig(lr=args.lr, grad_clip=CLIP, num_minibatches=args.num_minibatches,
                                                   logprob_chunk_tokens=args.logprob_chunk_tokens,
                                                   compile="layers" if args.compile else "off",
                                                   compile_backend="aot_eager", **budget_config(args.budget)),
                              algo=AlgoConfig(loss=args.loss, prox=args.prox, max_staleness=args.max_staleness,
                                             loss_agg=args.loss_agg, loss_agg_length=args.loss_agg_length,
                                              normalize_batch=args.normalize_batch, rho=RHO, eps_clip=EPS,
                                              entropy_coef=args.entropy_coef),
                              temperature=TEMPERATURE)
    trainer.init()
    if args.optimizer == "sgd":
        trainer.optimizer = torch.optim.SGD(trainer.model.parameters(), lr=args.lr)
    trainer.version = CURRENT_VERSION
    if args.probes:
        train_minibatch = trainer.train_minibatch

        def counted(part):
            out = train_minibatch(part)
            MINIBATCH[0] += 1
            return out

        trainer.train_minibatch = counted
    full = TensorBatch(load_file(args.batch), {"group_size": 2})
    part = full.select(balanced_group_partition(full, ctx.local_world_size)[ctx.local_rank])
    if args.count_host_reads:
        import llamarl.algorithms.prox

        llamarl.algorithms.prox.HOST_CHECKS_ON_CPU = False  # the device branch: device-side asserts
        counter = count_host_reads(trainer)
        with counter:
            metrics = trainer.train_on(part)
        Path(f"{args.out}.reads{ctx.local_rank}.json").write_text(json.dumps(
            {"device": counter.reads.get("other", 0), "host": counter.reads.get("host", 0),
             "optimizer": counter.reads.get("optimizer", 0), "params": len(trainer.trainable)}))
    else:
        metrics = trainer.train_on(part)
    model = trainer.get_model()
    params = full_named_parameters(model)
    # The optimizer keeps the clipped gradients after its step (zero_grad runs before the next one).
    grads = {f"grad.{name}": (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad)
             for name, p in model.named_parameters()}
    if ctx.rank == 0:
        save_file({k: v.detach().contiguous() for k, v in {**params, **grads}.items()}, args.out,
                  metadata={"metrics": json.dumps(metrics)})
    if args.probes:
        Path(f"{args.out}.rank{ctx.local_rank}.json").write_text(json.dumps(PROBES))


def count_host_reads(trainer: TrainerExecutor):
    """An ``OpCounter`` for ``trainer``'s step, with its host planning methods, where present,
    counted as phase ``host``, and the optimizer's step as ``optimizer`` (AdamW reads each
    parameter's ``step`` count, a host tensor unless ``capturable`` / ``fused``: no sync on a GPU)."""
    from fake_cuda import OpCounter

    counter = OpCounter()

    def in_phase(phase, method):
        def counted(*args, **kwargs):
            with counter.phase(phase):
                return method(*args, **kwargs)
        return counted

    for name in ("plan_batch", "plan_minibatch"):
        if hasattr(trainer, name):
            setattr(trainer, name, in_phase("host", getattr(trainer, name)))
    trainer.optimizer.step = in_phase("optimizer", trainer.optimizer.step)
    return counter


if __name__ == "__main__":
    main()
