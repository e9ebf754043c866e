"""Optimizer-step counting through a global ``torch.optim.Optimizer`` step post-hook.

The agent starts before the job imports torch, and must not import torch itself (that would
slow every process's start and could initialise things in an order the job does not expect).
So the hook is installed when the job imports ``torch.optim.optimizer``: a meta-path finder
wraps that one module's loader and registers the hook right after the module has run.

The hook is the only dynprof code on the training hot path. While nothing is requested it
does one dict update, one comparison and one clock read per optimizer step.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import logging
import sys
import threading
import time
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

log = logging.getLogger("dynprof.agent")

OPTIMIZER_MODULE = "torch.optim.optimizer"

BoundaryListener = Callable[[int], None]


class StepTracker:
    """Counts completed optimizer steps and calls listeners at each step boundary."""

    def __init__(self) -> None:
        self.step = 0
        self.last_step_at = 0.0  # time.time() of the latest boundary
        self.step_time_s = 0.0  # exponential mean of step durations
        self.hook_installed = False
        self.hook_thread_id: int | None = None
        self._per_optimizer: dict[int, int] = {}
        self._last_mono = 0.0
        self._listeners: tuple[BoundaryListener, ...] = ()
        self._lock = threading.Lock()
        self._handle: Any = None
        self._finder: _PostImportFinder | None = None

    # -- listeners (armed only while a capture needs step boundaries) ----------------------
    def add_listener(self, listener: BoundaryListener) -> None:
        with self._lock:
            if listener not in self._listeners:
                self._listeners = (*self._listeners, listener)

    def remove_listener(self, listener: BoundaryListener) -> None:
        with self._lock:
            self._listeners = tuple(x for x in self._listeners if x is not listener)

    # -- the hook ----------------------------------------------------------------------------
    def _hook(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        try:
            key = id(optimizer)
            count = self._per_optimizer.get(key, 0) + 1
            self._per_optimizer[key] = count
            # Several optimizers stepping once per iteration count as one step.
            if count <= self.step:
                return
            self.step = count
            mono = time.monotonic()
            if self._last_mono:
                dt = mono - self._last_mono
                self.step_time_s = dt if not self.step_time_s else 0.9 * self.step_time_s + 0.1 * dt
            self._last_mono = mono
            self.last_step_at = time.time()
            listeners = self._listeners
            if listeners:
                self.hook_thread_id = threading.get_ident()
                for listener in listeners:
                    try:
                        listener(count)
                    except Exception:
                        log.exception("step listener failed; it is removed")
                        self.remove_listener(listener)
        except Exception:  # the training step must never see our failure
            log.exception("step hook failed")

    # -- installation ------------------------------------------------------------------------
    def install(self) -> None:
        """Register the hook now if torch.optim is loaded, else when it gets imported."""
        module = sys.modules.get(OPTIMIZER_MODULE)
        if module is not None and hasattr(module, "register_optimizer_step_post_hook"):
            self._register(module)
            return
        if self._finder is None:
            self._finder = _PostImportFinder(OPTIMIZER_MODULE, self._register)
            sys.meta_path.insert(0, self._finder)

    def _register(self, module: ModuleType) -> None:
        if self.hook_installed:
            return
        register = getattr(module, "register_optimizer_step_post_hook", None)
        if register is None:
            log.warning(
                "torch %s has no global optimizer step hook; step mode is unavailable",
                getattr(sys.modules.get("torch"), "__version__", "?"),
            )
            return
        self._handle = register(self._hook)
        self.hook_installed = True
        log.info("optimizer step hook installed")

    def uninstall(self) -> None:
        if self._finder is not None:
            try:
                sys.meta_path.remove(self._finder)
            except ValueError:
                pass
            self._finder = None
        if self._handle is not None:
            try:
                self._handle.remove()
            except Exception:
                log.exception("removing the step hook failed")
            self._handle = None
        self.hook_installed = False


class _PostImportFinder(importlib.abc.MetaPathFinder):
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
                try:
                    sys.meta_path.remove(this)
                except ValueError:
                    pass
                try:
                    callback(module)
                except Exception:
                    log.exception("post-import callback for %s failed", this.name)

        spec.loader = _Loader()
        return spec
