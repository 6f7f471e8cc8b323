"""A fixed list of problems served as a Task: a seeded shuffle per epoch, a pure function of the index.

``ListTask.sample(index)`` is problem ``perm_e[index % n]`` where ``e = index // n`` and ``perm_e``
is a permutation drawn from ``random.Random(f"{seed}:{e}")``, so a resumed run (which restarts
from its data position) sees exactly the prompts it would have seen, and every problem appears
once per epoch.
"""

from __future__ import annotations

import random

from llamarl.data.prompts import Problem


class ListTask:
    """Serve ``problems`` in a seeded order, reshuffled each epoch (see the module docstring)."""

    def __init__(self, problems: list[Problem], *, seed: int = 0) -> None:
        """Raise ValueError for an empty list."""
        if not problems:
            raise ValueError("ListTask needs at least one problem")
        self.problems, self.seed = list(problems), seed
        # Rows the loader skipped (broken JSON, missing fields, ...), reported by the generator.
        self.num_skipped_rows = int(getattr(problems, "num_skipped_rows", 0))
        self._perms: dict[int, list[int]] = {}

    def __len__(self) -> int:
        return len(self.problems)

    def _perm(self, epoch: int) -> list[int]:
        if epoch not in self._perms:
            order = list(range(len(self.problems)))
            random.Random(f"llamarl-list-task:{self.seed}:{epoch}").shuffle(order)
            self._perms = {epoch: order}  # keep one epoch: indices only ever move forward
        return self._perms[epoch]

    def sample(self, index: int) -> Problem:
        """Problem number ``index`` (>= 0) of the endless seeded stream."""
        if index < 0:
            raise ValueError(f"index must be >= 0, got {index}")
        epoch, offset = divmod(index, len(self.problems))
        return self.problems[self._perm(epoch)[offset]]
