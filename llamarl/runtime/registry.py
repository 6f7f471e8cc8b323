"""One registry type for every pluggable piece chosen by name: policy losses, advantage estimators
(llamarl/algorithms/registered.py), generation engines (llamarl/engines/base.py) and environments
(llamarl/environments/base.py). The same rules everywhere: a name is registered once (ValueError
otherwise), an unknown name is a ValueError listing the registered ones, and the built-ins are
registered before the first lookup (``load_builtins``, which imports the modules that register
them, so a registry can live in a module those modules import).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")


class Registry(Generic[T]):
    """Named items of one ``kind`` (see the module docstring)."""

    def __init__(self, kind: str, *, load_builtins: Callable[[], None] | None = None) -> None:
        self.kind = kind
        self._items: dict[str, T] = {}
        self._load_builtins = load_builtins

    def _loaded(self) -> dict[str, T]:
        if self._load_builtins is not None:
            load, self._load_builtins = self._load_builtins, None
            load()
        return self._items

    def add(self, name: str, item: T) -> T:
        """Register ``item`` as ``name``; ValueError when the name is taken."""
        if name in self._items:
            raise ValueError(f"{self.kind} {name!r} is already registered")
        self._items[name] = item
        return item

    def register(self, name: str) -> Callable[[T], T]:
        """Decorator form of ``add``: the decorated function or class is the item."""
        return lambda item: self.add(name, item)

    def get(self, name: str) -> T:
        """The item registered as ``name``; ValueError listing the registered names otherwise."""
        items = self._loaded()
        if name not in items:
            raise ValueError(f"unknown {self.kind} {name!r}; registered: {', '.join(sorted(items))}")
        return items[name]

    def names(self) -> list[str]:
        """The registered names, sorted."""
        return sorted(self._loaded())

    def __contains__(self, name: object) -> bool:
        return name in self._loaded()

    def copy(self) -> Registry[T]:
        """An independent registry with the same items (tests register into a copy)."""
        other = Registry(self.kind)
        other._items = dict(self._loaded())
        return other


def import_path(path: str, *, kind: str, flag: str | None = None) -> Callable:
    """The callable a ``"package.module:attr"`` path names (a user's scorer, environment class, tool
    function, ... outside any registry). ValueError, one line: ``<flag> <path>: <why>`` with a
    ``flag``, else ``cannot import <kind> '<path>': <why>``, where why is one of: not
    ``module:name``; no such module (with how to make it importable) or importing it failed, and
    how; no such name in it (listing the module's own functions); not callable."""
    prefix = f"{flag} {path}" if flag else f"cannot import {kind} {path!r}"
    module_name, sep, attr = path.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"{prefix}: expected module:{kind} (a Python file my_task.py and its {kind} f: my_task:f)")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name and (module_name == exc.name or module_name.startswith(exc.name + ".")):
            raise ValueError(f"{prefix}: no module named {module_name!r} (run from the directory that holds it, "
                             "or put that directory on PYTHONPATH)") from None
        raise ValueError(f"{prefix}: importing {module_name} failed: {exc}") from None
    except Exception as exc:  # noqa: BLE001 - the user's module may raise anything at import
        first = next((line for line in str(exc).splitlines() if line.strip()), "")
        raise ValueError(f"{prefix}: importing {module_name} failed: {type(exc).__name__}: {first}") from None
    where = getattr(module, "__file__", None) or module_name
    if not hasattr(module, attr):
        own = sorted(name for name, item in vars(module).items() if callable(item) and not name.startswith("_")
                     and getattr(item, "__module__", None) == module.__name__)
        raise ValueError(f"{prefix}: {where} has no {attr!r} (it defines: {', '.join(own) or 'nothing callable'})")
    item = getattr(module, attr)
    if not callable(item):
        raise ValueError(f"{prefix}: {attr} in {where} is a {type(item).__name__}, not callable as a {kind}")  # noqa: TRY004 - a config error, reported as one
    return item
