"""A run that tells you how it goes (issue 50 items 1-3 and 5): LoRA's default learning rate, the
row problems of a dataset summarised in one line, progress bars for evaluations and ticks, and an
environment that breaks its contract stopping the run with its one line."""

from __future__ import annotations

import json
import logging

import pytest
import tyro

from llamarl.executors.config import TrainerConfig
from llamarl.models.config import LoraConfig
from llamarl.runtime.run_identity import run_identity


def _parsed(args: list[str]):
    from recipes.arithmetic import ArithmeticConfig

    return tyro.cli(ArithmeticConfig, args=args)


def test_lora_without_lr_takes_loras_measured_rate_and_says_so():
    defaulted = _parsed(["--trainer.lora.rank", "16"])
    note = defaulted.trainer.settle_lr()
    assert defaulted.trainer.lr == 8e-4 and defaulted.trainer.lr == LoraConfig().lr
    assert note == ("LoRA (--trainer.lora.rank 16) without --trainer.lr: lr 0.0008 (--trainer.lora.lr, the "
                    "measured default; full fine-tuning's is 1.5e-05)")
    assert defaulted.trainer.settle_lr() is None and defaulted.trainer.lr == 8e-4  # settled once

    full = _parsed([])
    assert full.trainer.settle_lr() is None and full.trainer.lr == 1.5e-5  # the recipe's full fine-tuning rate
    for args in (["--trainer.lora.rank", "16", "--trainer.lr", "1.5e-5"], ["--trainer.lr", "3e-3"]):
        explicit = _parsed(args)
        assert explicit.trainer.settle_lr() is None and explicit.trainer.lr == float(args[-1])
    own = _parsed(["--trainer.lora.rank", "4", "--trainer.lora.lr", "2e-4"])
    assert "lr 0.0002" in own.trainer.settle_lr() and own.trainer.lr == 2e-4
    assert TrainerConfig(lora=LoraConfig(rank=8)).learning_rate() == 8e-4  # unsettled: the trainer asks this


def test_a_presets_lora_run_takes_loras_rate_too():
    """A preset is an instance whose values are the flags' defaults: its rate stays unset until settled."""
    from recipes.gsm8k import PRESETS

    config = tyro.extras.overridable_config_cli(PRESETS, args=["cpu-smoke", "--trainer.lora.rank", "8"])
    assert config.trainer.settle_lr() is not None and config.trainer.lr == 8e-4
    config = tyro.extras.overridable_config_cli(PRESETS, args=["cpu-smoke"])
    assert config.trainer.settle_lr() is None and config.trainer.lr == 1e-5


def test_a_defaulted_and_an_explicit_rate_are_the_same_run_on_resume():
    """The identity records the rate taken: a resume that names it is no change, another rate is."""
    def identity(args):
        config = _parsed(args)
        config.trainer.settle_lr()
        return run_identity(config, recipe="arithmetic", dataset=None, model_source="no/such/model")

    defaulted = identity(["--trainer.lora.rank", "16"])
    assert defaulted["trainer.lr"] == 8e-4 and "trainer.full_lr" not in defaulted
    assert identity(["--trainer.lora.rank", "16", "--trainer.lr", "8e-4"]) == defaulted
    assert identity(["--trainer.lora.rank", "16", "--trainer.lr", "1.5e-5"])["trainer.lr"] == 1.5e-5


def test_two_hundred_rows_without_the_answer_are_one_line(tmp_path, caplog):
    """Half of 400 rows lack the answer field: one warning line with the count, the first three row
    numbers and the field, not 200 ``row N skipped`` lines; other problems get a line of their own."""
    from llamarl.data.gsm8k import load_gsm8k_jsonl
    from llamarl.data.task_dataset import load_rows, rows_to_problems

    path = tmp_path / "half.jsonl"
    lines = [json.dumps({"question": f"q{i}", **({"answer": str(i)} if i % 2 else {})}) for i in range(400)]
    lines[7] = "{broken"
    path.write_text("\n".join(lines) + "\n")
    flags = {"prompt_field": "--task.prompt-field", "answer_field": "--task.answer-field",
             "prompt_template": "--task.prompt-template", "dataset": "--task.dataset"}
    with caplog.at_level(logging.WARNING, logger="llamarl.data"):
        rows = load_rows(str(path), flag="--task.dataset")
        problems = rows_to_problems(rows, prompt_field="question", answer_field="answer", prompt_template=None,
                                    flags=flags)
    assert len(problems) == 199 and problems.num_skipped_rows == 201  # 200 without an answer, 1 not JSON
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == [f"{path}:8: row skipped (invalid JSON: Expecting property name enclosed in double quotes)",
                        f"{path}: 200 rows skipped (no 'answer'): rows 1, 3, 5, ..."], warnings

    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="llamarl.data"):
        gsm8k = load_gsm8k_jsonl(path)
    assert len(gsm8k) == 199 and gsm8k.num_skipped_rows == 201
    assert [r.getMessage() for r in caplog.records] == [
        f"{path}: 200 rows skipped (missing or non-string 'answer'): rows 1, 3, 5, ...",
        f"{path}:8: row skipped (invalid JSON: Expecting property name enclosed in double quotes)"]


def test_an_evaluation_draws_a_progress_bar(capsys):
    """``score_samples`` with a description draws a tqdm bar over the samples on stderr (in a log
    file too), ending at all of them; without one it draws nothing."""
    from types import SimpleNamespace

    from llamarl.data.prompts import Problem
    from llamarl.engines.base import SamplingParams
    from llamarl.executors.evaluation_loop import score_samples

    class Echo:  # an engine answering each request with its prompt's ids
        def generate(self, requests, *, sampling, version):
            return [SimpleNamespace(sample_id=r.sample_id, completion_ids=r.prompt_ids) for r in requests]

    tokenizer = SimpleNamespace(batch_decode=lambda ids, skip_special_tokens: ["".join(map(str, i)) for i in ids])
    problems = [Problem(question=str(i), answer=str(i)) for i in range(5)]
    kwargs = {"problems": problems, "prompts": [[i] for i in range(5)], "score": lambda text, answer: text == answer,
              "sampling": SamplingParams(temperature=0.0, max_new_tokens=1), "chunk": 2}
    scores, _ = score_samples(Echo(), tokenizer, progress="eval of weights version 3", **kwargs)
    assert scores == [[1.0]] * 5
    err = capsys.readouterr().err
    assert "eval of weights version 3: 100%" in err and "| 5/5 [" in err and "sample" in err, err
    score_samples(Echo(), tokenizer, **kwargs)
    assert capsys.readouterr().err == ""


def test_the_tick_line_counts_ticks_as_the_files_do():
    """Outside a terminal, tick t (the files' ``"step": t``) logs ``tick t (t+1/max done, s/tick,
    ~time left)``; the seconds a tick leave the first tick (start-up) out once others exist."""
    import torch

    from llamarl.runtime.progress import Progress, duration_text

    progress = Progress(keys=[], max_steps=10, start_step=2, rank=0, device=torch.device("cpu"), use_bar=False)
    progress.tick_seconds = [30.0, 2.0, 4.0]
    assert progress.tick_line(4, "reward/reward_mean=0.5") == \
        "tick 4 (5/10 done, 3.00 s/tick, ~15 s left) reward/reward_mean=0.5"
    progress.tick_seconds = [30.0]
    assert progress.tick_line(2, "") == "tick 2 (3/10 done, 30.00 s/tick, ~3 min 30 s left)"
    assert [duration_text(s) for s in (0.4, 59, 61, 7325)] == ["0 s", "59 s", "1 min 1 s", "2 h 02 min"]


def test_tools_on_a_tokenizer_without_a_chat_template_fail_before_any_model_loads(model_dir):
    """``--env.tools`` presents and answers the tools through the chat template, which the tiny
    model's character tokenizer lacks (that it splits ``</tool_call>`` into 12 tokens is fine: a call
    turn ends at EOS): the whole-config check (every rank, before the world) says so in one line
    from the tokenizer alone, where the generator found it after loading the model."""
    from llamarl.rl.config_checks import validate_config

    config = _parsed(["--model.name", str(model_dir), "--env.tools", "tools_for_tests:shout"])
    with pytest.raises(ValueError) as info:
        validate_config(config)
    message = str(info.value)
    assert message.startswith(f"--env.tools tools_for_tests:shout with --model.name {model_dir}: the tokenizer has "
                              "no chat template, through which --env.tools presents the tools"), message
    assert "\n" not in message
    validate_config(_parsed(["--model.name", str(model_dir), "--env.name", "envs_for_tests:DigitsEnv"]))  # "a": one


def test_a_step_returning_the_wrong_type_ends_the_job_with_its_one_line(model_dir, tmp_path):
    """An environment whose ``step`` returns a dict, in a 2-rank async world (generator on rank 0,
    trainer and reward with a scoring worker on rank 1): the contract line is the job's only
    ``llamarl:`` line and no traceback but torchrun's own report follows it. Rank 1, whose channel
    then fails, stays quiet (its traceback in its file); so do its starting workers."""
    from launch import run_torchrun

    out = tmp_path / "run"
    proc = run_torchrun("e2e_arithmetic.py", nproc=2, args=[
        "--model.name", str(model_dir), "--run.max-steps", "3", "--run.num-eval-problems", "2",
        "--run.output-dir", str(out), "--generator.num-prompts-per-step", "2", "--generator.max-new-tokens", "8",
        "--env.name", "tools_for_tests:WrongStepType", "--reward.num-workers", "1", "--export.no-final"])
    assert proc.returncode == 1, proc.stderr[-3000:]
    lines = [line for line in (proc.stdout + proc.stderr).splitlines() if line.startswith("llamarl:")]
    assert len(lines) == 1, lines
    assert ("llamarl: executor 'generator' (rank 0, local rank 0) failed at step 0 during step: "
            "EnvironmentContractError: environment 'tools_for_tests:WrongStepType': step returned a dict, "
            "expected a Turn") in lines[0]
    after = proc.stderr.split(lines[0], 1)[1]
    assert after.count("Traceback (most recent call last)") == 1 and "ChildFailedError" in after, after[-3000:]
    assert "ConnectionResetError" not in proc.stderr and "Connection closed" not in proc.stderr
    assert (out / "logs" / "rank0.traceback.txt").is_file()


def test_a_tick_whose_every_tool_call_failed_warns_once(caplog):
    """Errors and timeouts together against the calls, per stage; the first such tick warns, later
    ones do not (the progress line's ``tool_err=`` shows each)."""
    import torch

    from llamarl.runtime.progress import Progress

    progress = Progress(keys=[], max_steps=5, start_step=0, rank=0, device=torch.device("cpu"), use_bar=False)
    with caplog.at_level(logging.WARNING, logger="llamarl.progress"):
        progress._warn_tools(0, {"generator/env_tool_errors": 3.0, "generator/env_tool_timeouts": 0.0,
                                 "generator/env_tool_calls": 4.0})
        assert caplog.records == []
        progress._warn_tools(1, {"generator/env_tool_errors": 1.0, "generator/env_tool_timeouts": 3.0,
                                 "generator/env_tool_calls": 4.0})
        progress._warn_tools(2, {"generator/env_tool_errors": 4.0, "generator/env_tool_calls": 4.0})
    warned = ("tick 1: every tool call failed (4 of 4; env_tool_errors and env_tool_timeouts in "
              "metrics/generator.jsonl, the lines above say why)")
    assert [r.getMessage() for r in caplog.records] == [warned]
