"""The MATH scorer: answer extraction and symbolic equivalence (sympy backend, math_verify not used)."""

from __future__ import annotations

import pytest

from llamarl.rewards import SCORERS, resolve_scorer
from llamarl.rewards import math as math_reward
from llamarl.rewards.pool import RewardPool


def equiv(a: str, b: str) -> bool:
    return math_reward.is_equiv(a, b, backend="sympy")


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("so we get $x = 3$, hence \\boxed{\\frac{1}{2}}.", "\\frac{1}{2}"),
        ("\\boxed{1} first, then \\boxed{\\sqrt{2}}", "\\sqrt{2}"),
        ("nested \\boxed{\\frac{\\sqrt{3}}{2}} end", "\\frac{\\sqrt{3}}{2}"),
        ("\\fbox{7}", "7"),
        ("Hence the answer is $\\dfrac{3}{4}$.", "\\dfrac{3}{4}"),
        ("The final answer is 42.", "42"),
        ("Final Answer: The final answer is $(1, 2)$. I hope it is correct.", "(1, 2)"),
        ("We compute $a=1$ and then $b = 2\\pi$", "b = 2\\pi"),
        ("first 3 then 4.5 apples", "4.5"),
        ("no answer at all", None),
    ],
)
def test_extract_answer(text, expected):
    assert math_reward.extract_answer(text) == expected


EQUIVALENT = [
    # fractions and decimals
    ("\\frac{1}{2}", "0.5"), ("\\dfrac{3}{4}", "\\frac34"), ("\\tfrac{6}{8}", "0.75"), ("-\\frac{2}{4}", "-0.5"),
    ("1/3", "\\frac{1}{3}"), ("10", "10.0"), ("1,000", "1000"), (".5", "\\frac{1}{2}"),
    # radicals
    ("\\sqrt{8}", "2\\sqrt{2}"), ("\\frac{\\sqrt{3}}{3}", "\\frac{1}{\\sqrt{3}}"), ("\\sqrt2", "\\sqrt{2}"),
    ("\\sqrt[3]{8}", "2"), ("3\\sqrt{2}", "\\sqrt{18}"),
    # pi
    ("2\\pi", "\\pi \\cdot 2"), ("\\frac{\\pi}{2}", "0.5\\pi"), ("\\frac{3\\pi}{4}", "\\frac{3}{4}\\pi"),
    # intervals, tuples, unions, lists
    ("(-\\infty, 3]", "\\left(-\\infty,3\\right]"), ("[1, 2)", "[1,2)"),
    ("(-\\infty, -1) \\cup (1, \\infty)", "(-\\infty,-1)\\cup(1,\\infty)"),
    ("(1, \\frac{1}{2})", "(1, 0.5)"), ("(3, -4)", "\\left( 3, -4 \\right)"),
    ("2, 5", "5, 2"), ("\\{1, 2\\}", "\\{2, 1\\}"),
    # LaTeX decorations and units
    ("30^\\circ", "30"), ("30^{\\circ}", "30"), ("5\\text{ cm}", "5"), ("\\text{5 inches}", "5"),
    ("12\\%", "12"), ("\\$1,200", "1200"), ("x = 5", "5"), ("x \\in [-2, 7]", "[-2,7]"), ("\\text{(B)}", "B"), ("\\textbf{(C)}", "(C)"),
    ("8 \\mbox{ feet}", "8"),
    # equivalent rewritings
    ("x^2+2x+1", "(x+1)^2"), ("2(x+1)", "2x+2"), ("\\frac{x}{2}", "0.5x"), ("2^{10}", "1024"),
    ("3 \\times 4", "12"), ("a+b", "b+a"), ("\\begin{pmatrix} 1 \\\\ 2 \\end{pmatrix}", "\\begin{pmatrix}1\\\\2\\end{pmatrix}"),
    ("\\begin{pmatrix} 2/4 \\\\ 2 \\end{pmatrix}", "\\begin{pmatrix}\\frac12\\\\2\\end{pmatrix}"),
]

NEAR_MISSES = [
    ("0.33", "\\frac{1}{3}"), ("\\frac{1}{2}", "\\frac{1}{3}"), ("\\sqrt{3}", "3"), ("2\\sqrt{2}", "\\sqrt{2}"),
    ("\\pi", "3.14"), ("(1, 2]", "[1, 2]"), ("(1, 2)", "(2, 1)"), ("(-\\infty, 3)", "(-\\infty, 3]"),
    ("2, 5", "2, 5, 7"), ("x^2+1", "(x+1)^2"), ("31^\\circ", "30"), ("\\text{(B)}", "C"), ("-5", "5"),
    ("1001", "1000"), ("", "0"), ("\\begin{pmatrix} 1 \\\\ 2 \\end{pmatrix}", "\\begin{pmatrix}1 & 2\\end{pmatrix}"),
    ("(1,2) \\cup (3,4)", "(1,2) \\cup (3,5)"),
]


@pytest.mark.parametrize(("a", "b"), EQUIVALENT)
def test_equivalent_answers_score_one(a, b):
    assert equiv(a, b), (a, b)
    assert equiv(b, a), (b, a)


@pytest.mark.parametrize(("a", "b"), NEAR_MISSES)
def test_near_misses_score_zero(a, b):
    assert not equiv(a, b), (a, b)


def test_score_reads_completion_and_full_solution_reference():
    solution = "We have $x^2 = 4$ so the positive root is $\\boxed{2}$."
    assert math_reward.score("Thus the answer is $\\boxed{\\frac{4}{2}}$.", solution) == 1.0
    assert math_reward.score("The answer is 2.", "2") == 1.0
    assert math_reward.score("The answer is 3.", solution) == 0.0
    assert math_reward.score("I don't know.", "2") == 0.0


def test_hostile_input_is_rejected_and_never_executed():
    # Each is refused by the whitelisting translator or bounded by the per-call timeout (scored 0);
    # none is evaluated as written (the os.system call would not return False here otherwise).
    for hostile in ("9^{9^{9^9}}", "__import__('os').system('true')", "10^{100000}", "x" * 5000,
                    "\\frac{" * 200, "(" * 500, "lambda: 1"):
        assert not equiv(hostile, "1")


def test_timeout_scores_zero(monkeypatch):
    def slow(*args, **kwargs):
        while True:
            pass

    monkeypatch.setattr(math_reward, "_sympy_equiv", slow)
    assert math_reward.is_equiv("1", "1", timeout_s=0.2, backend="sympy") is False


def test_registered_and_runs_in_the_reward_pool():
    assert SCORERS["math"] is math_reward.score
    assert resolve_scorer("math") is math_reward.score
    with RewardPool("math", num_workers=1, timeout_s=30.0) as pool:
        rewards = pool.score_batch(["\\boxed{0.5}", "\\boxed{\\frac{1}{3}}", "the answer is $2\\pi$"],
                             ["\\frac{1}{2}", "0.33", "\\pi+\\pi"])
    assert rewards == [1.0, 0.0, 1.0]
