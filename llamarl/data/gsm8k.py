"""GSM8K loading from local JSONL files (one ``{"question": ..., "answer": ...}`` object a line)."""

from __future__ import annotations

import json
import logging
from pathlib import Path

from llamarl.data.prompts import Problem
from llamarl.data.row_problems import RowProblems

logger = logging.getLogger("llamarl.data")


class Problems(list):
    """A list of problems that also says how many rows of its source were skipped."""

    num_skipped_rows: int = 0


def load_gsm8k_jsonl(path: str | Path) -> Problems:
    """Load GSM8K problems; ``Problem.answer`` is the full answer field (reasoning + ``#### N``).

    A missing file raises ValueError. Blank lines are ignored. A broken row (invalid UTF-8, not a
    JSON object, a missing / non-string / empty ``question`` or ``answer``) is skipped, warned about
    once per kind of problem naming the file and its first 1-based lines (``RowProblems``), and counted in ``num_skipped_rows`` of the result (the
    generator reports it as ``data_skipped_rows``): one bad line never costs a run.
    """
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"GSM8K file not found: {path}")
    problems, skipped = Problems(), RowProblems(path)
    with path.open("rb") as lines:
        for number, raw in enumerate(lines, start=1):
            problem, reason = _parse(raw)
            if reason == "blank":
                continue
            if problem is None:
                problems.num_skipped_rows += 1
                skipped.add(number, reason.split(":")[0].split(" at byte")[0], reason)
                continue
            problems.append(problem)
    skipped.report()
    return problems


def _parse(raw: bytes) -> tuple[Problem | None, str]:
    try:
        line = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        return None, f"invalid UTF-8 at byte {exc.start}"
    if not line.strip():
        return None, "blank"
    try:
        row = json.loads(line)
    except json.JSONDecodeError as exc:
        return None, f"invalid JSON: {exc.msg}"
    if not isinstance(row, dict):
        return None, "not a JSON object"
    for key in ("question", "answer"):
        if not isinstance(row.get(key), str):
            return None, f"missing or non-string {key!r}"
        if not row[key].strip():
            return None, f"empty {key!r}"
    return Problem(question=row["question"], answer=row["answer"]), ""
