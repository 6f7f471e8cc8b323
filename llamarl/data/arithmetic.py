"""Seeded integer-addition (or multiplication) problems ("What is 23 + 45?" -> "68"), generated on the fly.

``operation="*"`` with ``second_num_digits`` gives e.g. 3-digit x 2-digit products ("What is 347 * 23?"
-> "7981"), the calculator recipe's task; the held-out partition then hashes the operation too.

Training problem ``index`` is a pure function of ``(num_digits, seed, index)``, so a resumed run
continues from its data position by index alone.

Held-out disjointness: every unordered operand pair {a, b} is assigned, by a fixed hash of the
pair, either to the held-out partition (about 1 in ``HELDOUT_MODULUS``) or to the training partition.
Training samples redraw until they land in the training partition and ``heldout()`` only picks from
the held-out one, so no training problem (in either operand order: "a + b" and "b + a" would leak
the same fact) can ever equal a held-out problem, for every seed and index. The held-out set depends
only on ``num_digits``, so runs with different seeds are evaluated on the same problems.
"""

from __future__ import annotations

import hashlib
import random

from llamarl.data.prompts import Problem

HELDOUT_MODULUS = 10
# Below this many ordered pairs, held-out pairs are enumerated exactly (so "too many" is detectable).
_ENUMERATE_LIMIT = 200_000


def is_heldout_pair(a: int, b: int, operation: str = "+") -> bool:
    """Whether the unordered pair {a, b} belongs to the held-out partition (order-independent)."""
    low, high = sorted((a, b))
    digest = hashlib.blake2b(f"llamarl-arithmetic-heldout:{low}{operation}{high}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") % HELDOUT_MODULUS == 0


def _problem(a: int, b: int, operation: str = "+") -> Problem:
    """The problem a + b (or a * b)."""
    return Problem(question=f"What is {a} {operation} {b}?", answer=str(a + b if operation == "+" else a * b))


class ArithmeticTask:
    """Addition of two ``num_digits``-digit non-negative integers (1-digit operands include 0)."""

    def __init__(self, *, num_digits: int = 2, seed: int = 0, operation: str = "+",
                 second_num_digits: int | None = None) -> None:
        """Raise ValueError unless ``num_digits`` (and ``second_num_digits``: the second operand's,
        default the same) >= 1 and ``operation`` is ``+`` or ``*``."""
        second = num_digits if second_num_digits is None else second_num_digits
        if num_digits < 1 or second < 1:
            raise ValueError(f"num_digits must be >= 1, got {num_digits} and {second}")
        if operation not in ("+", "*"):
            raise ValueError(f"operation must be '+' or '*', got {operation!r}")
        self.num_digits, self.operation = num_digits, operation
        self.seed = seed
        self._low, self._high = (10 ** (num_digits - 1) if num_digits > 1 else 0), 10**num_digits - 1
        self._low2, self._high2 = (10 ** (second - 1) if second > 1 else 0), 10**second - 1
        self._key = str(num_digits) if (operation, second) == ("+", num_digits) else f"{num_digits}{operation}{second}"

    def _draw(self, rng: random.Random) -> tuple[int, int]:
        """One ordered operand pair from ``rng``."""
        return rng.randint(self._low, self._high), rng.randint(self._low2, self._high2)

    def sample(self, index: int) -> Problem:
        """Training problem number ``index`` (>= 0): deterministic, never in the held-out partition."""
        if index < 0:
            raise ValueError(f"index must be >= 0, got {index}")
        # String seeds are hashed with SHA-512 by `random`, so this is stable across processes.
        rng = random.Random(f"llamarl-arithmetic-train:{self._key}:{self.seed}:{index}")
        while True:
            a, b = self._draw(rng)
            if not is_heldout_pair(a, b, self.operation):
                return _problem(a, b, self.operation)

    def heldout(self, num: int) -> list[Problem]:
        """``num`` distinct held-out problems, disjoint from every ``sample()``; a prefix-stable list.

        ``heldout(n)[:k] == heldout(k)``. Raises ValueError if fewer than ``num`` held-out problems
        exist (e.g. 25 for 1-digit operands).
        """
        if num < 0:
            raise ValueError(f"num must be >= 0, got {num}")
        rng = random.Random(f"llamarl-arithmetic-heldout:{self._key}")
        operands, seconds = range(self._low, self._high + 1), range(self._low2, self._high2 + 1)
        if len(operands) * len(seconds) <= _ENUMERATE_LIMIT:
            pairs = [(a, b) for a in operands for b in seconds if is_heldout_pair(a, b, self.operation)]
            rng.shuffle(pairs)
            if num > len(pairs):
                raise ValueError(
                    f"only {len(pairs)} held-out {self.num_digits}-digit problems exist, asked {num}"
                )
            return [_problem(a, b, self.operation) for a, b in pairs[:num]]
        # About a tenth of the pairs are held out; asking for at most half of those keeps sampling fast.
        if num > len(operands) * len(seconds) // (2 * HELDOUT_MODULUS):
            raise ValueError(f"asked for {num} held-out problems, more than this generator supports")
        chosen: dict[tuple[int, int], None] = {}  # insertion-ordered set
        while len(chosen) < num:
            pair = self._draw(rng)
            if is_heldout_pair(*pair, self.operation):
                chosen.setdefault(pair, None)
        return [_problem(a, b, self.operation) for a, b in chosen]
