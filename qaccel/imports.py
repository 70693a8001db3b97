"""Importing torch's heavy parts with the garbage collector paused.

``import torch._dynamo`` (which DistributedDataParallel and every optimizer's constructor need) creates some
150 000 objects and almost no garbage, yet the collections its allocations trigger keep scanning them all: a third
of its time.
"""

from __future__ import annotations

import contextlib
import gc
import importlib
import importlib.abc
import sys
from collections.abc import Iterable, Iterator
from types import ModuleType
from typing import Any

HEAVY = ("torch._dynamo",)


def import_quietly(names: Iterable[str]) -> None:
    """Import ``names`` now, the garbage collector paused. A module that cannot be imported is passed over, as
    multiprocessing's preload does: the code that needs it says what is missing."""
    with _gc_paused():
        for name in names:
            with contextlib.suppress(ImportError):
                importlib.import_module(name)


def import_quietly_when_needed(names: Iterable[str] = HEAVY) -> None:
    """Pause the garbage collector while each of ``names`` not imported yet is imported, whenever that happens
    (``import torch._dynamo`` directly, or torch importing it lazily)."""
    pending = frozenset(names) - set(sys.modules)
    if pending and not any(isinstance(finder, _QuietFinder) for finder in sys.meta_path):
        sys.meta_path.insert(0, _QuietFinder(pending))


class _QuietFinder(importlib.abc.MetaPathFinder):
    """Finds nothing itself: hands the spec the other finders find a loader that runs the module with the garbage
    collector paused (the module's own imports included), then leaves the module the original loader."""

    def __init__(self, names: frozenset[str]) -> None:
        self.names = set(names)

    def find_spec(self, fullname: str, path: Any, target: ModuleType | None = None) -> Any:
        if fullname not in self.names:
            return None
        self.names.discard(fullname)
        if not self.names:
            sys.meta_path.remove(self)
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None)
            spec = find(fullname, path, target) if finder is not self and find is not None else None
            if spec is not None and spec.loader is not None:
                spec.loader = _QuietLoader(spec.loader)
                return spec
        return None


class _QuietLoader(importlib.abc.Loader):
    def __init__(self, loader: importlib.abc.Loader) -> None:
        self.loader = loader

    def create_module(self, spec: Any) -> ModuleType | None:
        return self.loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        spec = module.__spec__
        if spec is None:  # the import system sets it before calling exec_module
            raise ImportError(f"cannot load {module.__name__}: it has no __spec__")
        module.__loader__ = spec.loader = self.loader
        with _gc_paused():
            self.loader.exec_module(module)


@contextlib.contextmanager
def _gc_paused() -> Iterator[None]:
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()
