"""Issue 46's proxy for host syncs: a training step reads one device value.

``tests/fake_cuda.py``'s ``OpCounter`` over a whole ``TrainerExecutor.train_on`` (FSDP2 on 1 and 2
gloo ranks, shared prompts, one micro-batch at budget 4096 or several at budget 12, AIPO and
decoupled PPO with A-3PO's log-linear proximal policy): on a GPU every host read of a device value
is a synchronisation, on this CPU they are free, so they are counted. The trainer's host planning
(``plan_batch`` / ``plan_minibatch``: advantages, staleness, counts, packing, shared-prompt
layouts) works on the batch's host copy and is counted apart, as are AdamW's reads of each
parameter's ``step`` count (PyTorch keeps those on the host unless ``capturable`` / ``fused``: one
per parameter, no sync on a GPU, asserted to be exactly that many); everything else must read at most
one value per optimizer step (the step's metrics, gradient norm and non-finite decision, read
together), and the metrics are exactly those of the same step uncounted.

Before issue 46 the same step read 34 device values on 1 rank at budget 4096 with AIPO (72 with
decoupled PPO at budget 12; AdamW's host reads apart, as here): ``float(loss)`` and
``float(mask.sum())`` per micro-batch, the shared-prompt packing's ``tolist``, the micro-batch
trimming, the metric reductions, the log-linear prox's version checks.
"""

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from launch import check, run_torchrun
from test_trainer import setup  # noqa: F401 - a fixture: tiny model + batch
from trainer_reference import TrainerWorlds, read_update

CASES = [(1, 4096), (2, 12)]
LOSSES = ("aipo", "decoupled_ppo")
JOBS = {
    **{f"plain_{nproc}_{budget}_{loss}": (nproc, ["--budget", str(budget), "--loss", loss])
       for nproc, budget in CASES for loss in LOSSES},
    **{f"reads_{nproc}_{budget}_{loss}": (nproc, ["--budget", str(budget), "--loss", loss, "--count-host-reads"])
       for nproc, budget in CASES for loss in LOSSES},
}


@pytest.fixture(scope="module")
def worlds(setup):  # noqa: F811 - the fixture's value
    tmp, model_dir, _ = setup
    return TrainerWorlds(tmp, model_dir, JOBS, lambda plan_file, nproc: check(run_torchrun(
        "trainer_world.py", nproc=nproc, args=["--plan", str(plan_file)], timeout_s=600)))


@pytest.mark.parametrize("loss_name", LOSSES)
@pytest.mark.parametrize(("nproc", "budget"), CASES)
def test_a_training_step_reads_one_device_value(worlds, nproc, budget, loss_name):
    out = worlds.out(f"reads_{nproc}_{budget}_{loss_name}")
    reads = [json.loads(Path(f"{out}.reads{rank}.json").read_text()) for rank in range(nproc)]
    metrics, _, _ = read_update(out)
    assert "loss" in metrics and "skipped" not in metrics, metrics  # one optimizer step was taken
    assert all(rank["device"] <= 1 for rank in reads), reads
    assert all(rank["optimizer"] == rank["params"] for rank in reads), reads
    assert any(rank["host"] > 0 for rank in reads), reads  # the planning is on the host, not gone
    plain, _, _ = read_update(worlds.out(f"plain_{nproc}_{budget}_{loss_name}"))
    metrics.pop("prox_seconds", None), plain.pop("prox_seconds", None)  # timings
    assert metrics == plain
    assert metrics["entropy"] > 0  # the policy's entropy over the trained tokens (the fused head's)
