"""Where a profiler may start or stop without harming the job.

torch.profiler keeps its state in the thread-local state of the thread that starts it.
Autograd's backward runs under a guard that saves and restores that thread-local state, so a
profiler started inside ``loss.backward()`` (from a hook, a checkpoint recomputation, an
optimizer stepped from a post-accumulate-grad hook, or a pending call that fired there) is
silently dropped when backward returns, and stopping it later crashes in libtorch. Kineto is
also one per process: a second profiler started while the job runs its own silently ends the
first one. So dynprof starts and stops its profiler only at a *safe point*: on the training
thread, outside any autograd graph task, outside torch.compile's machinery, outside a tensor
operator's Python dispatch (a tensor subclass such as DTensor), and only while no other
profiler is active. :func:`unsafe_reason` says why a moment is not safe; the trace
controller then retries a few milliseconds later (or at the next step boundary).

:class:`ProfilerWatch` knows when the job's own profiler is prepared or recording, and tells
the trace controller when one prepares during a dynprof trace, so dynprof can end its trace
first (the job's profiler always wins).
"""

from __future__ import annotations

import contextlib
import enum
import functools
import logging
import sys
import threading
import weakref
from collections.abc import Callable, Iterator
from typing import Any

from dynprof.agent._post_import import PostImportFinder

log = logging.getLogger("dynprof.agent")

# Python files whose frames on the stack mean "inside torch.compile": tracing, compiling, or
# running a compiled region through its wrappers.
_COMPILE_PATHS = ("/torch/_dynamo/", "/torch/_inductor/", "/torch/_functorch/", "/torch/_higher_order_ops/")
_MAX_FRAMES = 512
# Python frames that run in the middle of one tensor operator: a tensor subclass's dispatch
# (DTensor's, under FSDP2 and tensor parallel, runs in torch/distributed/tensor/), a dispatch
# or function mode. libtorch has opened that operator's profiler range ("PythonSubclass") in
# C++ before calling them and closes it when they return: a profiler stopped in between makes
# torch warn about the range at the operator's return, into the job's output, after dynprof's
# trace has ended; one started in between misses the range's start.
_DISPATCH_PATHS = ("/torch/distributed/tensor/", "/torch/_subclasses/", "/torch/utils/_python_dispatch.py")
_DISPATCH_NAMES = ("__torch_dispatch__", "__torch_function__")


def in_backward() -> bool:
    """True when the calling thread is executing an autograd graph task (inside backward)."""
    torch = sys.modules.get("torch")
    if torch is None:
        return False
    try:
        return int(torch._C._current_graph_task_id()) != -1
    except Exception:
        return False


_RETURNING = threading.local()


@contextlib.contextmanager
def returning(frame: Any) -> Iterator[None]:
    """Inside this block, ``frame`` (on the calling thread's stack, whose return a one-shot
    profile or trace function is handling) counts as gone: its code, ``finally`` blocks
    included, has run, and only its return is left. A step boundary taken when a
    ``torch.compile`` wrapper returns is outside the compiled region."""
    previous = getattr(_RETURNING, "frame", None)
    _RETURNING.frame = frame
    try:
        yield
    finally:
        _RETURNING.frame = previous


def _on_stack(skip: int, matches: Callable[[Any], bool]) -> bool:
    """True when a frame of the calling thread's Python stack (from ``skip`` frames up, at most
    _MAX_FRAMES of them) ``matches``; a frame that is :func:`returning` does not count."""
    try:
        frame: Any = sys._getframe(skip + 1)
    except ValueError:
        return False
    gone = getattr(_RETURNING, "frame", None)
    depth = 0
    while frame is not None and depth < _MAX_FRAMES:
        if frame is not gone and matches(frame.f_code):
            return True
        frame = frame.f_back
        depth += 1
    return False


def _filename(code: Any) -> str:
    return str(code.co_filename).replace("\\", "/")


def in_compiled_region(skip: int = 1) -> bool:
    """True when a torch.compile frame is on the calling thread's Python stack."""
    return _on_stack(skip, lambda code: any(p in _filename(code) for p in _COMPILE_PATHS))


def in_operator_dispatch(skip: int = 1) -> bool:
    """True when the calling thread runs Python inside a tensor operator's dispatch."""
    return _on_stack(
        skip,
        lambda code: code.co_name in _DISPATCH_NAMES or any(p in _filename(code) for p in _DISPATCH_PATHS),
    )


def in_optimizer_step(skip: int = 1) -> bool:
    """True when an optimizer step (torch.optim) is on the calling thread's Python stack.

    A start or stop there cuts the step's ``Optimizer.step#`` range (and runs among its
    operators: FSDP2's DTensor operators warn about a profiler stopped there). Step boundaries
    are taken after the range has closed; a start or stop that runs wherever the main thread
    is (a pending call) waits until the step is over.
    """
    return _on_stack(skip, lambda code: "/torch/optim/" in _filename(code))


def other_profiler_active() -> bool:
    """True when a torch.profiler (or autograd profiler) other than dynprof's is recording.

    Checks the process-wide flag torch's profilers set on start, and the calling thread's
    profiler state in libtorch.
    """
    if WATCH.foreign_active():
        return True
    autograd_profiler = sys.modules.get("torch.autograd.profiler")
    if autograd_profiler is not None and getattr(autograd_profiler, "_is_profiler_enabled", False):
        return True
    torch = sys.modules.get("torch")
    if torch is None:
        return False
    try:
        return bool(torch._C._autograd._profiler_enabled())
    except Exception:
        return False


class UnsafeReason(enum.Enum):
    """Why a profiler must not be started or stopped on this thread now. Callers decide on the
    member; its text is for the log."""

    BACKWARD = "inside autograd's backward"
    COMPILED = "inside a torch.compile region"
    DISPATCH = "inside a tensor operator's Python dispatch"
    OTHER_PROFILER = "another torch.profiler is active"

    @property
    def text(self) -> str:
        return str(self.value)


def unsafe_reason(check_other_profiler: bool = True) -> UnsafeReason | None:
    """Why a profiler must not be started or stopped on this thread now, or None if it may."""
    if in_backward():
        return UnsafeReason.BACKWARD
    if in_compiled_region(skip=2):
        return UnsafeReason.COMPILED
    if in_operator_dispatch(skip=2):
        return UnsafeReason.DISPATCH
    if check_other_profiler and other_profiler_active():
        return UnsafeReason.OTHER_PROFILER
    return None


class ProfilerWatch:
    """Knows when the job's own torch profiler is prepared or recording.

    Every torch profiler (``torch.profiler.profile`` with or without a schedule, and the
    autograd profiler's context manager) prepares Kineto through
    ``torch.autograd.profiler.profile._prepare_trace`` and ends through its ``__exit__``.
    A profiler in its schedule's warm-up is prepared but not yet recording, and invisible to
    torch's "enabled" flags; starting dynprof's profiler then would cancel its warm-up and
    later crash libtorch. So once torch is imported, dynprof wraps those two methods with
    bookkeeping only (the original always runs, whatever the bookkeeping does): the set of
    profiler objects that are prepared and not yet exited, other than dynprof's own, and a
    callback when one prepares while dynprof traces (dynprof then ends its trace first).
    """

    def __init__(self) -> None:
        self.on_foreign_prepare: Callable[[], None] | None = None
        self._foreign: weakref.WeakSet[Any] = weakref.WeakSet()
        self._ours: weakref.WeakSet[Any] = weakref.WeakSet()
        # The job's torch.profiler.profile objects between start() and stop(), in any phase of
        # their schedule: while one waits out its "wait" steps it records nothing, yet its
        # ProfilerStep ranges would land in a dynprof trace and its next warm-up would end it.
        self._sessions: weakref.WeakSet[Any] = weakref.WeakSet()
        self._own_sessions: weakref.WeakSet[Any] = weakref.WeakSet()
        self._sessions_watched = False
        self._starting_ours = False
        self._lock = threading.Lock()
        self.installed = False

    def install(self) -> bool:
        """Wrap the methods (once each). Returns whether the watch is in place."""
        with self._lock:
            self._watch_sessions()
            if self.installed:
                return True
            autograd_profiler = sys.modules.get("torch.autograd.profiler")
            cls: Any = getattr(autograd_profiler, "profile", None)
            prepare = getattr(cls, "_prepare_trace", None) if cls is not None else None
            leave = getattr(cls, "__exit__", None) if cls is not None else None
            if cls is None or prepare is None or leave is None:
                return False
            watch = self

            def _prepare_trace(prof: Any, *args: Any, **kwargs: Any) -> Any:
                watch._prepared(prof)
                return prepare(prof, *args, **kwargs)

            def __exit__(prof: Any, *args: Any, **kwargs: Any) -> Any:
                try:
                    return leave(prof, *args, **kwargs)
                finally:
                    watch._exited(prof)

            _wrap(cls, {"_prepare_trace": (_prepare_trace, prepare), "__exit__": (__exit__, leave)})
            self.installed = True
            log.info("watching torch.profiler for the job's own profilers")
            return True

    def _watch_sessions(self) -> None:
        """Wrap ``torch.profiler.profile.start``/``stop`` to know the job's profilers in use."""
        if self._sessions_watched:
            return
        module = sys.modules.get("torch.profiler.profiler")
        cls: Any = getattr(module, "profile", None)
        start = getattr(cls, "start", None) if cls is not None else None
        stop = getattr(cls, "stop", None) if cls is not None else None
        if cls is None or start is None or stop is None:
            return
        watch = self

        def start_wrapper(prof: Any, *args: Any, **kwargs: Any) -> Any:
            try:
                (watch._own_sessions if watch._starting_ours else watch._sessions).add(prof)
            except Exception:
                log.exception("noting the job's own profiler failed")
            return start(prof, *args, **kwargs)

        def stop_wrapper(prof: Any, *args: Any, **kwargs: Any) -> Any:
            try:
                return stop(prof, *args, **kwargs)
            finally:
                try:
                    watch._sessions.discard(prof)
                    watch._own_sessions.discard(prof)
                except Exception:
                    log.exception("noting the end of a profiler failed")

        _wrap(cls, {"start": (start_wrapper, start), "stop": (stop_wrapper, stop)})
        self._sessions_watched = True

    @contextlib.contextmanager
    def ours(self) -> Iterator[None]:
        """Profilers prepared on this thread inside this block are dynprof's own."""
        self._starting_ours = True
        try:
            yield
        finally:
            self._starting_ours = False

    def foreign_active(self) -> bool:
        return len(self._foreign) > 0 or len(self._sessions) > 0

    def _prepared(self, prof: Any) -> None:
        try:
            if self._starting_ours:
                self._ours.add(prof)
                return
            self._foreign.add(prof)
            callback = self.on_foreign_prepare
            if callback is not None:
                callback()
        except Exception:
            log.exception("noting the job's own profiler failed")

    def _exited(self, prof: Any) -> None:
        try:
            self._foreign.discard(prof)
            self._ours.discard(prof)
        except Exception:
            log.exception("noting the end of a profiler failed")


def _wrap(cls: Any, wrappers: dict[str, tuple[Callable[..., Any], Callable[..., Any]]]) -> None:
    """Put each wrapper on ``cls`` in place of its original method of that name, looking like
    it and marked as the watch's (``_dynprof_watch``)."""
    for wrapper, original in wrappers.values():
        functools.update_wrapper(wrapper, original)
        setattr(wrapper, "_dynprof_watch", True)  # noqa: B010
    for name, (wrapper, _original) in wrappers.items():
        setattr(cls, name, wrapper)


WATCH = ProfilerWatch()


PROFILER_MODULE = "torch.profiler.profiler"


def watch_when_imported() -> None:
    """Complete the watch as soon as the job imports torch.profiler (now, if it has)."""
    if PROFILER_MODULE in sys.modules:
        WATCH.install()
        return

    def install(_module: Any) -> None:
        WATCH.install()

    if not any(isinstance(f, PostImportFinder) and f.name == PROFILER_MODULE for f in sys.meta_path):
        sys.meta_path.insert(0, PostImportFinder(PROFILER_MODULE, install))
