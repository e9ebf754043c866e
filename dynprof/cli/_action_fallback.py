"""TEMPORARY: a sidecar action for a command that has no ``collect_local``/``collect`` yet.

Such a command still only prints: it is run with ``--json`` and its stdout and stderr are
captured for that call alone (a contextvar-switched stream stands in for ``sys.stdout`` and
``sys.stderr``; the threads it starts through :func:`dynprof.cli._common.parallel` follow it),
and its JSON is read back into a :class:`~dynprof.result.Result`. Once ``ps``, ``ls``,
``stacks``, ``start``, ``stop``, ``memory`` and ``nccl`` answer with ``collect_local`` and
``collect_nodes``, delete this module and its one use in :mod:`dynprof.cli.sidecar_actions`
(and the context copying in ``parallel``).
"""

from __future__ import annotations

import argparse
import contextvars
import io
import json
import sys
import threading
from collections.abc import Callable
from typing import Any, TextIO

from dynprof.result import Result

MAX_OUTPUT_BYTES = 64 * 1024 * 1024

_SINK: contextvars.ContextVar[tuple[io.StringIO, io.StringIO] | None] = contextvars.ContextVar(
    "dynprof_output_sink", default=None
)
_install_lock = threading.Lock()


class _Routed(io.TextIOBase):
    """A stand-in for sys.stdout / sys.stderr: writes go to the current context's buffer when
    one is set (a command running as an action), else to the real stream."""

    def __init__(self, real: TextIO, index: int) -> None:
        self._real = real
        self._index = index

    def _target(self) -> Any:
        sink = _SINK.get()
        return sink[self._index] if sink is not None else self._real

    def write(self, text: str) -> int:
        target = self._target()
        if target is not self._real and target.tell() > MAX_OUTPUT_BYTES:
            raise OSError("dynprof: action output over the limit")
        return int(target.write(text))

    def flush(self) -> None:
        target = self._target()
        if target is self._real:
            target.flush()

    def writable(self) -> bool:
        return True

    def isatty(self) -> bool:
        return False if _SINK.get() is not None else self._real.isatty()

    def fileno(self) -> int:
        if _SINK.get() is not None:
            raise io.UnsupportedOperation("captured output has no file descriptor")
        return self._real.fileno()

    @property
    def encoding(self) -> str:  # type: ignore[override]
        return getattr(self._real, "encoding", "utf-8") or "utf-8"


def _install_capture() -> None:
    with _install_lock:
        if not isinstance(sys.stdout, _Routed):
            sys.stdout = _Routed(sys.stdout, 0)  # type: ignore[assignment]
        if not isinstance(sys.stderr, _Routed):
            sys.stderr = _Routed(sys.stderr, 1)  # type: ignore[assignment]


def printing_collect(command: Any) -> Callable[[argparse.Namespace], Result]:
    """A ``collect`` for a command that has only ``run(args) -> int`` (with ``args.json`` set)."""

    def collect(args: argparse.Namespace) -> Result:
        _install_capture()
        out, err = io.StringIO(), io.StringIO()

        def call() -> int:
            _SINK.set((out, err))
            return int(command.run(args))

        code = contextvars.copy_context().run(call)  # a DynprofError goes up as it is
        messages: list[str] = []
        for line in err.getvalue().splitlines():
            if not line.strip():
                continue
            if line.startswith("dynprof: ") or not messages:
                messages.append(line.removeprefix("dynprof: "))
            else:  # a continuation line ("  what to do: ..."): printed again as it was
                messages[-1] += "\n" + line
        text = out.getvalue()
        try:
            doc = json.loads(text) if text.strip() else {}
        except ValueError:
            return Result({}, code or 1, [*messages, "the command's output was not JSON"])
        return Result(doc if isinstance(doc, dict) else {"value": doc}, code, messages)

    return collect
