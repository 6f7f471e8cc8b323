"""Tests for the GSM8K / arithmetic scorers, the scorer registry and RewardPool."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from llamarl.rewards import SCORERS, arithmetic, gsm8k, resolve_scorer
from llamarl.rewards.pool import RewardPool

LABELLED = Path(__file__).resolve().parents[1] / "../shared/data/gsm8k/example_model_solutions.jsonl"
TESTS_DIR = Path(__file__).resolve().parent
SOLUTION_KEYS = ("6b_finetuning", "6b_verification", "175b_finetuning", "175b_verification")


def test_gsm8k_agrees_with_labelled_model_solutions():
    # Deliberately no skip: a missing file must fail loudly.
    assert LABELLED.is_file(), f"labelled GSM8K solutions missing: {LABELLED}"
    total = agree = 0
    with LABELLED.open(encoding="utf-8") as lines:
        for line in lines:
            row = json.loads(line)
            for key in SOLUTION_KEYS:
                predicted = gsm8k.score(row[key]["solution"], row["ground_truth"]) == 1.0
                agree += predicted == row[key]["is_correct"]
                total += 1
    assert total == 5276
    assert agree / total >= 0.99, f"agreement {agree / total:.4f}"


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("He pays 3 * 4 = <<3*4=12>>12 dollars.\n#### 12", "12"),
        ("#### 1,234,567", "1234567"),
        ("First 5 then #### 7 and more text 9", "7"),
        ("So the result is \\boxed{72}. Check: 70 + 2", "72"),
        ("\\boxed{\\$1,200.00}", "1200.00"),
        ("\\boxed{\\frac{3}{4}}", "3/4"),
        ("She has 9 eggs.\nA: 18", "18"),
        ("The answer is $2,500.", "2500"),
        ("Final answer: 45%", "45"),
        ("the answer is -3 degrees", "-3"),
        ("10 - 5 = 5 apples left", "5"),
        ("He buys <<2*3=6>>6 pens and 4 pencils", "4"),
        ("It costs 0.5 each, so 2.", "2"),
        ("no digits here", None),
    ],
)
def test_gsm8k_extract_answer(text, expected):
    assert gsm8k.extract_answer(text) == expected


def test_gsm8k_priority_order():
    # "####" beats \boxed beats "A:" beats the last number.
    assert gsm8k.extract_answer("A: 1\n\\boxed{2}\n#### 3\n4") == "3"
    assert gsm8k.extract_answer("A: 1\n\\boxed{2}\n4") == "2"
    assert gsm8k.extract_answer("A: 1\n4 and 5") == "1"


@pytest.mark.parametrize(
    ("completion", "reference", "expected"),
    [
        ("#### 72", "Natalia sold 48/2 = <<48/2=24>>24 clips.\n#### 72", 1.0),
        ("\\boxed{72.0}", "#### 72", 1.0),
        ("The answer is $72.", "#### 72", 1.0),
        ("The answer is 73.", "#### 72", 0.0),
        ("A: 1,000", "#### 1000", 1.0),
        ("\\boxed{0.75}", "#### 3/4", 1.0),
        ("no idea", "#### 72", 0.0),
        ("A: 18", "... so she makes $18.\nA: 18", 1.0),  # the labelled file's reference format
    ],
)
def test_gsm8k_score(completion, reference, expected):
    assert gsm8k.score(completion, reference) == expected


def test_gsm8k_reference_without_number_is_value_error():
    with pytest.raises(ValueError, match="no numeric answer"):
        gsm8k.score("#### 1", "nothing here")


@pytest.mark.parametrize(
    ("completion", "reference", "expected"),
    [
        ("68", "68", 1.0),
        (" 68\n", "68", 1.0),
        ("68. Because 23 + 45 = 68.", "68", 1.0),
        ("23 + 45 = 68", "68", 1.0),  # the number after the last '=' wins
        ("23 + 45 = 70 - 2 = 68", "68", 1.0),
        ("23 + 45 = 67, not 68", "68", 0.0),
        ("To add the numbers 23 and 45 we get 68", "68", 1.0),  # else the last number
        ("68, or rounded 70", "68", 0.0),
        ("Let me compute: 23 + 45 = 68. The answer is 68.", "68", 1.0),
        ("so \\boxed{68}", "68", 1.0),
        ("work 1 2 3\n#### 68", "68", 1.0),
        ("-17", "-17", 1.0),
        ("17", "-17", 0.0),
        ("1,234", "1234", 1.0),
        ("68.0", "68", 1.0),
        ("68.5", "68", 0.0),
        ("", "68", 0.0),
        ("sixty-eight", "68", 0.0),
    ],
)
def test_arithmetic_score(completion, reference, expected):
    assert arithmetic.score(completion, reference) == expected


def test_arithmetic_bad_reference_is_value_error():
    with pytest.raises(ValueError, match="not an integer"):
        arithmetic.score("1", "1.5")


def test_registry_and_dotted_paths():
    assert set(SCORERS) >= {"arithmetic", "gsm8k"}
    assert resolve_scorer("gsm8k") is gsm8k.score
    assert resolve_scorer("llamarl.rewards.arithmetic:score") is arithmetic.score
    with pytest.raises(ValueError, match="known: arithmetic, gsm8k"):
        resolve_scorer("nope")
    with pytest.raises(ValueError, match="cannot import"):
        resolve_scorer("no_such_module_xyz:score")
    with pytest.raises(ValueError, match="cannot import"):
        resolve_scorer("llamarl.rewards.arithmetic:missing")


def test_pool_unknown_scorer_is_value_error():
    with pytest.raises(ValueError, match="unknown scorer 'nope'"):
        RewardPool("nope", num_workers=0)


@pytest.fixture
def tests_importable(monkeypatch):
    # Spawned workers copy sys.path at start, so this makes scorers_for_tests importable there too.
    monkeypatch.syspath_prepend(str(TESTS_DIR))


def test_dotted_path_to_non_callable_is_value_error(tests_importable):
    with pytest.raises(ValueError, match="not callable"):
        resolve_scorer("scorers_for_tests:NOT_CALLABLE")


def test_pool_inline_counts_errors(tests_importable):
    with RewardPool("scorers_for_tests:flaky", num_workers=0) as pool:
        assert pool.score_batch(["a", "raise", "b"], ["a", "a", "a"]) == [1.0, 0.0, 0.0]
        assert pool.stats()["num_errors"] == 1
        assert pool.stats()["num_scored"] == 3
        with pytest.raises(ValueError, match="2 completions but 1 references"):
            pool.score_batch(["a", "b"], ["a"])


def test_pool_worker_errors_timeouts_and_recovery(tests_importable):
    with RewardPool("scorers_for_tests:flaky", num_workers=1, timeout_s=1.0) as pool:
        assert pool.score_batch(["1", "2", "raise", "3"], ["1", "1", "1", "3"]) == [1.0, 0.0, 0.0, 1.0]
        assert pool.stats()["num_errors"] == 1

        # The hung sample scores 0 and is counted as a timeout (not as an error). No duration is
        # asserted (time is noisy under load): a pool that ignored its 1 s timeout would hang here.
        assert pool.score_batch(["x", "sleep", "y"], ["x", "x", "y"]) == [1.0, 0.0, 1.0]
        assert pool.stats()["num_timeouts"] == 1

        # The hung worker was replaced: the next batch is scored by a fresh one.
        assert pool.score_batch(["a", "b"], ["a", "a"]) == [1.0, 0.0]

        # A scorer that kills its own process is an error, and the pool carries on.
        assert pool.score_batch(["die", "z"], ["z", "z"]) == [0.0, 1.0]
        stats = pool.stats()
    assert stats == {"num_scored": 11, "num_errors": 2, "num_timeouts": 1, "num_worker_restarts": 2,
                     "num_worker_start_failures": 0}


def test_pool_two_workers_builtin_scorer():
    with RewardPool("arithmetic", num_workers=2, timeout_s=5.0) as pool:
        rewards = pool.score_batch([str(i) for i in range(20)], [str(i % 3) for i in range(20)])
    assert rewards == [1.0 if i == i % 3 else 0.0 for i in range(20)]


def test_pool_non_finite_reward_is_error(tests_importable):
    with RewardPool("scorers_for_tests:not_finite", num_workers=0) as pool:
        assert pool.score_batch(["1"], ["1"]) == [0.0]
        assert pool.stats()["num_errors"] == 1


def test_pool_rejects_bad_arguments_and_use_after_close():
    with pytest.raises(ValueError, match="num_workers"):
        RewardPool("arithmetic", num_workers=-1)
    with pytest.raises(ValueError, match="timeout_s"):
        RewardPool("arithmetic", timeout_s=0)
    with pytest.raises(ValueError, match="start_method"):
        RewardPool("arithmetic", start_method="fork")
    pool = RewardPool("arithmetic", num_workers=0)
    pool.close()
    pool.close()
    with pytest.raises(ValueError, match="closed"):
        pool.score_batch(["1"], ["1"])


def test_pool_counters_continue_from_a_checkpoint(tests_importable):
    with RewardPool("scorers_for_tests:flaky", num_workers=0) as pool:
        pool.restore_stats({"num_scored": 10, "num_errors": 2, "unknown_key": 7})
        pool.score_batch(["raise"], ["a"])
        assert pool.stats() == {"num_scored": 11, "num_errors": 3, "num_timeouts": 0, "num_worker_restarts": 0,
                                "num_worker_start_failures": 0}


def test_score_rollouts_marks_groups_without_signal_for_balancing(tests_importable):
    import torch

    from llamarl.executors.reward import score_rollouts
    from llamarl.runtime.batch import TensorBatch

    batch = TensorBatch({"group_ids": torch.tensor([4, 4, 7, 7]), "num_tokens": torch.tensor([5, 6, 7, 8]),
                         "completion_len": torch.tensor([1, 2, 3, 4])})
    batch.set_strings("completion", ["a", "b", "a", "a"])
    batch.set_strings("reference", ["a", "a", "a", "a"])
    with RewardPool("scorers_for_tests:flaky", num_workers=0) as pool:
        scored, metrics = score_rollouts(pool, batch)
    assert scored["rewards"].tolist() == [1.0, 0.0, 1.0, 1.0]
    assert scored["balance_tokens"].tolist() == [5, 6, 0, 0]  # group 7 scored alike: no signal
    assert metrics["reward_mean"] == 0.75 and metrics["accuracy"] == 0.75


def test_inline_scoring_has_a_timeout_too(tests_importable):
    with RewardPool("scorers_for_tests:flaky", num_workers=0, timeout_s=0.5) as pool:
        assert pool.score_batch(["x", "sleep", "y"], ["x", "x", "y"]) == [1.0, 0.0, 1.0]
        assert pool.stats()["num_timeouts"] == 1 and pool.stats()["num_errors"] == 0


def test_a_replacement_worker_that_fails_to_start_is_retried(tests_importable, tmp_path, monkeypatch):
    counter = tmp_path / "fails"
    monkeypatch.setenv("LLAMARL_TEST_START_FAILS", str(counter))
    with RewardPool("scorers_start_fail:score", num_workers=1, timeout_s=5.0) as pool:
        assert pool.score_batch(["a"], ["a"]) == [1.0]
        counter.write_text("2")  # the next two worker starts fail
        assert pool.score_batch(["die", "b", "c"], ["z", "b", "x"]) == [0.0, 1.0, 0.0]
        assert pool.stats()["num_worker_start_failures"] == 2 and counter.read_text() == "0"


def test_a_replacement_that_never_starts_is_an_error_after_the_retries(tests_importable, tmp_path, monkeypatch):
    counter = tmp_path / "fails"
    monkeypatch.setenv("LLAMARL_TEST_START_FAILS", str(counter))
    with RewardPool("scorers_start_fail:score", num_workers=1, timeout_s=5.0) as pool:
        assert pool.score_batch(["a"], ["a"]) == [1.0]
        counter.write_text("100")
        with pytest.raises(RuntimeError, match="failed to load scorer .* after 4 attempts"):
            pool.score_batch(["die", "b"], ["z", "b"])
