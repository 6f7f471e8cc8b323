"""The colocated schedule (every rank generates, scores and trains) in real torchrun gloo worlds.

All runs use ``--run.device-guard`` (torch's default device is ``meta`` inside every step, channel
and evaluation), so a tensor created on an implicit device anywhere on these paths fails them.
"""

import json
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file

sys.path.insert(0, str(Path(__file__).parent))
from conftest import read_jsonl
from launch import check, run_colocated_runs, run_torchrun

# Keys that measure time, not what was computed: they differ between any two runs. Weight-sync
# keys too: sync moves weights at the start of the next tick, colocated at the end of this one; and
# the trainer's state bytes, summed over its ranks (each rank keeps its own AdamW step counters).
TIMING = ("seconds", "per_s", "time", "step", "weight_sync", "state_mib")


def flags(model_dir, out, *args):
    """Every run's flags here: the tiny model, 4 evaluation problems, 2 prompts a tick, the device guard."""
    return ["--model.name", str(model_dir), "--run.num-eval-problems", "4", "--run.output-dir", str(out),
            "--generator.num-prompts-per-step", "2", "--reward.num-workers", "0", "--run.device-guard", *args]


def run(tmp_path, model_dir, name, *, nproc, args, env=None):
    out = tmp_path / name
    check(run_torchrun("e2e_arithmetic.py", nproc=nproc, timeout_s=300, env={
        "LLAMARL_TEST_SCORER": "scorers_for_tests:recording_first_char_even",
        "LLAMARL_TEST_SAMPLES": str(tmp_path / f"samples_{name}"), **(env or {})}, args=flags(model_dir, out, *args)))
    return out


ZERO_LR = {"LLAMARL_TEST_ZERO_LR": "1"}
# The frozen-policy comparisons' common flags. fp32 compute: bf16 would round micro-batches of
# different composition differently.
FROZEN = ["--run.max-steps", "3", "--generator.token-budget", "5", "--trainer.param-dtype", "float32"]


@pytest.fixture(scope="module")
def sync3(tmp_path_factory, model_dir):
    """The reference that three frozen-policy tests compare against, run once for the module: sync on
    3 ranks (1 generator, the trainer and the reward on the other 2). ``(directory, run directory)``;
    ``samples(directory, "sync")`` are the completions it scored."""
    tmp = tmp_path_factory.mktemp("sync3")
    return tmp, run(tmp, model_dir, "sync", nproc=3, env=ZERO_LR,
                    args=[*FROZEN, "--run.schedule", "sync", "--generator.num-ranks", "1"])


def exported(run_dir, name="final"):
    """The weights a run exported as ``hf/<name>`` (``final`` or ``step_<n>``), by parameter name."""

    return load_file(str(run_dir / "hf" / name / "model.safetensors"))


def samples(tmp_path, name):
    """Every (completion, reference) any process of run ``name`` scored, as a sorted list."""
    return sorted(line for f in tmp_path.glob(f"samples_{name}.*") for line in f.read_text().splitlines())


def values(records, *, rel=1e-5):
    """Per-step metric values without the timing ones, ready for an approximate comparison."""
    return [{k: pytest.approx(v, rel=rel, abs=1e-6) for k, v in r.items() if not any(t in k for t in TIMING)}
            for r in records]


@pytest.mark.parametrize(("colocated_ranks", "sync_args"), [
    (1, ["--generator.num-ranks", "1"]),  # sync world: 1 generator + 2 trainer ranks (the reward on them)
    (2, ["--generator.num-ranks", "2"]),  # sync world: 2 generators + 2 trainer ranks (the reward on them)
])
def test_colocated_equals_sync_at_learning_rate_zero(tmp_path, model_dir, request, colocated_ranks, sync_args):
    """A frozen policy makes the schedules differ only in where things run and when: the same
    samples (every completion scored, evaluations included) and the same metrics per step."""
    colocated = run(tmp_path, model_dir, "colocated", nproc=colocated_ranks, env=ZERO_LR,
                    args=[*FROZEN, "--run.schedule", "colocated"])
    if colocated_ranks == 1:  # the 3-rank sync reference the module runs once (``sync3``)
        sync_dir, sync = request.getfixturevalue("sync3")
    else:
        sync_dir, sync = tmp_path, run(tmp_path, model_dir, "sync", nproc=colocated_ranks + 2, env=ZERO_LR,
                                       args=[*FROZEN, "--run.schedule", "sync", *sync_args])
    got, expected = samples(tmp_path, "colocated"), samples(sync_dir, "sync")
    assert len(expected) > 2 * 4 and got == expected  # more than the two evaluations scored
    for executor in ("generator", "reward", "trainer"):
        got_metrics, expected_metrics = (read_jsonl(d / "metrics" / f"{executor}.jsonl") for d in (colocated, sync))
        assert expected_metrics, executor
        assert [r["step"] for r in got_metrics] == [r["step"] for r in expected_metrics], executor
        # Trainer losses are global token means, summed in another order over another rank split.
        assert values(got_metrics) == values(expected_metrics), executor
    summary = json.loads((colocated / "summary.json").read_text())
    assert summary["schedule"] == "colocated"
    assert summary["final_accuracy"] == json.loads((sync / "summary.json").read_text())["final_accuracy"]
    # Every stage on every rank: the timeline shows each one's spans, and the evaluations by name.
    trace = json.loads((colocated / "timeline.json").read_text())
    assert {e["pid"] for e in trace["traceEvents"]} == {"generator", "reward", "trainer"}
    names = [e["name"] for e in trace["traceEvents"]]
    assert "generator eval 0" in names and "generator eval 3" in names, names
    assert all(f"{stage} step {step}" in names for stage in ("generator", "reward", "trainer") for step in range(3))


@pytest.mark.parametrize("reward_ranks", ["1", "0"])  # its own rank; on the trainer's two ranks
def test_async_lag1_scores_the_same_samples_as_sync_at_learning_rate_zero(tmp_path, model_dir, sync3, reward_ranks):
    """Asynchrony changes when things run, not what is sampled: with a frozen policy, async lag 1
    (rollouts scored within their tick) generates and scores exactly sync's completions, and its
    generator and reward metrics match step for step (the trainer's differ: it starts a tick later).
    Placement does not change it either: the reward on a rank of its own, or on the trainer's ranks
    (``--reward.num-ranks 0``, co-resident: it scores in the trainer's processes after it trains).
    The sync reference is the module's (``sync3``: the same 3 ranks, the reward on the trainer's)."""
    sync_dir, sync = sync3
    lag1 = run(tmp_path, model_dir, "lag1", nproc=3, env=ZERO_LR,
               args=[*FROZEN, "--run.schedule", "async", "--run.async-lag", "1", "--reward.num-ranks", reward_ranks])
    if reward_ranks == "0":
        trace = json.loads((lag1 / "timeline.json").read_text())
        assert {(e["pid"], e["tid"]) for e in trace["traceEvents"] if e["pid"] == "reward"} == \
            {("reward", 1), ("reward", 2)}, "the reward runs on the trainer's ranks 1 and 2"
    got, expected = samples(tmp_path, "lag1"), samples(sync_dir, "sync")
    assert len(expected) > 2 * 4 and got == expected

    def without_versions(records):
        # The weight version the generator reports lags sync's by the schedule's lag.
        return values([{k: v for k, v in r.items() if "version" not in k} for r in records])

    for executor in ("generator", "reward"):
        got_metrics, expected_metrics = (read_jsonl(d / "metrics" / f"{executor}.jsonl") for d in (lag1, sync))
        assert expected_metrics, executor
        assert without_versions(got_metrics) == without_versions(expected_metrics), executor


def test_colocated_learns_the_tiny_task(tmp_path, model_dir):
    """One process, a real learning rate: greedy held-out reward goes from ~0 to most problems.

    The reward (first character even) is one a random tiny model learns in a few dozen updates. The
    held-out greedy answers all start with the same character, so accuracy ends at 0 or 1: after 12
    updates it was 1 for 10 of 12 seeds (and 11 of 12 with the sampler's earlier random stream), after
    20 for all 12 seeds checked (0-11, 2026-11-25). The trainer's bf16 rounding moves which seeds are
    lucky: with shared prompts attending through their segments (2026-11-27) seed 0 stood at 0.56
    after 20 updates; after 30, all 12 seeds (0-11) reached 1, so the test does not hang on one
    seed's luck."""
    out = tmp_path / "learn"
    check(run_torchrun("e2e_arithmetic.py", nproc=1, timeout_s=300,
                       env={"LLAMARL_TEST_SCORER": "scorers_for_tests:first_char_even"}, args=[
        "--model.name", str(model_dir), "--run.schedule", "colocated", "--run.max-steps", "30",
        "--run.num-eval-problems", "16", "--run.output-dir", str(out), "--generator.num-prompts-per-step", "4",
        "--generator.temperature", "1.0", "--generator.max-new-tokens", "4", "--reward.num-workers", "0",
        "--trainer.lr", "3e-3", "--run.device-guard"]))
    summary = json.loads((out / "summary.json").read_text())
    assert summary["base_accuracy"] <= 0.25 and summary["final_accuracy"] >= 0.75, summary
    trainer = [r for r in read_jsonl(out / "metrics" / "trainer.jsonl") if "loss" in r]
    assert len(trainer) >= 10 and all(r["staleness_max"] == 0 for r in trainer)  # strictly on-policy
    generator = read_jsonl(out / "metrics" / "generator.jsonl")
    assert [r["gen_version"] for r in generator][:3] == [0, 1, 2]
    # Each update is copied in place into the bf16 generator model: the whole policy, every tick.
    model_bytes = 2 * sum(t.numel() for t in load_file(str(model_dir / "model.safetensors")).values())
    synced = [r["weight_sync_bytes"] for r in generator if not r["weight_sync_skipped"]]
    assert len(synced) >= 10 and set(synced) == {model_bytes}, synced


# Colocated checkpoint -> exact resume: tests/test_model_families.py (every family) and
# tests/test_default_model.py (SmolLM2).


def test_evaluations_do_not_change_training(tmp_path, model_dir):
    """Greedy evaluations between ticks draw no randomness and touch no training state: a run that
    evaluates after every tick ends with bitwise the weights of one that evaluates only at the ends."""
    import torch

    common = ["--run.schedule", "colocated", "--run.max-steps", "3", "--generator.token-budget", "5",
              "--trainer.lr", "1e-3", "--export.every", "1"]
    quiet, evaluating = tmp_path / "quiet", tmp_path / "evaluating"
    # Both one-process runs in one Python process, one after the other (imports paid once).
    # The quiet run exports every tick but not a final copy (--export.no-final: it wrote hf/final
    # anyway with --export.every set, before the controller's Upkeep took export_final).
    check(run_colocated_runs([flags(model_dir, quiet, *common, "--export.no-final"),
                              flags(model_dir, evaluating, *common, "--run.eval-every", "1")],
                             plan_file=tmp_path / "runs.json", timeout_s=300,
                             env={"LLAMARL_TEST_SCORER": "scorers_for_tests:recording_first_char_even",
                                  "LLAMARL_TEST_SAMPLES": str(tmp_path / "samples")}))
    evals = json.loads((evaluating / "summary.json").read_text())["evals"]
    assert [e["step"] for e in evals] == [0, 1, 2, 3]
    assert not (quiet / "hf" / "final").exists() and (evaluating / "hf" / "final").is_dir()
    a, b = exported(quiet, "step_3"), exported(evaluating)
    assert all(torch.equal(a[k], v) for k, v in exported(evaluating, "step_3").items())  # final = the last step's
    first = exported(quiet, "step_1")
    assert any(not torch.equal(first[k], a[k]) for k in a), "ticks 1-2 did not train"
    assert all(torch.equal(a[k], b[k]) for k in a)
