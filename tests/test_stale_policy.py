"""``--algo.stale-policy drop|wait`` with ``--algo.max-staleness`` eta.

* The generator alone, driven tick by tick with weight versions that advance irregularly (as a
  trainer's do: a tick without signal makes no step, minibatches make several): under ``wait`` no
  group it emits holds a token more than eta versions behind ``version + expected_lag``, and
  carried partial rollouts were restarted to get there; under ``drop`` the same run emits such
  groups (the test is not vacuous).
* Generator and trainer together in one process (this file is also that torchrun world), a
  pipeline with lag 1 or 0: under ``wait`` the trainer never trains, nor has to drop, a token older
  than eta; ``drop`` counts exactly the samples it drops; eta = 0 with ``drop`` trains only tokens
  of the trainer's own version, as the sync schedule does.
"""

from __future__ import annotations

import json
import os
import random
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from launch import check, run_torchrun

from llamarl.algorithms.config import AlgoConfig
from llamarl.data.prompts import Problem
from llamarl.engines.engine_configs import TorchEngineConfig
from llamarl.executors.config import GeneratorConfig
from llamarl.executors.generator import GeneratorExecutor
from llamarl.models.config import ModelConfig
from llamarl.runtime.batch import TensorBatch

WORLD = "../" + Path(__file__).name  # run_torchrun resolves scripts under tests/worlds/
SAMPLES = 2


class Questions:
    def sample(self, index: int) -> Problem:
        return Problem(question=f"{index} + {index} =", answer="")


def prompt_fn(tokenizer, question: str) -> list[int]:
    return list(tokenizer(question)["input_ids"])


def make_generator(model_dir, ctx, *, policy: str | None, eta: int | None, lag: int,
                   carried_cache: str = "recompute") -> GeneratorExecutor:
    """4 samples started per step (2 prompts x 2), at most 6 new tokens, 2 per step: a sample spans
    up to 3 steps, so its tokens span versions."""
    config = GeneratorConfig(num_prompts_per_step=2, samples_per_prompt=SAMPLES, max_new_tokens=6, token_budget=2,
                             temperature=1.0, torch=TorchEngineConfig(carried_cache=carried_cache))
    algo = AlgoConfig(max_staleness=eta, stale_policy=policy) if policy else None
    return GeneratorExecutor(ctx, model_config=ModelConfig(name=str(model_dir)), config=config, task=Questions(),
                             prompt_fn=prompt_fn, algo=algo, expected_lag=lag)


def oldest_versions(batch: TensorBatch) -> list[int]:
    """Per row, the version of its oldest completion token."""
    versions = batch["versions"].masked_fill(~batch["loss_mask"].bool(), 1 << 40)
    return versions.min(dim=1).values.tolist()


# ----- the generator alone -----
def run_generator(model_dir, *, policy, eta=2, lag=1, ticks=14, carried_cache="recompute"):
    torch.manual_seed(0)
    ctx = SimpleNamespace(device=torch.device("cpu"), dp_rank=0, dp_size=1, tp_rank=0, tp_size=1, local_rank=0,
                          executor="generator", ranks={"generator": [0]})
    gen = make_generator(model_dir, ctx, policy=policy, eta=eta, lag=lag, carried_cache=carried_cache)
    gen.init()
    increments = random.Random(0)
    version, emitted = 0, []
    for _ in range(ticks):
        gen.set_weights_version(version)
        gen.step()
        batch = gen.outputs.pop("rollouts", TensorBatch())
        if len(batch):
            counts = torch.bincount(batch["group_ids"])
            assert set(counts[counts > 0].tolist()) == {SAMPLES}, "groups are emitted whole"
            emitted += [(version, oldest, newest) for oldest, newest in
                        zip(oldest_versions(batch), batch["versions"].max(dim=1).values.tolist())]
        version += increments.choice([0, 1, 1, 2])  # a trainer's steps per tick: 0 (no signal) .. 2
    return gen, emitted


@pytest.mark.parametrize("carried_cache", ["recompute", "keep"])
def test_wait_emits_no_group_older_than_eta_at_training_and_restarts_carried_rollouts(model_dir, carried_cache):
    eta, lag = 2, 1
    gen, emitted = run_generator(model_dir, policy="wait", eta=eta, lag=lag, carried_cache=carried_cache)
    # "keep": carried samples resumed from their kept caches, restarted ones prefilled again.
    assert (gen.engine.kept_cache_rows > 0) == (carried_cache == "keep")
    assert len(emitted) >= 8
    assert all(version + lag - oldest <= eta for version, oldest, _ in emitted)
    assert any(newest > oldest for _, oldest, newest in emitted), "no emitted sample spans versions: vacuous"
    assert gen.metrics["gen_restarted_stale"] > 0 and gen.metrics["gen_restarted_stale"] % SAMPLES == 0


def test_drop_resumes_everything_so_the_same_run_emits_stale_groups(model_dir):
    eta, lag = 2, 1
    gen, emitted = run_generator(model_dir, policy="drop", eta=eta, lag=lag)
    assert any(version + lag - oldest > eta for version, oldest, _ in emitted)
    assert gen.metrics["gen_restarted_stale"] == 0


def test_wait_refuses_an_eta_below_the_pipeline_lag(model_dir):
    ctx = SimpleNamespace(device=torch.device("cpu"), dp_rank=0, dp_size=1, tp_rank=0, tp_size=1, local_rank=0)
    with pytest.raises(ValueError, match="--algo.max-staleness 1 is below the pipeline's lag"):
        make_generator(model_dir, ctx, policy="wait", eta=1, lag=2)
    make_generator(model_dir, ctx, policy="drop", eta=0, lag=2)  # drop: the trainer drops what is too old


def test_stale_policy_is_validated():
    with pytest.raises(ValueError, match="--algo.stale-policy wait needs --algo.max-staleness"):
        AlgoConfig(stale_policy="wait")
    with pytest.raises(ValueError, match="--algo.stale-policy must be 'drop' or 'wait', got 'later'"):
        AlgoConfig(stale_policy="later", max_staleness=1)


# ----- generator and trainer in one pipeline -----
def world_main() -> None:
    """usage: test_stale_policy.py --model-dir MODEL_DIR --out OUT.json --policy drop|wait --max-staleness ETA
    --lag LAG --ticks TICKS (one rank).

    Each tick: the generator takes the trainer's version (its weights are not copied: only the
    versions matter here), generates; its groups get random 0/1 rewards; the trainer trains the batch
    of ``LAG`` ticks ago (0: this tick's, as the sync schedule does). Writes, per tick, the trainer's
    metrics and, computed here from the batch and the trainer's version before the step, the
    samples that hold a token older than eta and the staleness of the other loss tokens.
    """
    import argparse

    from llamarl.executors.config import TrainerConfig
    from llamarl.executors.trainer import TrainerExecutor
    from llamarl.runtime.world import ExecutorContext, ExecutorSpec

    parser = argparse.ArgumentParser(description="generator and trainer in one pipeline (test_stale_policy.py)")
    parser.add_argument("--model-dir", required=True)
    parser.add_argument("--out", required=True, help="the per-tick records (JSON)")
    parser.add_argument("--policy", choices=["drop", "wait"], required=True, help="--algo.stale-policy")
    parser.add_argument("--max-staleness", type=int, required=True, help="--algo.max-staleness (eta)")
    parser.add_argument("--lag", type=int, required=True, help="ticks between generating a batch and training it")
    parser.add_argument("--ticks", type=int, required=True)
    args = parser.parse_args()
    model_dir, out, policy = args.model_dir, args.out, args.policy
    eta, lag, ticks = args.max_staleness, args.lag, args.ticks
    ctx = ExecutorContext.create([ExecutorSpec("trainer", int(os.environ["WORLD_SIZE"]))], timeout_s=60)
    torch.manual_seed(0)
    gen = make_generator(model_dir, ctx, policy=policy, eta=eta, lag=lag)
    trainer = TrainerExecutor(ctx, model_config=ModelConfig(name=model_dir), config=TrainerConfig(lr=1e-3),
                              algo=AlgoConfig(max_staleness=eta, stale_policy=policy), temperature=1.0)
    gen.init()
    trainer.init()
    rewards = torch.Generator().manual_seed(1)
    queue, records = [], []
    for _ in range(ticks):
        gen.set_weights_version(trainer.version)
        gen.step()
        batch = gen.outputs.pop("rollouts", TensorBatch())
        if len(batch):
            batch.fields["rewards"] = torch.randint(0, 2, (len(batch),), generator=rewards).float()
        queue.append(batch)
        batch = queue.pop(0) if len(queue) > lag else TensorBatch()
        record = {"version": trainer.version, "stale_samples": 0, "kept_staleness": []}
        if len(batch):
            mask = batch["loss_mask"].bool()
            staleness = (trainer.version - batch["versions"]).masked_fill(~mask, 0)
            stale = (staleness > eta).any(dim=1)
            record["stale_samples"] = int(stale.sum())
            record["kept_staleness"] = staleness[mask & ~stale.unsqueeze(1)].tolist()
        trainer.inputs["scored"] = batch
        trainer.step()
        records.append({**record, "trainer": trainer.metrics, "generator": gen.metrics})
    Path(out).write_text(json.dumps(records))
    ctx.destroy()


def run_pipeline(tmp_path, model_dir, *, policy, eta, lag, ticks=12):
    out = tmp_path / f"{policy}_{eta}_{lag}.json"
    check(run_torchrun(WORLD, nproc=1, args=["--model-dir", str(model_dir), "--out", str(out), "--policy", policy,
                                             "--max-staleness", str(eta), "--lag", str(lag), "--ticks", str(ticks)]))
    return json.loads(out.read_text())


def trained(records):
    return [r for r in records if r["trainer"].get("optimizer_steps")]


def test_wait_never_trains_a_token_older_than_eta(tmp_path, model_dir):
    eta = 2
    records = run_pipeline(tmp_path, model_dir, policy="wait", eta=eta, lag=1)
    steps = trained(records)
    assert len(steps) >= 3, "too few optimizer steps: vacuous"
    assert records[-1]["generator"]["gen_restarted_stale"] > 0, "the generator never had to act: vacuous"
    assert all(r["stale_samples"] == 0 and r["trainer"].get("dropped_stale_samples", 0) == 0 for r in records)
    assert all(r["trainer"]["staleness_max"] <= eta for r in steps)
    assert max(r["trainer"]["staleness_max"] for r in steps) >= 1  # trained tokens did span versions


def test_drop_counts_exactly_the_samples_it_drops(tmp_path, model_dir):
    eta = 1
    records = run_pipeline(tmp_path, model_dir, policy="drop", eta=eta, lag=1)
    assert sum(r["stale_samples"] for r in records) > 0, "nothing was stale: vacuous"
    assert [r["trainer"].get("dropped_stale_samples", 0) for r in records] == [r["stale_samples"] for r in records]
    assert records[-1]["generator"]["gen_restarted_stale"] == 0
    steps = trained(records)
    assert steps
    for r in steps:  # staleness over the tokens trained on
        assert r["trainer"]["staleness_max"] == max(r["kept_staleness"]) <= eta
        assert r["trainer"]["staleness_mean"] == pytest.approx(sum(r["kept_staleness"]) / len(r["kept_staleness"]))


def test_eta_0_with_drop_trains_only_on_policy_tokens_like_sync(tmp_path, model_dir):
    records = run_pipeline(tmp_path, model_dir, policy="drop", eta=0, lag=0)
    steps = trained(records)
    assert len(steps) >= 2 and sum(r["trainer"].get("dropped_stale_samples", 0) for r in records) > 0
    assert all(r["trainer"]["staleness_max"] == 0 and r["trainer"]["staleness_mean"] == 0 for r in steps)
    assert all(set(r["kept_staleness"]) <= {0} for r in records)


if __name__ == "__main__":
    world_main()
