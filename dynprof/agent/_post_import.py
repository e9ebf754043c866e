"""A hook that runs right after the job imports a module: how the agent completes what needs
torch's modules (the optimizer's step hook, the profiler's watch, CUDA's allocator history, the
process group's wrapper) without importing them itself."""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import logging
import sys
from collections.abc import Callable, Sequence
from types import ModuleType

log = logging.getLogger("dynprof.agent")


class PostImportFinder(importlib.abc.MetaPathFinder):
    """Calls ``callback(module)`` right after ``name`` has been imported, then steps aside."""

    def __init__(self, name: str, callback: Callable[[ModuleType], None]) -> None:
        self.name = name
        self.callback = callback
        self._busy = False

    def find_spec(
        self, fullname: str, path: Sequence[str] | None = None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != self.name or self._busy:
            return None
        self._busy = True
        try:
            spec = None
            for finder in sys.meta_path:
                if finder is self or not hasattr(finder, "find_spec"):
                    continue
                spec = finder.find_spec(fullname, path, target)
                if spec is not None:
                    break
        finally:
            self._busy = False
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        loader = spec.loader
        callback = self.callback
        this = self

        class _Loader(importlib.abc.Loader):
            def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
                return loader.create_module(spec)

            def exec_module(self, module: ModuleType) -> None:
                loader.exec_module(module)
                this.step_aside()
                try:
                    callback(module)
                except Exception:
                    log.exception("post-import callback for %s failed", this.name)

        spec.loader = _Loader()
        return spec

    def step_aside(self) -> None:
        """Leave the import system (nothing to do where it has left already)."""
        try:
            sys.meta_path.remove(self)
        except ValueError:
            pass
