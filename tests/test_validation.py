"""Bad input is a one-line ValueError naming the flag and value, before any process group exists."""

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from launch import run_torchrun
from tiny_model import save_tiny_model

from llamarl.config import (
    AlgoConfig,
    GeneratorConfig,
    ModelConfig,
    RewardConfig,
    RLConfig,
    RunConfig,
    TrainerConfig,
)
from llamarl.executors.validate import validate_config


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("validate") / "model")


def config(model_dir, tmp_path, **sections):
    base = {"model": ModelConfig(name=str(model_dir)), "run": RunConfig(output_dir=str(tmp_path / "run"))}
    return RLConfig(**{**base, **sections})


@pytest.mark.parametrize(("make", "message"), [
    (lambda: TrainerConfig(lr=0), "--trainer.lr must be > 0, got 0"),
    (lambda: TrainerConfig(lr=-1e-5), "--trainer.lr must be > 0"),
    (lambda: TrainerConfig(num_threads=0), "--trainer.num-threads must be >= 1, got 0"),
    (lambda: GeneratorConfig(num_prompts_per_step=0), "--generator.num-prompts-per-step must be >= 1"),
    (lambda: GeneratorConfig(samples_per_prompt=0), "--generator.samples-per-prompt must be >= 1"),
    (lambda: GeneratorConfig(num_ranks=3, tp=2), "must be a multiple of --generator.tp"),
    (lambda: GeneratorConfig(num_threads=0), "--generator.num-threads must be >= 1"),
    (lambda: RewardConfig(num_ranks=0), "--reward.num-ranks must be >= 1, got 0"),
    (lambda: RunConfig(max_steps=-1), "--run.max-steps must be >= 0, got -1"),
    (lambda: RunConfig(num_eval_problems=-2), "--run.num-eval-problems must be >= 0, got -2"),
    (lambda: AlgoConfig(loss="grpo++"), "--algo.loss 'grpo\\+\\+' is not registered; known: \\['aipo'"),
    (lambda: AlgoConfig(advantage="gae"), "--algo.advantage 'gae' is not registered"),
])
def test_field_errors(make, message):
    with pytest.raises(ValueError, match=message):
        make()


def test_good_config_passes(model_dir, tmp_path):
    validate_config(config(model_dir, tmp_path), world_size=3)
    validate_config(config(model_dir, tmp_path, run=RunConfig(schedule="colocated", output_dir=str(tmp_path))),
                    world_size=1)


def test_missing_model_directory(tmp_path):
    with pytest.raises(ValueError, match=f"--model.name {tmp_path}/nope: no such model directory"):
        validate_config(config(tmp_path / "nope", tmp_path), world_size=3)


def test_unwritable_output_directory(model_dir, tmp_path):
    # A path under a regular file can never be created (permission bits would not stop root).
    (tmp_path / "file").write_text("x")
    cfg = config(model_dir, tmp_path, run=RunConfig(output_dir=str(tmp_path / "file" / "run")))
    with pytest.raises(ValueError, match="--run.output-dir .*/file/run: not writable"):
        validate_config(cfg, world_size=3)


def test_completion_budget_against_the_micro_batch_and_the_context(model_dir, tmp_path):
    with pytest.raises(ValueError, match="--generator.max-new-tokens 64 leaves no room for a prompt in "
                                         "--trainer.max-tokens-per-microbatch 64"):
        validate_config(config(model_dir, tmp_path, generator=GeneratorConfig(max_new_tokens=64),
                               trainer=TrainerConfig(max_tokens_per_microbatch=64)), world_size=3)
    context = json.loads((Path(model_dir) / "config.json").read_text())["max_position_embeddings"]
    with pytest.raises(ValueError, match=f"does not fit the model's context of {context} tokens"):
        validate_config(config(model_dir, tmp_path, generator=GeneratorConfig(max_new_tokens=context)),
                        world_size=3)


def test_rloo_needs_groups_and_the_split_needs_ranks(model_dir, tmp_path):
    with pytest.raises(ValueError, match="--algo.advantage rloo needs --generator.samples-per-prompt >= 2, got 1"):
        validate_config(config(model_dir, tmp_path, algo=AlgoConfig(advantage="rloo"),
                               generator=GeneratorConfig(samples_per_prompt=1)), world_size=3)
    with pytest.raises(ValueError, match="= 3 > the world size 2 .*or use --run.schedule colocated"):
        validate_config(config(model_dir, tmp_path), world_size=2)


def test_wait_needs_a_staleness_bound_the_schedule_can_meet(model_dir, tmp_path):
    wait = AlgoConfig(max_staleness=1, stale_policy="wait")
    with pytest.raises(ValueError, match="--algo.max-staleness 1 is below what this schedule's lag makes every "
                                         "sample \\(2 versions: --run.schedule async, --run.async-lag 2"):
        validate_config(config(model_dir, tmp_path, algo=wait, run=RunConfig(async_lag=2, output_dir=str(tmp_path))),
                        world_size=3)
    validate_config(config(model_dir, tmp_path, algo=wait), world_size=3)  # the default lag 1 meets eta 1
    with pytest.raises(ValueError, match="\\(3 versions: .* --trainer.num-minibatches 2\\)"):
        validate_config(config(model_dir, tmp_path, algo=wait, run=RunConfig(async_lag=1, output_dir=str(tmp_path)),
                               trainer=TrainerConfig(num_minibatches=2)), world_size=3)


def test_a_bad_run_fails_on_every_rank_before_any_group(tmp_path):
    """Under torchrun: the one-line error, non-zero exit, and no run directory was made."""
    out = tmp_path / "run"
    logs = tmp_path / "logs"
    proc = run_torchrun("e2e_arithmetic.py", nproc=2, timeout_s=120, stderr_dir=logs, args=[
        "--model.name", str(tmp_path / "nope"), "--run.output-dir", str(out), "--run.max-steps", "1"])
    assert proc.returncode != 0
    # Per-rank files: the first rank to fail ends the world, so the other may be stopped before it prints.
    stderrs = [f.read_text() for f in sorted(logs.glob("**/stderr.log"))]
    assert len(stderrs) == 2, stderrs
    assert any(f"ValueError: --model.name {tmp_path}/nope: no such model directory" in e for e in stderrs), stderrs
    assert not out.exists()


def test_a_prompt_too_long_for_the_budget_is_skipped_and_counted(model_dir, tmp_path):
    """Every arithmetic prompt (~60 characters for the character-level tiny tokenizer) + 12 new
    tokens exceeds a 13-token micro-batch budget: each is skipped with a warning, the run goes on."""
    out = tmp_path / "run"
    proc = run_torchrun("e2e_arithmetic.py", nproc=3, timeout_s=300,
                        env={"LLAMARL_TEST_SCORER": "scorers_for_tests:first_char_even"}, args=[
        "--model.name", str(model_dir), "--run.output-dir", str(out), "--run.max-steps", "2",
        "--run.num-eval-problems", "2", "--generator.num-prompts-per-step", "3", "--reward.num-workers", "0",
        "--trainer.max-tokens-per-microbatch", "13"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    generator = [json.loads(line) for line in (out / "metrics" / "generator.jsonl").read_text().splitlines()]
    assert [r["gen_skipped_prompts"] for r in generator] == [3, 6]
    assert all(r["gen_emitted_samples"] == 0 for r in generator)
    assert "skipped: " in proc.stdout + proc.stderr and "the trainer's micro-batch budget" in proc.stdout + proc.stderr
