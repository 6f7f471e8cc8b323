"""Tests for arithmetic task generation, GSM8K JSONL loading and prompt building."""

from __future__ import annotations

import json

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from llamarl.data.arithmetic import ArithmeticTask, is_heldout_pair
from llamarl.data.gsm8k import load_gsm8k_jsonl
from llamarl.data.prompts import ARITHMETIC_INSTRUCTION, Problem, build_chat_prompt
from llamarl.rewards import arithmetic


def _operands(problem: Problem) -> tuple[int, int]:
    words = problem.question.removeprefix("What is ").removesuffix("?").split(" + ")
    return int(words[0]), int(words[1])


def test_arithmetic_sample_is_deterministic_and_correct():
    task = ArithmeticTask(num_digits=2, seed=3)
    first = [task.sample(i) for i in range(200)]
    # A fresh object (as after a resume) reproduces any position, in any order.
    again = ArithmeticTask(num_digits=2, seed=3)
    assert [again.sample(i) for i in reversed(range(200))] == first[::-1]
    assert first != [ArithmeticTask(num_digits=2, seed=4).sample(i) for i in range(200)]
    for problem in first:
        a, b = _operands(problem)
        assert 10 <= a <= 99 and 10 <= b <= 99
        assert problem.answer == str(a + b)
        assert arithmetic.score(problem.answer, problem.answer) == 1.0
    assert first[0].question.startswith("What is ") and first[0].question.endswith("?")


def test_arithmetic_heldout_is_disjoint_from_training():
    for seed in (0, 1):
        task = ArithmeticTask(num_digits=2, seed=seed)
        heldout = task.heldout(300)
        assert len(set(heldout)) == 300
        assert heldout[:50] == task.heldout(50)
        # Disjoint in either operand order, not just as exact strings.
        heldout_pairs = {frozenset(_operands(p)) for p in heldout}
        training_pairs = {frozenset(_operands(task.sample(i))) for i in range(5000)}
        assert not heldout_pairs & training_pairs
        assert all(is_heldout_pair(*_operands(p)) for p in heldout)
    # The held-out set does not depend on the training seed.
    assert ArithmeticTask(seed=0).heldout(20) == ArithmeticTask(seed=1).heldout(20)


def test_arithmetic_edge_cases():
    one_digit = ArithmeticTask(num_digits=1)
    assert all(0 <= min(_operands(one_digit.sample(i))) for i in range(100))
    with pytest.raises(ValueError, match="held-out 1-digit problems exist"):
        one_digit.heldout(1000)
    assert len(ArithmeticTask(num_digits=4).heldout(100)) == 100
    with pytest.raises(ValueError, match="num_digits"):
        ArithmeticTask(num_digits=0)
    with pytest.raises(ValueError, match="index"):
        one_digit.sample(-1)


def test_load_gsm8k_jsonl(tmp_path):
    path = tmp_path / "g.jsonl"
    rows = [{"question": "Q1?", "answer": "x\n#### 5"}, {"question": "Q2?", "answer": "#### 6", "extra": 1}]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n", encoding="utf-8")
    assert load_gsm8k_jsonl(path) == [Problem("Q1?", "x\n#### 5"), Problem("Q2?", "#### 6")]


@pytest.mark.parametrize(
    ("bad_line", "message"),
    [(b"{not json", "invalid JSON"), (b'{"question": "Q"}', "missing or non-string 'answer'"),
     (b"[1, 2]", "not a JSON object"), (b'{"question": " ", "answer": "#### 1"}', "empty 'question'"),
     (b'{"question": "Q\xff", "answer": "#### 1"}', "invalid UTF-8")],
)
def test_a_broken_gsm8k_row_is_skipped_named_and_counted(tmp_path, caplog, bad_line, message):
    path = tmp_path / "bad.jsonl"
    good = json.dumps({"question": "Q", "answer": "#### 1"}).encode()
    path.write_bytes(good + b"\n" + bad_line + b"\n" + good + b"\n")
    with caplog.at_level("WARNING", logger="llamarl.data"):
        problems = load_gsm8k_jsonl(path)
    assert problems == [Problem("Q", "#### 1")] * 2 and problems.num_skipped_rows == 1
    assert f"bad.jsonl:2: row skipped ({message}" in caplog.text


def test_load_gsm8k_jsonl_missing_file(tmp_path):
    with pytest.raises(ValueError, match="not found: .*missing.jsonl"):
        load_gsm8k_jsonl(tmp_path / "missing.jsonl")


def _tiny_tokenizer() -> PreTrainedTokenizerFast:
    words = ["[UNK]", "<s>", "Question:", "Answer:", "What", "is", "2", "+", "3?", "Be", "brief."]
    words += ["<|user|>", "<|system|>", "<|assistant|>"] + ARITHMETIC_INSTRUCTION.split()
    backend = Tokenizer(
        models.WordLevel({w: i for i, w in enumerate(dict.fromkeys(words))}, unk_token="[UNK]")
    )
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]")


def test_build_chat_prompt_without_template_falls_back_to_plain_text():
    tokenizer = _tiny_tokenizer()
    ids = build_chat_prompt(tokenizer, "What is 2 + 3?", instruction_suffix=ARITHMETIC_INSTRUCTION)
    assert type(ids) is list and all(type(i) is int for i in ids)
    expected = tokenizer(f"Question: What is 2 + 3? {ARITHMETIC_INSTRUCTION}\nAnswer:")["input_ids"]
    assert ids == expected
    assert tokenizer.unk_token_id not in ids
    with_system = build_chat_prompt(tokenizer, "What is 2 + 3?", system="Be brief.")
    assert with_system == tokenizer("Be brief.\n\nQuestion: What is 2 + 3?\nAnswer:")["input_ids"]


def test_build_chat_prompt_with_template():
    tokenizer = _tiny_tokenizer()
    tokenizer.chat_template = (
        "{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} {% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}"
    )
    ids = build_chat_prompt(tokenizer, "What is 2 + 3?", system="Be brief.", instruction_suffix="Be brief.")
    assert type(ids) is list and all(type(i) is int for i in ids)
    expected = tokenizer("<|system|> Be brief. <|user|> What is 2 + 3? Be brief. <|assistant|>")["input_ids"]
    assert ids == expected
    assert ids[-1] == tokenizer.convert_tokens_to_ids("<|assistant|>")


class _FakeChatTokenizer:
    """Duck-typed tokenizer whose apply_chat_template returns a given shape (4.x list, 5.x dict, batch)."""

    chat_template = "fake"

    def __init__(self, output):
        self.output = output

    def apply_chat_template(self, messages, *, tokenize, add_generation_prompt):
        assert tokenize and add_generation_prompt and messages[-1]["role"] == "user"
        return self.output


@pytest.mark.parametrize(
    "output", [[5, 6, 7], {"input_ids": [5, 6, 7]}, [[5, 6, 7]], {"input_ids": [[5, 6, 7]]}]
)
def test_build_chat_prompt_accepts_every_apply_chat_template_shape(output):
    assert build_chat_prompt(_FakeChatTokenizer(output), "Q") == [5, 6, 7]
