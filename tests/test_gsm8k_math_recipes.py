"""GSM8K / MATH recipes: data loading, the list task, pass@k, the presets and the pass@k plumbing."""

from __future__ import annotations

import builtins
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from tiny_model import save_tiny_model

from llamarl.data.hub import load_hub_problems
from llamarl.data.math import load_math_jsonl
from llamarl.data.problem_list import ListTask
from llamarl.data.prompts import Problem, build_chat_prompt
from llamarl.executors.evaluation_loop import evaluate_policy, load_policy, pass_at_k
from llamarl.rl.dataset_recipes import EvalConfig, prepare_pass_k
from llamarl.run.config import ExportConfig, RunConfig
from recipes import gsm8k as gsm8k_recipe
from recipes import math as math_recipe

SHARED = Path(__file__).resolve().parents[1] / "../shared/data/gsm8k"


def test_list_task_is_seeded_and_covers_every_problem_once_per_epoch():
    problems = [Problem(question=str(i), answer=str(i)) for i in range(7)]
    task, again = ListTask(problems, seed=3), ListTask(problems, seed=3)
    first_epoch = [task.sample(i).question for i in range(7)]
    assert sorted(first_epoch) == [str(i) for i in range(7)]
    second_epoch = [task.sample(i).question for i in range(7, 14)]
    assert sorted(second_epoch) == sorted(first_epoch) and second_epoch != first_epoch
    # A pure function of the index: a fresh task (a resumed run) jumping straight to index 9 agrees.
    assert again.sample(9) == task.sample(9)
    assert [ListTask(problems, seed=4).sample(i).question for i in range(7)] != first_epoch
    with pytest.raises(ValueError, match="at least one"):
        ListTask([])


def test_load_math_jsonl_reads_answer_or_boxed_solution(tmp_path):
    path = tmp_path / "math.jsonl"
    path.write_text("\n".join([
        json.dumps({"problem": "1/2 + 1/2?", "answer": "1"}),
        "",
        json.dumps({"problem": "Root of 4?", "solution": "Since $2^2=4$, it is $\\boxed{2}$."}),
        json.dumps({"question": "Half?", "answer": "\\frac{1}{2}"}),
    ]))
    assert load_math_jsonl(path) == [Problem("1/2 + 1/2?", "1"), Problem("Root of 4?", "2"),
                                     Problem("Half?", "\\frac{1}{2}")]
    assert len(load_math_jsonl(path, limit=2)) == 2
    path.write_text(json.dumps({"problem": "x", "solution": "no box"}) + "\n")
    with pytest.raises(ValueError, match=r"math.jsonl:1: expected string 'problem'"):
        load_math_jsonl(path)
    path.write_text("{not json\n")
    with pytest.raises(ValueError, match=r"math.jsonl:1: invalid JSON"):
        load_math_jsonl(path)
    with pytest.raises(ValueError, match="not found"):
        load_math_jsonl(tmp_path / "missing.jsonl")


def test_hub_loading_without_datasets_is_a_one_line_error(monkeypatch):
    real_import = builtins.__import__

    def no_datasets(name, *args, **kwargs):
        if name == "datasets":
            raise ImportError("no datasets")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_datasets)
    with pytest.raises(ValueError, match=r"pip install datasets.*--data.path"):
        load_hub_problems("openai/gsm8k", config="main", split="train", to_problem=lambda r: r)


@pytest.mark.parametrize(("n", "c", "k", "expected"), [
    (1, 1, 1, 1.0), (1, 0, 1, 0.0), (4, 1, 1, 0.25), (4, 1, 4, 1.0), (4, 2, 2, 1 - 1 / 6), (10, 0, 5, 0.0),
    (5, 4, 2, 1.0),
])
def test_pass_at_k_estimator(n, c, k, expected):
    assert pass_at_k(n, c, k) == pytest.approx(expected)


def test_pass_at_k_rejects_bad_counts():
    with pytest.raises(ValueError):
        pass_at_k(4, 5, 1)
    with pytest.raises(ValueError):
        pass_at_k(4, 1, 5)


def test_gsm8k_splits_from_the_shared_files():
    data = gsm8k_recipe.GSM8KDataConfig(path=str(SHARED / "train.jsonl"), max_train_problems=10)
    train, test = data.load_split("train"), data.load_split("test")
    assert len(train) == 10 and len(test) == 1319
    assert train[0].answer.rstrip().endswith("#### 72")
    # The gold answers score 1 with the recipe's scorer.
    assert all(gsm8k_recipe.score(p.answer, p.answer) == 1.0 for p in test[:50])


@pytest.mark.parametrize("recipe", [gsm8k_recipe, math_recipe])
def test_presets_are_valid_configs(recipe):
    for name, (description, config) in recipe.PRESETS.items():
        assert description and config.run.max_steps >= 1, name
        if config.generator.num_ranks > 1 or config.reward.num_ranks > 1:
            assert config.run.schedule in ("async", "sync")


def test_prepare_pass_k_needs_the_final_export_and_a_known_run_dir():
    config = gsm8k_recipe.GSM8KConfig(run=RunConfig(max_steps=6))
    prepare_pass_k(config, EvalConfig(), "gsm8k")  # no pass@k: nothing changes
    assert config.run.output_dir is None
    prepare_pass_k(config, EvalConfig(pass_k=[2]), "gsm8k")
    assert config.run.output_dir.startswith("runs/gsm8k-")
    config = gsm8k_recipe.GSM8KConfig(export=ExportConfig(final=False))
    with pytest.raises(ValueError, match="--export.final"):
        prepare_pass_k(config, EvalConfig(pass_k=[2]), "gsm8k")
    with pytest.raises(ValueError, match="--eval.pass-k"):
        EvalConfig(pass_k=[0])


def test_evaluate_policy_greedy_and_pass_at_k_on_a_tiny_model(tmp_path):
    """A scorer that accepts everything gives 1.0 everywhere; one that accepts nothing gives 0.0;
    greedy decoding is deterministic, so two runs agree; an exported weights file loads over the base."""
    model_dir = save_tiny_model(tmp_path / "model")
    model, tokenizer = load_policy(str(model_dir), dtype=torch.float32)
    problems = [Problem(question=f"q{i}", answer="1") for i in range(3)]

    def prompt(tok, question):
        return build_chat_prompt(tok, question)

    kwargs = {"problems": problems, "prompt_fn": prompt, "ks": [1, 2], "temperature": 1.0, "max_new_tokens": 4,
              "chunk": 4}
    always = evaluate_policy(model, tokenizer, score=lambda c, r: 1.0, **kwargs,
                             samples_path=tmp_path / "samples.jsonl")
    assert always == {"greedy_accuracy": 1.0, "pass@1": 1.0, "pass@2": 1.0}
    assert len((tmp_path / "samples.jsonl").read_text().splitlines()) == 3
    never = evaluate_policy(model, tokenizer, score=lambda c, r: 0.0, **kwargs)
    assert never == {"greedy_accuracy": 0.0, "pass@1": 0.0, "pass@2": 0.0}
    # An HF export (weights only, no tokenizer) over the base: a zeroed lm_head changes the model.
    state = {name: p.detach().clone() for name, p in model.named_parameters()}
    state["lm_head.weight"].zero_()
    (tmp_path / "hf").mkdir()
    save_file(state, str(tmp_path / "hf" / "model.safetensors"))
    updated, _ = load_policy(str(model_dir), weights_dir=tmp_path / "hf", dtype=torch.float32)
    assert float(updated.lm_head.weight.detach().abs().sum()) == 0.0
    save_file({"bogus.weight": state["lm_head.weight"]}, str(tmp_path / "hf" / "model.safetensors"))
    with pytest.raises(ValueError, match="do not match"):
        load_policy(str(model_dir), weights_dir=tmp_path / "hf")
