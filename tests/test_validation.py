"""Bad input is a one-line ValueError naming the flag and value, before any process group exists, and
under torchrun one line ``llamarl: config error: ...`` for the whole job; a crash's failure line
carries the exception's whole message."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from huggingface_hub import constants as hf_constants

sys.path.insert(0, str(Path(__file__).parent))
from launch import REPO, run_torchrun

from llamarl.algorithms.config import AlgoConfig
from llamarl.engines.engine_configs import TorchEngineConfig, VLLMEngineConfig
from llamarl.executors.config import GeneratorConfig, RewardConfig, TrainerConfig
from llamarl.models.config import ModelConfig
from llamarl.rl.config import RLConfig
from llamarl.rl.config_checks import validate_config
from llamarl.rl.standard_pipeline import standard_pipeline
from llamarl.rl.task import Task
from llamarl.run.config import RunConfig
from llamarl.run.controller import ExecutorController
from llamarl.runtime import errors


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
    (lambda: GeneratorConfig(max_num_seqs=0), "--generator.max-num-seqs must be >= 1, got 0"),
    (lambda: TorchEngineConfig(eos_check_every=0), "--generator.torch.eos-check-every must be >= 1, got 0"),
    (lambda: TorchEngineConfig(static_decode="always"), "--generator.torch.static-decode must be one of"),
    (lambda: VLLMEngineConfig(kv_cache_gib=0), "--generator.vllm.kv-cache-gib must be > 0, got 0"),
    (lambda: VLLMEngineConfig(gpu_memory_utilization=1.5),
     "--generator.vllm.gpu-memory-utilization must be in \\(0, 1\\], got 1.5"),
    (lambda: RewardConfig(num_ranks=-1), "--reward.num-ranks must be >= 0 \\(0: on the trainer's ranks\\), got -1"),
    (lambda: RunConfig(max_steps=-1), "--run.max-steps must be >= 0, got -1"),
    (lambda: RunConfig(num_eval_problems=-2), "--run.num-eval-problems must be >= 0, got -2"),
    (lambda: AlgoConfig(loss="grpo++"), "--algo.loss 'grpo\\+\\+' is not registered; known: \\['aipo'"),
    (lambda: AlgoConfig(advantage="gae"), "--algo.advantage 'gae' is not registered"),
])
def test_field_errors(make, message):
    with pytest.raises(ValueError, match=message):
        make()


def test_good_config_passes(model_dir, tmp_path):
    validate_config(config(model_dir, tmp_path))
    validate_config(config(model_dir, tmp_path, run=RunConfig(schedule="colocated", output_dir=str(tmp_path))))


def test_missing_model_directory(tmp_path):
    with pytest.raises(ValueError, match=f"--model.name {tmp_path}/nope: no such model directory"):
        validate_config(config(tmp_path / "nope", tmp_path))


def test_unwritable_output_directory(model_dir, tmp_path):
    # A path under a regular file can never be created (permission bits would not stop root).
    (tmp_path / "file").write_text("x")
    cfg = config(model_dir, tmp_path, run=RunConfig(output_dir=str(tmp_path / "file" / "run")))
    with pytest.raises(ValueError, match="--run.output-dir .*/file/run: not writable"):
        validate_config(cfg)


def test_completion_budget_against_the_micro_batch_and_the_context(model_dir, tmp_path):
    with pytest.raises(ValueError, match="--generator.max-new-tokens 64 leaves no room for a prompt in "
                                         "--trainer.max-tokens-per-microbatch 64"):
        validate_config(config(model_dir, tmp_path, generator=GeneratorConfig(max_new_tokens=64),
                               trainer=TrainerConfig(max_tokens_per_microbatch=64)))
    context = json.loads((Path(model_dir) / "config.json").read_text())["max_position_embeddings"]
    with pytest.raises(ValueError, match=f"does not fit the model's context of {context} tokens"):
        validate_config(config(model_dir, tmp_path, generator=GeneratorConfig(max_new_tokens=context)))


def test_rloo_needs_groups_and_the_split_needs_ranks(model_dir, tmp_path):
    with pytest.raises(ValueError, match="--algo.advantage rloo needs --generator.samples-per-prompt >= 2, got 1"):
        validate_config(config(model_dir, tmp_path, algo=AlgoConfig(advantage="rloo"),
                               generator=GeneratorConfig(samples_per_prompt=1)))
    with pytest.raises(ValueError, match=r"^--generator.num-ranks 1 \+ --reward.num-ranks 1 \+ at least 1 trainer rank "
                                         r"= 3 > the world size 2 .*or use --run.schedule colocated$"):
        standard_pipeline(config(model_dir, tmp_path, reward=RewardConfig(num_ranks=1)), Task(None, scorer="arithmetic")).specs(2)
    # The reward on the trainer's ranks (the default): a generator rank and a trainer rank suffice.
    pipeline = standard_pipeline(config(model_dir, tmp_path), Task(None, scorer="arithmetic"))
    assert [(s.name, s.num_ranks) for s in pipeline.specs(2)] == [("generator", 1), ("trainer", 1), ("reward", 1)]
    with pytest.raises(ValueError, match=r"^--generator.num-ranks 1 \+ at least 1 trainer rank = 2 > the world size 1"):
        pipeline.specs(1)


def test_wait_needs_a_staleness_bound_the_schedule_can_meet(model_dir, tmp_path):
    wait = AlgoConfig(max_staleness=1, stale_policy="wait")
    with pytest.raises(ValueError, match="--algo.max-staleness 1 is below the pipeline's lag \\(2 versions: "
                                         "--run.schedule async, --run.async-lag 2"):
        validate_config(config(model_dir, tmp_path, algo=wait, run=RunConfig(async_lag=2, output_dir=str(tmp_path))))
    validate_config(config(model_dir, tmp_path, algo=wait))  # the default lag 1 meets eta 1
    with pytest.raises(ValueError, match="\\(3 versions: .* --trainer.num-minibatches 2\\)"):
        validate_config(config(model_dir, tmp_path, algo=wait, run=RunConfig(async_lag=1, output_dir=str(tmp_path)),
                               trainer=TrainerConfig(num_minibatches=2)))


def recipe_world(tmp_path, *flags: str, nproc: int = 3) -> tuple[subprocess.CompletedProcess, list[str]]:
    """``torchrun --standalone -m recipes.arithmetic *flags`` (``nproc`` CPU ranks): the process and
    every rank's output (stdout + stderr, one file each: torchrun ``--redirects 3``)."""
    logs = tmp_path / "logs"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
                           "--monitor-interval=0.5", f"--log-dir={logs}", "--redirects=3", "-m", "recipes.arithmetic",
                           *flags], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300, check=False)
    ranks = [f.read_text() for f in sorted(logs.glob("**/std*.log"))]
    assert len(ranks) == 2 * nproc, (proc.stderr[-3000:], ranks)
    return proc, ranks


@pytest.mark.parametrize("case", ["rank split", "model path", "output dir"])
def test_a_config_error_is_one_line_for_the_whole_job(case, tmp_path):
    """Every rank finds it before any process group; rank 0 alone prints it, no traceback, exit 2."""
    out = tmp_path / "run"
    (tmp_path / "file").write_text("x")
    flags, message = {
        "rank split": (["--generator.num-ranks", "5"], "+ at least 1 trainer rank = 6 > the world size 3"),
        "model path": (["--model.name", str(tmp_path / "nope")], f"--model.name {tmp_path}/nope: no such model"),
        "output dir": (["--run.output-dir", str(tmp_path / "file" / "run")], "/file/run: not writable"),
    }[case]
    proc, ranks = recipe_world(tmp_path, "--run.output-dir", str(out), *flags)
    everything = "\n".join([proc.stdout, proc.stderr, *ranks])
    lines = [line for line in everything.splitlines() if "config error" in line]
    assert len(lines) == 1 and lines[0].startswith("llamarl: config error: ") and message in lines[0], everything
    assert not any("Traceback" in rank for rank in ranks), ranks
    # torchrun's own report (its stack, never ours) names rank 0 as the root cause, with exit code 2;
    # torchrun itself exits 1 whatever its workers' codes.
    assert f'File "{REPO / "llamarl"}' not in everything and f'File "{REPO / "recipes"}' not in everything
    assert re.search(r"Root Cause.*\n.*\n.*\n.*host.*\n\s*rank\s*: 0 \(local_rank: 0\)\n\s*exitcode\s*: 2 ", proc.stderr), \
        proc.stderr
    assert proc.returncode == 1
    assert not out.exists() and not (tmp_path / "runs").exists()


def test_a_rejected_flag_is_shown_by_one_rank(tmp_path):
    """tyro's error box (a per-field check in ``__post_init__``) comes from rank 0 only."""
    proc, ranks = recipe_world(tmp_path, "--trainer.lr", "0")
    everything = "\n".join([proc.stdout, proc.stderr, *ranks])
    assert everything.count("--trainer.lr must be > 0") == 1, everything
    assert not any("Traceback" in rank for rank in ranks), ranks
    assert proc.returncode != 0


def test_without_torchrun_a_config_error_exits_2_with_the_line_alone(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    proc = subprocess.run([sys.executable, "-m", "recipes.arithmetic", "--generator.num-ranks", "5"], cwd=REPO,
                          env={**env, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=120,
                          check=False)
    assert proc.returncode == 2
    assert proc.stderr == ("llamarl: config error: --generator.num-ranks 5 + at least 1 "
                           "trainer rank = 6 > the world size 1 (torchrun --nproc-per-node); or use --run.schedule "
                           "colocated\n"), proc.stderr


def test_config_errors_reports_once_and_only_before_the_world(monkeypatch, capsys):
    monkeypatch.setattr(errors, "world_made", lambda: False)
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(SystemExit) as exit_info, errors.config_errors():
        raise ValueError("--x.y 3: bad\nsecond line")
    assert exit_info.value.code == 2
    assert capsys.readouterr().err == "llamarl: config error: --x.y 3: bad | second line\n"
    # Another rank stays quiet while rank 0 reports (torchrun ends it); one that outlives the wait
    # (rank 0 found nothing) reports itself.
    monkeypatch.setenv("RANK", "2")
    monkeypatch.setattr(errors, "REPORTER_GRACE_S", 0.0)
    with pytest.raises(SystemExit) as exit_info, errors.config_errors():
        raise ValueError("--x.y 3: bad")
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.startswith("llamarl: config error: --x.y 3: bad (found on rank 2; rank 0 did not")
    # Once the world exists a ValueError is a failure of the run, left to the controller.
    monkeypatch.setattr(errors, "world_made", lambda: True)
    with pytest.raises(ValueError, match="during the run"), errors.config_errors():
        raise ValueError("during the run")
    assert capsys.readouterr().err == ""


def test_the_failure_line_carries_a_message_whose_first_line_is_empty():
    controller = ExecutorController.__new__(ExecutorController)
    controller.ctx = SimpleNamespace(executor="trainer", rank=3, local_rank=0)
    controller.step_index, controller._phase = 1, "checkpoint"
    line = controller.failure_line(RuntimeError("\nSome tensors share memory, this will lead to duplicate memory "
                                                "on disk and potential differences when loading them again: "
                                                "[{'lm_head.weight', 'model.embed_tokens.weight'}].\n"))
    assert line == ("llamarl: executor 'trainer' (rank 3, local rank 0) failed at step 1 during checkpoint: "
                    "RuntimeError: Some tensors share memory, this will lead to duplicate memory on disk and "
                    "potential differences when loading them again: [{'lm_head.weight', "
                    "'model.embed_tokens.weight'}].")
    assert controller.failure_line(RuntimeError()).endswith("during checkpoint: RuntimeError")
    assert "\n" not in controller.failure_line(ValueError("a\n\n  b  \nc")) and \
        controller.failure_line(ValueError("a\n\n  b  \nc")).endswith("ValueError: a | b | c")
    long = controller.failure_line(RuntimeError("x" * 2000))
    assert long.endswith("RuntimeError: " + "x" * 497 + "...")


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs Linux /proc")
def test_an_output_directory_nobody_can_create_is_not_writable(model_dir, tmp_path):
    # /proc passes os.access for root, yet no directory can be made in it.
    with pytest.raises(ValueError, match="--run.output-dir /proc/llamarl-x: not writable"):
        validate_config(config(model_dir, tmp_path, run=RunConfig(output_dir="/proc/llamarl-x")))
    validate_config(config(model_dir, tmp_path))
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".llamarl-probe")]  # the probe is removed


def test_an_uncached_hub_id_offline_is_a_missing_model(model_dir, tmp_path, monkeypatch):
    cfg = config(model_dir, tmp_path, model=ModelConfig(name="no-such-org-llamarl/no-such-model"))
    monkeypatch.setattr(hf_constants, "HF_HUB_OFFLINE", False)
    validate_config(cfg)  # online, a hub id is checked when it is downloaded
    monkeypatch.setattr(hf_constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(ValueError, match="--model.name no-such-org-llamarl/no-such-model: no such model directory, "
                                         "not a built-in alias .* not in the local Hugging Face cache"):
        validate_config(cfg)


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
