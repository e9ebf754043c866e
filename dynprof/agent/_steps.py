"""Optimizer-step counting through a global ``torch.optim.Optimizer`` step post-hook.

The agent starts before the job imports torch, and must not import torch itself (that would
slow every process's start and could initialise things in an order the job does not expect).
So the hook is installed when the job imports ``torch.optim.optimizer``: a meta-path finder
wraps that one module's loader and registers the hook right after the module has run.

The hook is the only dynprof code on the training hot path. While nothing is requested it
does one dict update, one comparison and one clock read per optimizer step, and, at a step
boundary, what :class:`~dynprof.agent._gpu_step.GpuStepMarker` does (one CUDA event record when
the step ran on CUDA, one ``torch.cuda.is_initialized()`` call when not).
"""

from __future__ import annotations

import logging
import sys
import threading
import time
import weakref
from collections.abc import Callable
from types import ModuleType
from typing import Any

from dynprof.agent._gpu_step import GpuStepMarker
from dynprof.agent._mainthread import call_soon_in_main_thread
from dynprof.agent._post_import import PostImportFinder
from dynprof.agent._safety import returning

log = logging.getLogger("dynprof.agent")

OPTIMIZER_MODULE = "torch.optim.optimizer"
MAX_OPTIMIZERS = 256
RECENT_STEPS = 9

BoundaryListener = Callable[[int], None]


class StepTracker:
    """Counts training steps and calls listeners at each step boundary.

    A *step* is one training iteration, whatever number of optimizers it steps: the counter
    advances at the first optimizer step of each iteration, and a new iteration is recognised
    when an optimizer that already stepped in the current one steps again. So one optimizer
    counts each of its steps; several optimizers per iteration (a GAN's two, the per-parameter
    optimizers of "optimizer step in backward") count once per iteration; and an optimizer
    created mid-run (a second training stage, a k-fold loop, a second HF ``Trainer``) goes on
    counting from where the previous one left off (its very first step joins the iteration
    in progress, unless it replaced the optimizers that stepped there: they are gone, or it
    steps again before any other does, and then that first step began an iteration).

    Optimizer steps that run inside a ``torch.compile``d region are counted as one step each:
    Dynamo traces the hook into the compiled frame, where it only stores a constant into
    :data:`COMPILED_STEPS` (nothing breaks the graph); Dynamo replays that store on the training
    thread after the compiled code has run, and the replay counts the step there. While a
    capture listens, the boundary is taken when the outermost ``torch.compile`` wrapper on that
    thread returns (back in the training loop, as an eager step's boundary is taken when the
    optimizer's step returns), never inside the compiled region.
    """

    def __init__(self) -> None:
        self.step = 0
        self.last_step_at = 0.0  # time.time() of the latest boundary
        self.last_progress_at = 0.0  # time.time() of the latest optimizer step of any kind
        self.step_time_s = 0.0  # exponential mean of step durations
        self._recent = [0.0] * RECENT_STEPS  # the latest step durations, for typical_step_s
        self.optimizer_steps = 0  # every optimizer step seen, eager ones
        self._folded_compiled = COMPILED_STEPS.count  # counts of another tracker's time are not ours
        self._fold_lock = threading.Lock()  # the training thread and status readers both fold
        # Step boundaries handed to listeners elsewhere than at a step's end (a compiled step
        # whose compile wrapper could not be waited for): the spans around each are not one
        # whole iteration, and the trace's manifest says how many there were.
        self.inexact_boundaries = 0
        # The wait for a compile wrapper's return (thread, cancel, its frame), and the wrapper
        # frame found to hold several compiled steps (a compiled loop), while it runs.
        self._compiled_wait: tuple[int, Callable[[], None], Any] | None = None
        self._many_steps_wrapper: Any = None
        self.hook_installed = False
        self.hook_thread_id: int | None = None
        self.on_install: Callable[[], None] | None = None
        self._iteration: set[int] = set()  # ids of the optimizers that stepped in this iteration
        self._joined = 0  # id of a new optimizer whose first step joined it, while none stepped since
        # The job's optimizers (weakly), for the OOM report's parameter/gradient/state totals.
        self.optimizers: dict[int, Any] = {}
        self._last_mono = 0.0
        self._listeners: tuple[BoundaryListener, ...] = ()
        self._lock = threading.Lock()
        self._handle: Any = None
        self._finder: PostImportFinder | None = None
        self.gpu = GpuStepMarker()  # the GPU's side of each step (a CUDA event per boundary)

    # -- listeners (armed only while a capture needs step boundaries) ----------------------
    def add_listener(self, listener: BoundaryListener) -> None:
        with self._lock:
            if listener not in self._listeners:
                self._listeners = (*self._listeners, listener)

    def remove_listener(self, listener: BoundaryListener) -> None:
        with self._lock:
            # By equality, as add_listener checks: a bound method read again (self.method) is a new
            # object equal to the one added, and must remove it.
            self._listeners = tuple(x for x in self._listeners if x != listener)

    def typical_step_s(self) -> float:
        """The median of the latest step durations (one slow step, such as the one a trace's
        start or stop made, does not move it); 0.0 before any."""
        recent = sorted(d for d in self._recent if d > 0.0)
        return recent[len(recent) // 2] if recent else 0.0

    def all_optimizer_steps(self) -> int:
        """Every optimizer step seen so far: eager ones and those inside compiled regions."""
        return self.optimizer_steps + COMPILED_STEPS.count

    def fold_compiled(self) -> bool:
        """Count optimizer steps made inside compiled regions. True if the step advanced.

        The replay of each compiled step folds it at once on the training thread; other
        threads (status, the hang watchdog) call this too, for counts made before the hook's
        callback was in place. Each count is folded exactly once, whoever gets there first."""
        with self._fold_lock:
            compiled = COMPILED_STEPS.count
            if compiled == self._folded_compiled:
                return False
            self.step += compiled - self._folded_compiled
            self._folded_compiled = compiled
            self.last_step_at = self.last_progress_at = time.time()
            return True

    def _compiled_step(self) -> None:
        """A compiled optimizer step has just run: Dynamo replayed the hook's store on the
        training thread, after the compiled code and before its frame returns.

        While a capture listens, the step's boundary waits for the innermost ``torch.compile``
        wrapper around it to return (the training loop goes on there, outside the compiled
        region). A wrapper that holds several steps (a compiled loop) is not waited for: when
        a second step replays before it returned, the wait is given up and that wrapper's
        steps get their boundaries at once, inside it. Such boundaries, and one not taken,
        are counted in ``inexact_boundaries``."""
        try:
            self.fold_compiled()
            self._time_step(time.monotonic())
            if not self._listeners:
                self._many_steps_wrapper = None
                return
            thread = threading.get_ident()
            self.hook_thread_id = thread
            target = _innermost_compile_wrapper(sys._getframe(1))
            pending = self._compiled_wait
            if pending is not None:
                # The previous compiled step's boundary was not taken: its wrapper has not
                # returned (it holds this step too), or its profile slot was taken over.
                self._compiled_wait = None
                wait_thread, cancel, waited = pending
                if wait_thread == thread:
                    cancel()
                if waited is target:
                    self._many_steps_wrapper = target
                self.inexact_boundaries += 1
            many = self._many_steps_wrapper
            if many is not None and many is not target:
                self._many_steps_wrapper = many = None  # that wrapper has returned
            if target is None or target is many:
                self._inexact_boundary()
                return

            def boundary() -> None:
                self._compiled_wait = None
                self._notify(self.step)

            waiting = _when_returns(target, boundary)
            if waiting is None:
                self._inexact_boundary()
                return
            self._compiled_wait = (thread, waiting, target)
        except Exception:  # the training step must never see our failure
            self._compiled_wait = None
            log.exception("compiled step hook failed")

    def _inexact_boundary(self) -> None:
        """A compiled step's boundary, taken where the step's replay runs (inside the compiled
        frame): the trace's start and stop there wait for a safe point."""
        self.inexact_boundaries += 1
        self._notify(self.step)

    def _time_step(self, mono: float) -> None:
        if self._last_mono:
            dt = mono - self._last_mono
            self.step_time_s = dt if not self.step_time_s else 0.9 * self.step_time_s + 0.1 * dt
            self._recent[self.step % RECENT_STEPS] = dt
        self._last_mono = mono

    # -- the hook ----------------------------------------------------------------------------
    def _hook(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        """What the registered hook does (also called directly by the benchmarks)."""
        if _compiling():
            COMPILED_STEPS.step = True
            return
        self._eager_step(optimizer)

    def _remember(self, optimizer: Any) -> None:
        known = {k: r for k, r in self.optimizers.items() if r() is not None}
        if len(known) < MAX_OPTIMIZERS:
            try:
                known[id(optimizer)] = weakref.ref(optimizer)
            except TypeError:
                pass
        self.optimizers = known

    def _replaces(self, iteration: set[int], key: int) -> bool:
        """A new optimizer's first step: do the iteration's optimizers still exist? None left
        (the job dropped them for this one, as in ``opt = AdamW(...)``): a new iteration."""
        if key not in self.optimizers or len(self.optimizers) >= MAX_OPTIMIZERS:
            return False  # not every live optimizer is known: do not guess
        return not any(key in self.optimizers for key in iteration)

    def _eager_step(self, optimizer: Any) -> None:
        try:
            self.optimizer_steps += 1
            now = time.time()
            self.last_progress_at = now
            if COMPILED_STEPS.count != self._folded_compiled:
                self.fold_compiled()
            key = id(optimizer)
            known = self.optimizers.get(key)
            new = known is None or known() is not optimizer
            if new:
                self._remember(optimizer)
            iteration = self._iteration
            missed = 0
            if key in iteration:
                iteration.clear()
                if key == self._joined:
                    # A new optimizer joined the iteration in progress and stepped again before
                    # any other did: it replaced the job's optimizer, and its first step began
                    # an iteration. That iteration is counted now (its span is already drawn).
                    missed = 1
            elif iteration and new and self._replaces(iteration, key):
                iteration.clear()  # the optimizers of the iteration in progress are gone
            self._joined = 0
            if iteration:
                iteration.add(key)  # another optimizer of the iteration in progress
                if new:
                    self._joined = key
                return
            iteration.add(key)
            self.step += 1 + missed
            count = self.step
            self.gpu.mark(_TORCH[0], optimizer, count)
            self._time_step(time.monotonic())
            self.last_step_at = now
            if self._listeners:
                if _on_autograd_worker_thread() and self._notify_from_main_thread(count):
                    return
                self.hook_thread_id = threading.get_ident()
                if not _after_optimizer_range(lambda: self._notify(count)):
                    self._notify(count)
        except Exception:  # the training step must never see our failure
            log.exception("step hook failed")

    def _notify_from_main_thread(self, count: int) -> bool:
        """An optimizer stepped from a hook that autograd runs on one of its device threads
        (optimizer step in backward, on CUDA): the iteration is over only when the backward
        call returns on the training thread, and a profiler is started, stepped and stopped
        there, not on autograd's thread. The boundary is handed to the main thread's pending-call
        queue, which runs it at the first bytecode after backward's C++ call returns."""
        main = threading.main_thread().ident
        if not call_soon_in_main_thread(lambda: self._notify(count)):
            return False
        self.hook_thread_id = main
        return True

    def _notify(self, count: int) -> None:
        for listener in self._listeners:
            try:
                listener(count)
            except Exception:
                log.exception("step listener failed; it is removed")
                self.remove_listener(listener)

    # -- installation ------------------------------------------------------------------------
    def install(self) -> None:
        """Register the hook now if torch.optim is loaded, else when it gets imported."""
        module = sys.modules.get(OPTIMIZER_MODULE)
        if module is not None and hasattr(module, "register_optimizer_step_post_hook"):
            self._register(module)
            return
        if self._finder is None:
            self._finder = PostImportFinder(OPTIMIZER_MODULE, self._register)
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
        _TORCH[0] = getattr(module, "torch", None) or sys.modules.get("torch")
        _ON_COMPILED_STEP[0] = self._compiled_step
        self._handle = register(_traceable_hook(self._eager_step))
        self.hook_installed = True
        log.info("optimizer step hook installed")
        callback = self.on_install
        if callback is not None:
            try:
                callback()
            except Exception:
                log.exception("step hook install callback failed")

    def uninstall(self) -> None:
        if self._finder is not None:
            self._finder.step_aside()
            self._finder = None
        if self._handle is not None:
            try:
                self._handle.remove()
            except Exception:
                log.exception("removing the step hook failed")
            self._handle = None
        if _ON_COMPILED_STEP[0] == self._compiled_step:
            _ON_COMPILED_STEP[0] = None
        self.hook_installed = False


class _CompiledStepCounter(ModuleType):
    """Counts the optimizer steps that run inside compiled regions.

    Inside a frame that Dynamo compiles, the step hook stores the constant ``True`` into
    ``COMPILED_STEPS.step``. Dynamo records that store as a side effect of the frame and
    replays it, after the compiled graph has run, as a plain ``STORE_ATTR`` on this module,
    which runs this ``__setattr__`` eagerly, on the training thread: one count per compiled
    optimizer step, then the step tracker's callback. The hook never reads a value there, so
    the compiled frame holds no guard on the count (no recompile) and no graph break; the
    compiled graph itself is unchanged.
    """

    count = 0

    def __setattr__(self, name: str, value: Any) -> None:
        cls = type(self)
        cls.count += 1
        callback = _ON_COMPILED_STEP[0]
        if callback is not None:
            callback()


COMPILED_STEPS = _CompiledStepCounter("dynprof_compiled_steps")
# The installed StepTracker's _compiled_step, run by each replayed compiled step.
_ON_COMPILED_STEP: list[Callable[[], None] | None] = [None]
# torch, as torch.optim.optimizer imported it: found through that module when the hook is
# registered (torch is still initialising then), read when the hook runs.
_TORCH: list[Any] = [None]


def _compiling() -> bool:
    """torch.compiler.is_compiling(): a constant True that Dynamo folds while it traces."""
    torch = _TORCH[0]
    if torch is None:
        return False
    compiler = getattr(torch, "compiler", None)
    return bool(compiler is not None and compiler.is_compiling())


def _traceable_hook(eager_step: Callable[[Any], None]) -> Callable[[Any, Any, Any], None]:
    """The registered hook: eager steps go to ``eager_step``; Dynamo traces the rest.

    Dynamo inlines this function into a compiled optimizer step (``torch.compile`` of a
    function that calls ``opt.step()``): ``_compiling()`` folds to True, and the store into
    :data:`COMPILED_STEPS` is its only effect. Nothing there makes Dynamo break the graph,
    skip the frame or guard on a changing value. In eager mode it costs one extra call.
    """

    def dynprof_step_hook(optimizer: Any, args: Any, kwargs: Any) -> None:
        if _compiling():
            COMPILED_STEPS.step = True
            return
        eager_step(optimizer)

    return dynprof_step_hook


_OPTIMIZER_FILE = "torch/optim/optimizer.py"
_DYNAMO_PATH = "/torch/_dynamo/"  # torch.compile's wrappers (eval_frame.py's compile_wrapper)
# The Python entry points of a backward pass (``loss.backward()``, ``torch.autograd.backward``,
# ``torch.autograd.grad`` and the engine call they share).
_BACKWARD_FILES = ("torch/_tensor.py", "torch/autograd/__init__.py", "torch/autograd/graph.py")
_MAX_FRAMES = 512


def _in_backward() -> bool:
    torch = sys.modules.get("torch")
    try:
        return torch is not None and int(torch._C._current_graph_task_id()) != -1
    except Exception:
        return False


def _has_backward_frame(frame: Any) -> bool:
    depth = 0
    while frame is not None and depth < _MAX_FRAMES:
        if frame.f_code.co_filename.replace("\\", "/").endswith(_BACKWARD_FILES):
            return True
        frame = frame.f_back
        depth += 1
    return False


def _on_autograd_worker_thread() -> bool:
    """True on a thread that runs a backward pass the main thread called: a graph task is in
    progress, no backward entry point is on this thread's stack (one of autograd's device
    threads), and the main thread waits in a backward call. Only while a capture listens
    (never on the idle path)."""
    main = threading.main_thread()
    if threading.current_thread() is main or not _in_backward() or _has_backward_frame(sys._getframe(1)):
        return False
    main_frame = sys._current_frames().get(main.ident or -1)
    return main_frame is not None and _has_backward_frame(main_frame)


def _after_optimizer_range(callback: Callable[[], None]) -> bool:
    """Run ``callback`` right after the optimizer step that called the hook is over.

    The global post hooks run inside the optimizer's own profiler range
    (``Optimizer.step#...``); a ProfilerStep boundary taken there would cut that range in two.
    An optimizer stepped inside backward (from a post-accumulate-grad hook: "optimizer step in
    backward", one optimizer per parameter) is over for the iteration only when backward
    returns, and a profiler may start or stop only there. Only while a capture listens (never
    on the idle path): find the frame to wait for (the outermost frame of the optimizer's step
    wrapper, or of the backward call on this thread) and run the callback when that frame
    returns (see :func:`_when_returns`). Returns False (the caller runs the callback now) when
    the frame is not on this thread's stack (a backward that runs the hook on an autograd
    worker thread), or no way to wait for it is free.
    """
    frame: Any = sys._getframe(1)
    while frame is not None and frame.f_code.co_filename == __file__:
        frame = frame.f_back  # dynprof's own hook frames
    target = None
    depth = 0
    while frame is not None and depth < 8:
        if not frame.f_code.co_filename.replace("\\", "/").endswith(_OPTIMIZER_FILE):
            break
        target = frame
        frame = frame.f_back
        depth += 1
    if target is None:
        return False
    if _in_backward():
        target = None
        depth = 0
        while frame is not None and depth < _MAX_FRAMES:
            if frame.f_code.co_filename.replace("\\", "/").endswith(_BACKWARD_FILES):
                target = frame  # the outermost one wins
            frame = frame.f_back
            depth += 1
        if target is None:
            return False
    return _when_returns(target, callback) is not None


def _innermost_compile_wrapper(frame: Any) -> Any:
    """The innermost frame of torch.compile's own Python code (``torch/_dynamo/``: the
    ``compile_wrapper`` that a ``torch.compile``d function or method runs in) from ``frame``
    outwards, or None."""
    depth = 0
    while frame is not None and depth < _MAX_FRAMES:
        if _DYNAMO_PATH in frame.f_code.co_filename.replace("\\", "/"):
            return frame
        frame = frame.f_back
        depth += 1
    return None


def _when_returns(target: Any, callback: Callable[[], None]) -> Callable[[], None] | None:
    """Run ``callback`` when ``target`` (a frame of this thread) returns, from a one-shot
    profile function, or, when the thread already has one (torch's profiler recording Python
    stacks, cProfile), a one-shot trace function on that frame alone. Returns a function that
    cancels the wait (on this thread), or None when neither slot is free. The callback sees
    ``target`` as gone: the stack checks of :mod:`._safety` skip it (its code has run, its
    ``finally`` blocks too: only its return is left)."""

    def _run() -> None:
        try:
            with returning(target):
                callback()
        except Exception:
            log.exception("step boundary callback failed")

    if sys.getprofile() is None:

        def _on_event(frame: Any, event: str, arg: Any) -> None:
            if event != "return" or frame is not target:
                return
            sys.setprofile(None)
            _run()

        def _cancel_profile() -> None:
            if sys.getprofile() is _on_event:
                sys.setprofile(None)

        sys.setprofile(_on_event)
        return _cancel_profile
    if sys.gettrace() is not None:
        return None

    def _on_call(frame: Any, event: str, arg: Any) -> None:
        return None  # no other frame is traced

    def _on_target(frame: Any, event: str, arg: Any) -> Any:
        if event != "return" or frame is not target:
            return _on_target
        sys.settrace(None)
        frame.f_trace = None
        _run()
        return None

    def _cancel_trace() -> None:
        if sys.gettrace() is _on_call:
            sys.settrace(None)
        if target.f_trace is _on_target:
            target.f_trace = None

    target.f_trace_lines = False
    target.f_trace = _on_target
    sys.settrace(_on_call)
    return _cancel_trace
