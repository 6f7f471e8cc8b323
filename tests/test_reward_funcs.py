"""``--reward.funcs`` / ``--reward.weights`` (llamarl/rewards/funcs.py) and conversational rows
(``--task.prompt-field`` holding messages, ``--task.system-field``), against hand computations:
TRL-style batch functions get every dataset column as keyword lists, per-sample ones the columns
they name; the reward is the weighted sum, each function's mean is logged; a failing function is
0 and counted; workers score chunks of whole groups exactly as inline scoring does."""

from __future__ import annotations

import json
import sys
import textwrap

import pytest
import torch

from llamarl.data.prompts import Problem, conversation_of
from llamarl.data.task_dataset import Rows, rows_to_problems
from llamarl.executors.config import RewardConfig
from llamarl.executors.reward import build_pool, group_chunks, score_rollouts
from llamarl.rewards.funcs import FuncsScore, RewardFuncs
from llamarl.rl.config_checks import check_scorers
from llamarl.runtime.batch import TensorBatch

USER_FUNCS = '''
CALLS = []


def exact(completions, answer, **kwargs):
    """TRL's convention: lists, one entry per sample; None where it does not apply."""
    CALLS.append(sorted(kwargs))
    return [None if a == "skip" else float(c.strip() == a) for c, a in zip(completions, answer)]


def shorter_than(completion, reference, limit):
    """Per sample, with the row's column ``limit``."""
    return 1.0 if len(completion) < limit else -1.0


def by_turns(completions, prompts, **kwargs):
    """A conversational row's completion is a message list; its prompt the row's messages."""
    return [float(isinstance(c, list) and c[0]["role"] == "assistant" and isinstance(p, list))
            for c, p in zip(completions, prompts)]


def broken(completions, **kwargs):
    raise RuntimeError("boom")
'''


@pytest.fixture
def user_funcs(tmp_path, monkeypatch):
    (tmp_path / "user_funcs.py").write_text(textwrap.dedent(USER_FUNCS))
    monkeypatch.syspath_prepend(str(tmp_path))
    yield
    sys.modules.pop("user_funcs", None)


SAMPLES = [  # (group, completion, reference, columns, question)
    (0, "42", "42", {"answer": "42", "limit": 5}, "What is 6 x 7?"),
    (0, "41 or so", "42", {"answer": "42", "limit": 5}, "What is 6 x 7?"),
    (1, "yes", "skip", {"answer": "skip", "limit": 2}, json.dumps([{"role": "user", "content": "Hi"}])),
    (1, "no", "skip", {"answer": "skip", "limit": 9}, json.dumps([{"role": "user", "content": "Hi"}])),
]


def scored_batch() -> TensorBatch:
    n = len(SAMPLES)
    input_ids = torch.tensor([[1, 2, 10 + i, 20 + i] for i in range(n)])
    batch = TensorBatch({"input_ids": input_ids, "prompt_len": torch.full((n,), 2), "completion_len": torch.full((n,), 2),
                         "num_tokens": torch.full((n,), 4), "loss_mask": torch.ones(n, 4, dtype=torch.uint8),
                         "group_ids": torch.tensor([s[0] for s in SAMPLES])}, {"group_size": 2})
    for name, values in (("completion", [s[1] for s in SAMPLES]), ("reference", [s[2] for s in SAMPLES]),
                         ("columns", [json.dumps(s[3]) for s in SAMPLES]), ("question", [s[4] for s in SAMPLES])):
        batch.set_strings(name, values)
    return batch


@pytest.mark.parametrize("workers", [0, 2])
def test_weighted_functions_with_columns_match_the_hand_computation(user_funcs, workers):
    config = RewardConfig(funcs="user_funcs:exact,user_funcs:shorter_than,user_funcs:by_turns",
                          weights=[1.0, 0.5, 2.0], num_workers=workers)
    check_scorers(config)
    with build_pool(config, None) as pool:
        batch, metrics = score_rollouts(pool, scored_batch(), config)
    # exact: 1, 0, None, None; shorter_than (limit per row): 1, -1, -1, 1; by_turns: 0, 0, 1, 1
    hand = [1 + 0.5 * 1, 0 + 0.5 * -1, 0.5 * -1 + 2 * 1, 0.5 * 1 + 2 * 1]
    assert batch["rewards"].tolist() == pytest.approx(hand)
    assert metrics["reward_fn_exact"] == pytest.approx(0.5)  # the two rows it gave a value
    assert metrics["reward_fn_shorter_than"] == pytest.approx(0.0)
    assert metrics["reward_fn_by_turns"] == pytest.approx(0.5)
    assert metrics["reward_mean"] == pytest.approx(sum(hand) / 4) and metrics["reward_errors"] == 0


def test_the_batch_function_gets_every_column_and_the_token_ids(user_funcs):
    funcs = RewardFuncs("user_funcs:exact")
    samples = [{"completion": "a", "reference": "a", "question": "q", "columns": {"answer": "a", "x": 1},
                "completion_ids": [5, 6]}]
    assert funcs(samples) == {"values": [[1.0]], "errors": []}
    import user_funcs as module
    assert module.CALLS[-1] == ["completion_ids", "prompts", "x"]


def test_a_failing_function_scores_zero_counts_an_error_and_spares_the_others(user_funcs):
    config = RewardConfig(funcs="user_funcs:broken,user_funcs:shorter_than", num_workers=0)
    with build_pool(config, None) as pool:
        batch, metrics = score_rollouts(pool, scored_batch(), config)
    assert batch["rewards"].tolist() == [1.0, -1.0, -1.0, 1.0]
    assert metrics["reward_errors"] == 1 and metrics["reward_fn_broken"] == 0.0


def test_evaluations_score_the_weighted_sum_of_one_completion(user_funcs):
    score = FuncsScore(RewardFuncs("user_funcs:exact,user_funcs:shorter_than"), (2.0, 1.0))
    assert score("42", Problem("q", "42", columns={"answer": "42", "limit": 3})) == 2.0 + 1.0


def test_chunks_are_whole_groups():
    ids = [0, 0, 0, 1, 1, 1, 2, 2, 2, 3, 3, 3]
    chunks = group_chunks(ids, 3)
    assert [ids[c] for c in chunks] == [[0, 0, 0, 1, 1, 1], [2, 2, 2], [3, 3, 3]]
    assert group_chunks([7, 7], 4) == [slice(0, 2)]


@pytest.mark.parametrize(("flags", "message"), [
    ({"funcs": "user_funcs:nope"}, "--reward.funcs user_funcs:nope: "),
    ({"funcs": "user_funcs:exact", "weights": [1.0, 2.0]}, "--reward.weights: 2 weights for the 1 functions"),
    ({"weights": [1.0]}, "--reward.weights needs --reward.funcs"),
    ({"funcs": "gsm8k", "scorer": "gsm8k"}, "each replace the recipe's scorer: set one"),
])
def test_bad_flags_are_one_line_naming_the_flag(user_funcs, flags, message):
    with pytest.raises(ValueError, match=message):
        check_scorers(RewardConfig(**flags))


FLAGS = {"dataset": "--task.dataset", "prompt_field": "--task.prompt-field", "answer_field": "--task.answer-field",
         "prompt_template": "--task.prompt-template"}


def test_a_message_list_dataset_goes_through_the_chat_template():
    from tools_for_tests import plain_chat_tokenizer

    from recipes.task import make_prompt_fn

    rows = Rows([
        {"prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}], "answer": "4"},
        {"prompt": [{"role": "user", "content": "3+3?"}], "answer": "6", "system": "Answer in words."},
        {"prompt": "4+4?", "answer": "8", "system": "Digits only."},
        {"prompt": "5+5?", "answer": "10"},
    ])
    rows.source = "rows"
    problems = rows_to_problems(rows, prompt_field="prompt", answer_field="answer", prompt_template=None,
                                flags=FLAGS, system_field="system")
    tokenizer = plain_chat_tokenizer()
    prompt_fn = make_prompt_fn("Default system.")
    expected = [
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}],
        [{"role": "system", "content": "Answer in words."}, {"role": "user", "content": "3+3?"}],
        [{"role": "system", "content": "Digits only."}, {"role": "user", "content": "4+4?"}],
        [{"role": "system", "content": "Default system."}, {"role": "user", "content": "5+5?"}],
    ]
    for problem, messages in zip(problems, expected):
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        assert prompt_fn(tokenizer, problem.question) == tokenizer(text, add_special_tokens=False)["input_ids"]
    assert [conversation_of(p.question) for p in problems[:3]] == expected[:3]
    assert problems[3].question == "5+5?" and problems[1].columns == {"answer": "6", "system": "Answer in words."}
    text = tokenizer.decode(prompt_fn(tokenizer, problems[0].question))
    assert text.startswith("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n2+2?"), text


def test_a_malformed_conversation_is_one_line_naming_the_row():
    rows = Rows([{"prompt": [{"role": "robot", "content": "x"}], "answer": "1"}])
    rows.source = "rows"
    with pytest.raises(ValueError, match=r"--task.prompt-field prompt: row 1 of rows: message 0 must be"):
        rows_to_problems(rows, prompt_field="prompt", answer_field="answer", prompt_template=None, flags=FLAGS)
