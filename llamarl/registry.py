"""One registry type for every pluggable piece chosen by name: policy losses, advantage estimators
(llamarl/algorithms/registry.py), generation engines (llamarl/engines/base.py) and environments
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


def import_path(path: str, *, kind: str) -> Callable:
    """The callable a ``"package.module:attr"`` path names (a user's scorer, environment class, ...
    outside any registry); ValueError naming the ``kind`` and the path when it does not import or
    is not callable (a bad name in a flag is a configuration error)."""
    module_name, _, attr = path.partition(":")
    try:
        item = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"cannot import {kind} {path!r}: {exc}") from None
    if not callable(item):
        raise ValueError(f"{kind} {path!r} is not callable")  # noqa: TRY004 - a config error, reported as one
    return item
