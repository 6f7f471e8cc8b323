"""Arithmetic reward: exact integer match between a completion's answer and the reference.

When the completion has no explicit answer marker (``\\boxed{N}``, ``#### N``, ``answer is N``),
the first number after the LAST ``=`` is taken ("23 + 45 = 68" scores on 68), and without an
``=`` the LAST number (the usual "last number" rule of math scorers). A completion cut off by the
length limit mid-explanation therefore scores on whatever number it ended with: the reward
pushes the policy toward short answers that end on the result.

Numbers may carry a leading minus sign and thousands commas. A decimal token counts as its exact
value, so "68.0" matches 68 but "68.5" does not match 68 (it is never truncated to its integer part).
"""

from __future__ import annotations

import re
from fractions import Fraction

# A minus right after a word character is subtraction ("5-3"), not a sign.
_NUMBER_RE = re.compile(r"(?:(?<![\w)])-)?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?")
_MARKER_RES = (
    re.compile(r"\\boxed\{\s*([^{}]*)\}"),
    re.compile(r"####\s*([^\n]*)"),
    re.compile(r"\banswer\s+is\b\s*:?\s*([^\n]*)", re.IGNORECASE),
)


def extract_answer(completion: str) -> Fraction | None:
    """The completion's answer as an exact number, or None when it contains no number.

    Marker forms are tried in order (``\\boxed``, ``####``, ``answer is``); the first marker that
    is followed by a number wins. Without one: the first number after the last ``=``, else the
    last number in the completion.
    """
    for marker in _MARKER_RES:
        for span in marker.findall(completion):
            if number := _NUMBER_RE.search(span):
                return Fraction(number.group(0).replace(",", ""))
    if "=" in completion:
        number = _NUMBER_RE.search(completion.rsplit("=", 1)[1])
        if number:
            return Fraction(number.group(0).replace(",", ""))
    numbers = _NUMBER_RE.findall(completion)
    return Fraction(numbers[-1].replace(",", "")) if numbers else None


def score(completion: str, reference: str) -> float:
    """1.0 if the completion's answer equals the integer ``reference`` (e.g. ``"-68"``), else 0.0.

    Raises ValueError when ``reference`` is not an integer, since that is a data bug.
    """
    try:
        expected = int(reference.strip().replace(",", ""))
    except ValueError:
        raise ValueError(f"arithmetic reference is not an integer: {reference!r}") from None
    found = extract_answer(completion)
    return 1.0 if found is not None and found == expected else 0.0
