"""Problems from a Hugging Face hub dataset, with a clear error where ``datasets`` or the hub is missing.

Only used when a recipe is given no local JSONL path. ``datasets`` is not a project dependency:
``pip install datasets`` to use the hub.
"""

from __future__ import annotations

from collections.abc import Callable

from llamarl.data.prompts import Problem


def load_hub_problems(dataset: str, *, config: str | None, split: str,
                      to_problem: Callable[[dict], Problem], limit: int | None = None) -> list[Problem]:
    """Load ``split`` of hub dataset ``dataset`` (``config`` subset) and map each row with ``to_problem``.

    Raises ValueError (one line: what failed and the local-file alternative) when ``datasets`` is
    not installed or the dataset cannot be downloaded (offline, ``HF_HUB_OFFLINE=1``, no access).
    """
    try:
        import datasets  # optional dependency
    except ImportError:
        raise ValueError(f"loading {dataset!r} from the Hugging Face hub needs `pip install datasets`; "
                         "or pass a local JSONL with --data.path") from None
    try:
        rows = datasets.load_dataset(dataset, config, split=split)
    except Exception as exc:  # noqa: BLE001 - network / auth / offline errors have many types
        raise ValueError(f"cannot load {dataset!r} ({config}, {split}) from the Hugging Face hub "
                         f"({type(exc).__name__}: {str(exc)[:200]}); pass a local JSONL with --data.path") from None
    problems = [to_problem(dict(row)) for row in rows]
    return problems[:limit] if limit is not None else problems
