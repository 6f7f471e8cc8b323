"""Rows a loader skipped, reported once: one warning line per kind of problem, not one per row.

A file where half the rows lack the answer field would otherwise print hundreds of ``row N
skipped`` lines, burying everything after them. A loader adds each skipped row to ``RowProblems``
as it reads (its 1-based line or row number and the kind of problem: ``no 'answer'``, ``invalid
JSON``, ...) and calls ``report()`` once at the end, which logs, per kind, in the order first met:

- one row: ``<source>:<row>: row skipped (<problem>)``;
- several: ``<source>: <count> rows skipped (<problem>): rows 2, 4, 6, ...`` (the first three).

``<problem>`` is the first such row's own text (``invalid JSON: Expecting value``) when the kind
has one. The count of all skipped rows is the loader's ``num_skipped_rows`` as before.
"""

from __future__ import annotations

import logging

logger = logging.getLogger("llamarl.data")

SHOWN_ROWS = 3
"""Row numbers a summary line names."""


class RowProblems:
    """The rows of one source skipped so far, by kind (module docstring)."""

    def __init__(self, source: object) -> None:
        """``source``: what the lines name (a path, a dataset reference)."""
        self.source = source
        self.rows: dict[str, list[int]] = {}
        self.texts: dict[str, str] = {}

    def add(self, row: int, kind: str, text: str | None = None) -> None:
        """Row ``row`` (1-based) skipped for ``kind``; ``text``: its own wording (default ``kind``)."""
        self.rows.setdefault(kind, []).append(row)
        self.texts.setdefault(kind, text or kind)

    def __len__(self) -> int:
        return sum(len(rows) for rows in self.rows.values())

    def lines(self) -> list[str]:
        """The report's lines (module docstring), one per kind."""
        out = []
        for kind, rows in self.rows.items():
            if len(rows) == 1:
                out.append(f"{self.source}:{rows[0]}: row skipped ({self.texts[kind]})")
            else:
                shown = ", ".join(map(str, rows[:SHOWN_ROWS])) + (", ..." if len(rows) > SHOWN_ROWS else "")
                out.append(f"{self.source}: {len(rows)} rows skipped ({self.texts[kind]}): rows {shown}")
        return out

    def report(self) -> None:
        """Log ``lines()`` as warnings (nothing when no row was skipped)."""
        for line in self.lines():
            logger.warning("%s", line)
