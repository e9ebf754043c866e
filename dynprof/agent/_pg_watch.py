"""Notice when the job creates its default torch.distributed process group.

``init_process_group`` is wrapped as soon as ``torch.distributed.distributed_c10d`` is imported
(``import torch`` does it): the wrapper calls the job's own function, then the listeners, which
must be quick (they start a thread at most). Installed from the agent's start-up, on the thread
that starts the agent, before the job can import torch; no torch import here.
"""

from __future__ import annotations

import functools
import logging
import sys
import threading
from collections.abc import Callable
from typing import Any

from dynprof.agent._post_import import PostImportFinder

log = logging.getLogger("dynprof.agent")

C10D_MODULE = "torch.distributed.distributed_c10d"


class ProcessGroupWatch:
    def __init__(self) -> None:
        self.listeners: list[Callable[[], None]] = []
        self._lock = threading.Lock()
        self._installed = False

    def install(self) -> None:
        with self._lock:
            if self._installed:
                return
            self._installed = True
        module = sys.modules.get(C10D_MODULE)
        if module is not None and hasattr(module, "init_process_group"):
            self.wrap(module)
            return
        # Runs right after distributed_c10d has executed, before torch.distributed copies its
        # names with ``import *``: the package exports the wrapper too.
        sys.meta_path.insert(0, PostImportFinder(C10D_MODULE, self.wrap))

    def wrap(self, module: Any) -> None:
        targets: list[Any] = [module, sys.modules.get("torch.distributed")]
        for target in targets:
            original = getattr(target, "init_process_group", None)
            if original is None or getattr(original, "__dynprof_wrapped__", False):
                continue
            target.init_process_group = self._wrapper(original)

    def _wrapper(self, original: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(original)
        def init_process_group(*args: Any, **kwargs: Any) -> Any:
            result = original(*args, **kwargs)
            self.fire()
            return result

        init_process_group.__dynprof_wrapped__ = True  # type: ignore[attr-defined]
        return init_process_group

    def fire(self) -> None:
        for listener in list(self.listeners):
            try:
                listener()
            except Exception:
                log.info("process group listener failed", exc_info=True)


WATCH = ProcessGroupWatch()
