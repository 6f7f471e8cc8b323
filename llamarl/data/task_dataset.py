"""A task's problems from the user's own dataset (``recipes/task.py``): a local JSONL / JSON /
Parquet / Arrow file (or a ``save_to_disk`` directory), or a Hugging Face dataset by name.

``load_rows(ref, flag=...)`` reads the rows; ``rows_to_problems`` turns each row into a ``Problem``
whose ``question`` is the row's prompt text (its prompt field, or the prompt template formatted
with the row's fields), or, for a prompt field holding chat messages (TRL's conversational format)
or a row with its own system turn, the conversation as JSON (``conversation_of`` reads it back);
whose ``answer`` is the row's answer field as text (what the scorer gets as ``reference``); and
whose ``columns`` are the row's other fields (what reward functions, trajectory scorers and
environments get of the row). Every failure a user can cause is a ``ValueError`` of one line naming the flag:
a missing file, a Hub dataset that cannot be loaded, a field that no row has, a template naming a
field the rows lack. A row that lacks a field other rows have, or a JSONL line that is not a JSON
object, is skipped and counted (``num_skipped_rows``, reported by the generator as
``data_skipped_rows``), as the GSM8K loader does, with one warning line per kind of problem
(``llamarl/data/row_problems.py``: the count and the first three row numbers).

A Hub reference is ``name[:config][@split]`` (``openai/gsm8k:main@test``); the split defaults to
the caller's (``train`` for training, ``test`` for evaluation). JSONL needs nothing beyond the
standard library; Parquet, Arrow and the Hub need ``datasets`` (``pip install 'llamarl[task]'``).
"""

from __future__ import annotations

import json
import logging
import random
import string
from pathlib import Path

from llamarl.data.gsm8k import Problems
from llamarl.data.prompts import Problem, check_messages, conversation_text
from llamarl.data.row_problems import RowProblems

logger = logging.getLogger("llamarl.data")

JSON_SUFFIXES = (".jsonl", ".json", ".ndjson")
DATASETS_SUFFIXES = {".parquet": "parquet", ".arrow": "arrow", ".csv": "csv"}
SUFFIXES = (*JSON_SUFFIXES, *DATASETS_SUFFIXES)


class Rows(list):
    """Rows (dicts) of a dataset, with where they came from and how many lines were skipped."""

    source: str = ""
    num_skipped_rows: int = 0


def looks_like_a_path(ref: str) -> bool:
    """Whether ``ref`` names a local file rather than a Hub dataset: it exists, starts like a path
    (``/``, ``.``, ``~``) or ends in a dataset file suffix."""
    return (Path(ref).expanduser().exists() or ref.startswith(("/", ".", "~"))
            or ref.lower().endswith(SUFFIXES))


def parse_hub_ref(ref: str, *, default_split: str) -> tuple[str, str | None, str]:
    """``name[:config][@split]`` -> ``(name, config or None, split)``."""
    name, _, split = ref.partition("@")
    name, _, config = name.partition(":")
    return name, config or None, split or default_split


def _import_datasets(flag: str, ref: str):
    try:
        import datasets  # optional dependency: pip install 'llamarl[task]'
    except ImportError:
        raise ValueError(f"{flag} {ref}: reading it needs the `datasets` package (pip install 'llamarl[task]'), "
                         "or give a JSONL file") from None
    return datasets


def _read_jsonl(path: Path, flag: str) -> Rows:
    rows, skipped = Rows(), RowProblems(path)
    with path.open("rb") as lines:
        for number, raw in enumerate(lines, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                kind, reason = "invalid UTF-8", f"invalid UTF-8 at byte {exc.start}"
            else:
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as exc:
                    kind, reason = "invalid JSON", f"invalid JSON: {exc.msg}"
                else:
                    if isinstance(row, dict):
                        rows.append(row)
                        continue
                    kind = reason = "not a JSON object"
            rows.num_skipped_rows += 1
            skipped.add(number, kind, reason)
    skipped.report()
    if not rows and rows.num_skipped_rows:
        raise ValueError(f"{flag} {path}: no line is a JSON object (one object a line, JSONL)")
    return rows


def _read_json(path: Path, flag: str) -> Rows:
    """A ``.json`` file: a list of objects, or JSONL under another name."""
    text = path.read_text(encoding="utf-8")
    try:
        data = json.loads(text)
    except json.JSONDecodeError:
        return _read_jsonl(path, flag)
    if isinstance(data, dict):
        data = [data]
    if not isinstance(data, list) or not all(isinstance(row, dict) for row in data):
        raise ValueError(f"{flag} {path}: expected a list of JSON objects, or one object a line (JSONL)")
    return Rows(data)


def _read_local(path: Path, flag: str, ref: str) -> Rows:
    if path.is_dir():
        datasets = _import_datasets(flag, ref)
        try:
            loaded = datasets.load_from_disk(str(path))
        except Exception as exc:  # noqa: BLE001 - any failure to read it is the user's input
            raise ValueError(f"{flag} {ref}: not a dataset saved with save_to_disk "
                             f"({type(exc).__name__}: {str(exc)[:200]})") from None
        if isinstance(loaded, datasets.DatasetDict):
            raise ValueError(f"{flag} {ref}: a DatasetDict of splits {sorted(loaded)}; give one split's directory")
        return Rows(dict(row) for row in loaded)
    suffix = path.suffix.lower()
    if suffix in (".jsonl", ".ndjson"):
        return _read_jsonl(path, flag)
    if suffix == ".json":
        return _read_json(path, flag)
    if suffix not in DATASETS_SUFFIXES:
        raise ValueError(f"{flag} {ref}: unknown file type {suffix or '(none)'}; use one of {', '.join(SUFFIXES)}")
    datasets = _import_datasets(flag, ref)
    try:
        if suffix == ".arrow":
            loaded = datasets.Dataset.from_file(str(path))
        else:
            loaded = datasets.load_dataset(DATASETS_SUFFIXES[suffix], data_files=str(path), split="train")
    except Exception as exc:  # noqa: BLE001 - a broken file has many error types
        raise ValueError(f"{flag} {ref}: cannot read it ({type(exc).__name__}: {str(exc)[:200]})") from None
    return Rows(dict(row) for row in loaded)


def load_rows(ref: str, *, flag: str, default_split: str = "train") -> Rows:
    """The rows of dataset ``ref`` (a local file or directory, else a Hub ``name[:config][@split]``);
    ValueError of one line naming ``flag`` when it cannot be read or has no rows."""
    if looks_like_a_path(ref):
        path = Path(ref).expanduser()
        if not path.exists():
            raise ValueError(f"{flag} {ref}: no such file")
        rows = _read_local(path, flag, ref)
        source = str(path)
    else:
        name, config, split = parse_hub_ref(ref, default_split=default_split)
        datasets = _import_datasets(flag, ref)
        try:
            loaded = datasets.load_dataset(name, config, split=split)
        except Exception as exc:  # noqa: BLE001 - network / auth / offline / unknown split have many types
            first = next((line for line in str(exc).splitlines() if line.strip()), "")
            raise ValueError(f"{flag} {ref}: not a local file, and the Hugging Face dataset {name!r} "
                             f"(config {config}, split {split}) cannot be loaded: {type(exc).__name__}: "
                             f"{first[:200]}") from None
        rows, source = Rows(dict(row) for row in loaded), f"{name} ({config or 'default'}, {split})"
    if not rows:
        raise ValueError(f"{flag} {ref}: the dataset has no rows")
    rows.source = source
    return rows


def template_fields(template: str, flag: str) -> list[str]:
    """The field names ``template`` formats (``"{question} in {unit}"`` -> question, unit);
    ValueError naming ``flag`` for a malformed template or a positional ``{}``."""
    try:
        names = [name for _, name, _, _ in string.Formatter().parse(template) if name is not None]
    except ValueError as exc:
        raise ValueError(f"{flag} {template!r}: {exc}") from None
    for name in names:
        if name == "" or name.isdigit():
            raise ValueError(f"{flag} {template!r}: name each field, e.g. {{question}}, not {{{name}}}")
    return [name.split(".")[0].split("[")[0] for name in names]


def as_text(value) -> str:
    """A row's value as the text a prompt or scorer gets: a string as it is, anything else as JSON."""
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


def row_columns(row: dict, *, prompt_field: str) -> dict:
    """The row's fields but the prompt's, as JSON values (what crosses the channels to the scorers;
    a value JSON cannot hold, e.g. a date, as its text)."""
    return json.loads(json.dumps({k: v for k, v in row.items() if k != prompt_field}, default=str))


def row_prompt(row: dict, *, prompt_field: str, system_field: str | None, where: str) -> str | None:
    """The row's prompt field as a ``Problem.question``: text as it is, a list of messages as the
    conversation's text (``conversation_text``), after the row's ``system_field`` turn if it has one;
    None when the row needs the prompt template instead (``prompt_field`` None)."""
    system = row.get(system_field) if system_field else None
    if system is not None and not isinstance(system, str):
        raise ValueError(f"{where}: the system field {system_field!r} must be text, got {type(system).__name__}")
    prompt = row[prompt_field]
    if isinstance(prompt, list):
        messages = check_messages(prompt, where)
    elif system:
        messages = [{"role": "user", "content": as_text(prompt)}]
    else:
        return as_text(prompt)
    if system and messages[0]["role"] != "system":
        messages = [{"role": "system", "content": system}, *messages]
    return conversation_text(messages)


def rows_to_problems(rows: Rows, *, prompt_field: str, answer_field: str, prompt_template: str | None,
                     flags: dict[str, str], system_field: str | None = None) -> Problems:
    """``Problem(question=prompt text, answer=answer text, columns=the row's other fields)`` per row
    (module docstring). A prompt field holding a list of messages (``{"role", "content"}``) is a
    conversation, carried as its JSON (``llamarl.data.prompts.conversation_of`` reads it back); a
    row with a ``system_field`` text becomes a conversation opening with that system turn.
    ``flags`` maps ``prompt_field`` / ``answer_field`` / ``prompt_template`` / ``dataset`` to the
    flag names used in messages. ValueError (one line) when no row has a needed field, or for a
    malformed conversation."""
    needed = {answer_field: f"{flags['answer_field']} {answer_field}"}
    if prompt_template is None:
        needed[prompt_field] = f"{flags['prompt_field']} {prompt_field}"
    else:
        for name in template_fields(prompt_template, flags["prompt_template"]):
            needed.setdefault(name, f"{flags['prompt_template']} {prompt_template!r}")
    for name, where in needed.items():
        if not any(name in row for row in rows):
            fields = sorted({key for row in rows[:100] for key in row})
            raise ValueError(f"{where}: no row of {rows.source} has a field {name!r} (its fields: {', '.join(fields)})")
    problems = Problems()
    problems.num_skipped_rows = rows.num_skipped_rows
    skipped = RowProblems(rows.source)
    for index, row in enumerate(rows):
        missing = [name for name in needed if row.get(name) is None]
        if missing:
            problems.num_skipped_rows += 1
            skipped.add(index + 1, "no " + ", ".join(map(repr, missing)))
            continue
        if prompt_template is None:
            question = row_prompt(row, prompt_field=prompt_field, system_field=system_field,
                                  where=f"{flags['prompt_field']} {prompt_field}: row {index + 1} of {rows.source}")
        else:
            try:
                question = prompt_template.format_map({key: _Formatted(value) for key, value in row.items()})
            except (KeyError, IndexError, AttributeError, ValueError, TypeError) as exc:
                raise ValueError(f"{flags['prompt_template']} {prompt_template!r}: row {index + 1} of {rows.source}: "
                                 f"{type(exc).__name__}: {exc}") from None
            system = row.get(system_field) if system_field else None
            if isinstance(system, str) and system:
                question = conversation_text([{"role": "system", "content": system}, {"role": "user", "content": question}])
        problems.append(Problem(question=question, answer=as_text(row[answer_field]),
                                columns=row_columns(row, prompt_field=prompt_field if prompt_template is None else "")))
    skipped.report()
    if not problems:
        raise ValueError(f"{flags['dataset']}: every row of {rows.source} was skipped (see the warnings)")
    return problems


class _Formatted:
    """A row value inside a prompt template: strings as they are, other values as JSON, unless the
    template gives a format spec (``{value:.2f}``), which applies to the value itself."""

    def __init__(self, value) -> None:
        self.value = value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec) if spec else as_text(self.value)

    def __getitem__(self, key):
        return _Formatted(self.value[key])

    def __getattr__(self, name: str):
        if name.startswith("__") or name == "value":
            raise AttributeError(name)
        return _Formatted(getattr(self.value, name))


def split_heldout(problems: list[Problem], *, fraction: float, seed: int) -> tuple[Problems, list[Problem]]:
    """``(train, heldout)``: ``round(fraction * n)`` problems chosen by a seeded shuffle are held out
    (at least one when ``fraction`` > 0, never all of them), the rest are trained on in their order."""
    n = len(problems)
    count = 0 if fraction <= 0 else min(max(1, round(fraction * n)), n - 1)
    order = list(range(n))
    random.Random(f"llamarl-task-heldout:{seed}").shuffle(order)
    held = set(order[:count])
    train = Problems(p for i, p in enumerate(problems) if i not in held)
    train.num_skipped_rows = int(getattr(problems, "num_skipped_rows", 0))
    return train, [problems[i] for i in order[:count]]

