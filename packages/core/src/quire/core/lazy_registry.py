"""``LazyRegistry``: pluggable classes by name, imported on first use and checked against their contract."""

from __future__ import annotations

import importlib
import inspect
from typing import Generic, TypeVar

from quire.core.errors import ConfigError

T = TypeVar("T")


class LazyRegistry(Generic[T]):
    """Names mapped to ``(module, class)``; ``get`` imports the class and checks it is a complete ``base``.

    ``kind`` names what is registered in error messages ("attention backend", "executor"). ``entries`` is
    the plain mapping (tests may patch it with ``monkeypatch.setitem``).
    """

    def __init__(self, kind: str, base: type[T]):
        self.kind = kind
        self.base = base
        self.entries: dict[str, tuple[str, str]] = {}

    def register(self, name: str, module_name: str, class_name: str) -> None:
        self.entries[name] = (module_name, class_name)

    def names(self) -> list[str]:
        return sorted(self.entries)

    def get(self, name: str) -> type[T]:
        """The class registered as ``name``; ConfigError naming it if unknown or not a complete ``base``."""
        if name not in self.entries:
            raise ConfigError(f"unknown {self.kind} {name!r}; known: {', '.join(self.names())}")
        module_name, class_name = self.entries[name]
        registered = getattr(importlib.import_module(module_name), class_name)
        self.check(registered, name)
        return registered

    def check(self, registered: object, name: str) -> None:
        """Raise ConfigError unless ``registered`` is a subclass of ``base`` with every abstract method."""
        if not (inspect.isclass(registered) and issubclass(registered, self.base)):
            raise ConfigError(f"{self.kind} {name!r} ({registered!r}) is not a subclass of {self.base.__name__}")
        if inspect.isabstract(registered):
            missing = ", ".join(sorted(registered.__abstractmethods__))
            raise ConfigError(f"{self.kind} {name!r} does not implement: {missing}")
