"""One generic name → plugin registry, used by every plugin kind.

A plugin is looked up by its registered name, or by a `module:attr` path so users can
plug in their own code without editing assay:

    >>> advantages = Registry("advantage estimator")
    >>> @advantages.register("mine")
    ... def mine(rewards, group, mask): ...
    >>> advantages.get("mine") is mine
    True
    >>> advantages.get("os.path:join").__name__
    'join'
"""

from __future__ import annotations

import importlib
from typing import Callable, Generic, Iterator, TypeVar

from assay.errors import AssayError

T = TypeVar("T")


class Registry(Generic[T]):
    """Maps names to plugins of one kind (rewards, advantage estimators, losses, tasks...)."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._items: dict[str, T] = {}

    def register(self, name: str) -> Callable[[T], T]:
        """Decorator that registers `obj` under `name`; a name can be registered once."""

        def deco(obj: T) -> T:
            if name in self._items and self._items[name] is not obj:
                raise ValueError(f"{self.kind} {name!r} is already registered")
            self._items[name] = obj
            return obj

        return deco

    def get(self, name: str) -> T:
        """The plugin called `name`, or the object at a `module:attr` path."""
        if name in self._items:
            return self._items[name]
        if ":" in name:
            return load_path(name, self.kind)
        known = ", ".join(sorted(self._items)) or "(none)"
        raise AssayError(f"unknown {self.kind} {name!r}; known: {known}; or give a module:attr path")

    def names(self) -> list[str]:
        return sorted(self._items)

    def items(self) -> Iterator[tuple[str, T]]:
        return iter(sorted(self._items.items()))

    def __contains__(self, name: object) -> bool:
        return name in self._items


def load_path(path: str, kind: str = "object") -> object:
    """Import `module:attr` (attr may be dotted) and return the attribute."""
    module_name, _, attr = path.partition(":")
    try:
        obj: object = importlib.import_module(module_name)
    except ImportError as e:
        raise AssayError(f"cannot import {kind} {path!r}: {e}") from None
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise AssayError(f"cannot import {kind} {path!r}: {module_name} has no attribute {attr!r}") from None
    return obj
