"""``\\boxed{...}`` answers: the one parser the GSM8K and MATH scorers and the MATH data loader share."""

from __future__ import annotations

import re


def braced(text: str, start: int) -> tuple[str, int] | None:
    """Contents of the brace group opening at ``text[start] == '{'`` and the index after it."""
    if start >= len(text) or text[start] != "{":
        return None
    depth, i = 0, start
    while i < len(text):
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        i += 1
        if depth == 0:
            return text[start + 1 : i - 1], i
    return None


def boxed_contents(text: str) -> list[str]:
    """Contents of every ``\\boxed{...}`` / ``\\fbox{...}`` in ``text`` (also ``\\boxed 5``), in order."""
    found = []
    for match in re.finditer(r"\\(?:boxed|fbox)\s*", text):
        group = braced(text, match.end())
        if group is not None:
            found.append(group[0])
        else:  # "\boxed 5": up to the next space or "$"
            bare = re.match(r"[^\s$]+", text[match.end() :])
            if bare:
                found.append(bare.group(0))
    return found
