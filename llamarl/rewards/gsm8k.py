"""GSM8K reward: extract a completion's final numeric answer and compare it to the reference.

Extraction priority (the last occurrence of the highest-priority form wins):

1. ``#### N`` (the GSM8K training format),
2. ``\\boxed{N}`` (the usual instruct-model format),
3. ``A: N`` / ``The answer is N`` / ``Answer: N`` (few-shot formats),
4. otherwise the last number in the text (calculator annotations ``<<...>>`` removed first).

Numbers are compared exactly as fractions after stripping ``,``, ``$``, ``%`` and trailing dots, so
``72.0 == 72``, ``$1,200 == 1200`` and ``3/4 == 0.75``. ``math_verify`` is deliberately not used:
it is not installed by default and the rules above already agree with the labelled GSM8K model
solutions on > 99 % of them (see ``tests/test_rewards.py``).
"""

from __future__ import annotations

import re
from fractions import Fraction

from llamarl.data.boxed import boxed_contents

# A number as written in answers: optional sign, optional thousands separators, optional decimals.
# Thousands groups must be exactly 3 digits so that a list like "3,4" reads as "3".
# A minus right after a word or ")" is subtraction ("10-5"), not a sign.
_NUMBER = r"(?:(?<![\w)])-)?(?:\$\s?)?(?:(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|\.\d+)"
_NUMBER_RE = re.compile(_NUMBER)
# "a/b" is only read as a fraction inside an explicit answer span, never by the last-number fallback.
_FRACTION_RE = re.compile(rf"(?:{_NUMBER})\s*/\s*(?:{_NUMBER})")
_HASH_RE = re.compile(r"####\s*([^\n]*)")
_ANSWER_RE = re.compile(
    r"(?:^|\n)\s*A\s*:\s*([^\n]*)|(?:the\s+)?(?:final\s+)?answer\s+is\b\s*:?\s*([^\n]*)|\banswer\s*:\s*([^\n]*)",
    re.IGNORECASE,
)
_CALCULATOR_RE = re.compile(r"<<[^<>]*>>")
_LATEX_FRAC_RE = re.compile(r"\\d?frac\{([^{}]*)\}\{([^{}]*)\}")


def _first_number(span: str) -> str | None:
    """The first number (or ``a/b`` fraction) in an explicit answer span, cleaned; None if none."""
    span = _LATEX_FRAC_RE.sub(r"\1/\2", _CALCULATOR_RE.sub("", span))
    number, fraction = _NUMBER_RE.search(span), _FRACTION_RE.search(span)
    # Prefer the fraction only when it starts where the first number does ("3/4", not "3 apples, 1/2").
    if fraction and number and fraction.start() == number.start():
        return _clean(fraction.group(0))
    return _clean(number.group(0)) if number else None


def _clean(token: str) -> str:
    """Strip currency, separators, percent signs, spaces and trailing dots from a number token."""
    token = re.sub(r"[\s,$%]", "", token).rstrip(".")
    return token


def extract_answer(text: str) -> str | None:
    """Return the final answer of ``text`` as a cleaned number string (e.g. ``"1200"``), or None.

    Uses the priority order in the module docstring; None means no number was found at all.
    """
    for span in reversed(_HASH_RE.findall(text)):
        if (found := _first_number(span)) is not None:
            return found
    for span in reversed(boxed_contents(text)):
        if (found := _first_number(span)) is not None:
            return found
    for match in reversed(list(_ANSWER_RE.finditer(text))):
        span = next(group for group in match.groups() if group is not None)
        if (found := _first_number(span)) is not None:
            return found
    numbers = _NUMBER_RE.findall(_CALCULATOR_RE.sub(" ", text))
    return _clean(numbers[-1]) if numbers else None


def to_fraction(answer: str) -> Fraction | None:
    """Parse a cleaned answer (``"72"``, ``"72.0"``, ``"-3/4"``) as an exact Fraction; None if invalid."""
    try:
        if "/" in answer:
            numerator, denominator = answer.split("/", 1)
            return Fraction(numerator) / Fraction(denominator)
        return Fraction(answer)
    except (ValueError, ZeroDivisionError):
        return None


def reference_answer(reference: str) -> str:
    """The number after ``####`` in a GSM8K answer field (falling back to ``extract_answer``).

    The fallback accepts references in other formats, e.g. ``"... A: 72"``. Raises ValueError when
    the reference contains no number, since that is a data bug rather than a wrong completion.
    """
    found = extract_answer(reference)
    if found is None or to_fraction(found) is None:
        raise ValueError(f"GSM8K reference has no numeric answer: {reference[-80:]!r}")
    return found


def score(completion: str, reference: str) -> float:
    """1.0 if the completion's final answer equals the reference's ``####`` number, else 0.0."""
    expected = to_fraction(reference_answer(reference))
    found = extract_answer(completion)
    if found is None:
        return 0.0
    value = to_fraction(found)
    return 1.0 if value is not None and value == expected else 0.0
