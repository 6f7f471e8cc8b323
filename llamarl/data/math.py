"""MATH / MATH-500 problems from JSONL (one object a line) or the Hugging Face hub.

Accepted rows: a question under ``problem`` (Hendrycks MATH, MATH-500) or ``question``, and the
reference under ``answer`` (MATH-500: the bare final answer) or, failing that, ``solution`` (the
full worked solution; its last ``\\boxed{...}`` is the answer). ``Problem.answer`` is always the
bare final answer, what ``llamarl.rewards.math.score`` expects as ``reference``.
"""

from __future__ import annotations

import json
from pathlib import Path

from llamarl.data.boxed import boxed_contents
from llamarl.data.prompts import Problem


def row_to_problem(row: dict, *, where: str = "row") -> Problem:
    """The Problem of one MATH row (keys in the module docstring); ValueError naming ``where`` if invalid."""
    question = row.get("problem", row.get("question"))
    answer = row.get("answer")
    if not isinstance(answer, str) or not answer.strip():
        solution = row.get("solution")
        boxed = boxed_contents(solution) if isinstance(solution, str) else []
        answer = boxed[-1].strip() if boxed else None
    if not isinstance(question, str) or not answer:
        raise ValueError(f"{where}: expected string 'problem' (or 'question') and 'answer' "
                         "(or a 'solution' with \\boxed{...})")
    return Problem(question=question, answer=answer)


def load_math_jsonl(path: str | Path, *, limit: int | None = None) -> list[Problem]:
    """Load MATH problems from a JSONL file; blank lines skipped; ValueError names file and line."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"MATH file not found: {path}")
    problems = []
    with path.open(encoding="utf-8") as lines:
        for number, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{number}: invalid JSON ({exc.msg})") from None
            if not isinstance(row, dict):
                raise ValueError(f"{path}:{number}: expected a JSON object")  # noqa: TRY004 - a data error
            problems.append(row_to_problem(row, where=f"{path}:{number}"))
            if limit is not None and len(problems) >= limit:
                break
    return problems
