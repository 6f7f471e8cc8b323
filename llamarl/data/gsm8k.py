"""GSM8K loading from local JSONL files (one ``{"question": ..., "answer": ...}`` object a line)."""

from __future__ import annotations

import json
from pathlib import Path

from llamarl.data.prompts import Problem


def load_gsm8k_jsonl(path: str | Path) -> list[Problem]:
    """Load GSM8K problems; ``Problem.answer`` is the full answer field (reasoning + ``#### N``).

    Blank lines are skipped. A missing file, a line that is not a JSON object, or a line without
    string ``question`` / ``answer`` fields raises ValueError naming the file and 1-based line number.
    """
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"GSM8K file not found: {path}")
    problems = []
    with path.open(encoding="utf-8") as lines:
        for number, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{number}: invalid JSON ({exc.msg})") from None
            if not isinstance(row, dict) or not all(
                isinstance(row.get(k), str) for k in ("question", "answer")
            ):
                raise ValueError(f"{path}:{number}: expected an object with string 'question' and 'answer'")
            problems.append(Problem(question=row["question"], answer=row["answer"]))
    return problems
