"""The live tensor bytes of a measured step, op by op (:class:`LiveTensorBytes`, a
``TorchDispatchMode``), and what the measurement asks of a tensor: its storage (:func:`_storage`),
whether it is autocast's cast of a parameter (:func:`_is_param_cast`), whether autocast's cache
is alive (:func:`_autocast_nested`). Imports no torch until asked.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from typing import Any


def _storage(t: Any) -> tuple[int, int] | None:
    try:
        s = t.untyped_storage()
        return int(s.data_ptr()), int(s.nbytes())
    except Exception:
        try:
            return id(t), int(t.numel()) * int(t.element_size())
        except Exception:
            return None


_FRESH: dict[Any, tuple[bool, ...]] = {}  # op -> which of its returns are new storages (not views)


def _fresh_returns(func: Any) -> tuple[bool, ...]:
    got = _FRESH.get(func)
    if got is None:
        try:
            got = tuple(r.alias_info is None for r in func._schema.returns)
        except Exception:
            got = ()
        if len(_FRESH) < 100_000:
            _FRESH[func] = got
    return got


_MODE_CLASS: Any = None


def _mode_class() -> Any:
    """The dispatch mode behind :class:`LiveTensorBytes` (defined when first needed: importing
    this module does not import torch)."""
    global _MODE_CLASS
    if _MODE_CLASS is None:
        import torch
        from torch.utils._python_dispatch import TorchDispatchMode

        class _LiveBytesMode(TorchDispatchMode):  # type: ignore[misc,no-untyped-call]
            def __init__(self, meter: LiveTensorBytes) -> None:
                super().__init__()  # type: ignore[no-untyped-call]
                self.meter = meter

            def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
                meter = self.meter
                if meter.cut:
                    # a storage the caller follows died since the last operator: before this one
                    meter.cut = False
                    on_cut = meter.on_cut
                    if on_cut is not None and meter.active:
                        try:
                            on_cut()
                        except Exception as exc:
                            meter.error = meter.error or f"live bytes: {type(exc).__name__}: {exc}"
                out = func(*args, **(kwargs or {}))
                if meter.active:
                    try:
                        fresh = _fresh_returns(func)
                        if len(fresh) == 1:
                            if fresh[0]:
                                meter._add_any(out)
                        else:
                            for is_new, item in zip(fresh, out if isinstance(out, (tuple, list)) else ()):
                                if is_new:
                                    meter._add_any(item)
                        meter.ops += 1
                        if meter.on_op is not None:
                            meter.on_op(meter.current)
                        elif meter.current > meter.peak:
                            meter.peak = meter.current
                    except Exception as exc:
                        meter.error = meter.error or f"live bytes: {type(exc).__name__}: {exc}"
                return out

        _MODE_CLASS = _LiveBytesMode
        del torch
    return _MODE_CLASS


class LiveTensorBytes:
    """The bytes of tensor storages alive, op by op, while entered (on this thread, and on the
    autograd threads its backward runs on, which inherit the dispatch mode).

    A ``TorchDispatchMode`` sees every operator's outputs after autograd and autocast (the
    backward's and the optimizer's included); each output that is a new storage (not a view,
    not an in-place result: the operator's schema says) is counted until the storage dies (a
    weak reference's callback). ``known`` tensors (parameters, gradients, optimizer state alive
    before) are counted from the start and their deaths too (``zero_grad`` frees gradients).
    What it does not see: memory an operator allocates and frees inside itself (a kernel's
    workspace) and storages made before that are not ``known`` (constant unless freed).
    ``peak`` is the highest ``current`` after any operator; with ``on_op`` the caller gets each
    level instead and keeps its own peak. With ``device``, only storages on that device count.
    Used by the measurement, and as the CPU's "real peak" of a run (scripts/bench_memory_plan.py,
    the tests)."""

    def __init__(
        self, known: Iterable[Any] = (), on_op: Callable[[int], None] | None = None, device: Any = None
    ) -> None:
        self.device = device  # count only storages on this device (None: all)
        self.current = 0
        self.peak = 0
        self.ops = 0
        self.error = ""
        self.on_op = on_op
        self.on_new: Callable[[int, int], None] | None = None  # each storage counted from now: (address, bytes)
        # each counted storage that died: (address, bytes), from the weak reference's callback (the
        # memory may not be released yet: nothing but bookkeeping there); it may set ``cut``, and
        # ``on_cut`` is then called before the next operator (the memory released by then)
        self.on_free: Callable[[int, int], None] | None = None
        self.on_cut: Callable[[], object] | None = None
        self.cut = False
        self.active = False
        self._live: dict[int, Any] = {}
        self._lock = threading.RLock()
        self._mode: Any = None
        for t in known:
            self.add(t)

    def add(self, t: Any) -> None:
        """Count the storage of tensor ``t`` from now until it dies (once, however many views)."""
        import weakref

        try:
            st = t.untyped_storage()
            if self.device is not None and st.device != self.device:
                return
            key = int(st._cdata)
            size = int(st.nbytes())
            address = int(st.data_ptr())
        except Exception:
            return
        if size <= 0:
            return
        with self._lock:
            if key in self._live:
                return

            def gone(_ref: Any, key: int = key, size: int = size, address: int = address) -> None:
                with self._lock:
                    if self._live.pop(key, None) is None:
                        return
                    self.current -= size
                on_free = self.on_free
                if on_free is not None and self.active:
                    try:
                        on_free(address, size)
                    except Exception as exc:
                        self.error = self.error or f"live bytes: {type(exc).__name__}: {exc}"

            self._live[key] = weakref.ref(st, gone)
            self.current += size
            if self.current > self.peak:
                self.peak = self.current
        if self.on_new is not None:
            self.on_new(address, size)

    def counts(self, t: Any) -> bool:
        """Whether the storage of tensor ``t`` is counted now (so its death will be seen)."""
        try:
            key = int(t.untyped_storage()._cdata)
        except Exception:
            return False
        with self._lock:
            return key in self._live

    def _add_any(self, item: Any) -> None:
        if isinstance(item, (list, tuple)):
            for x in item:
                self._add_any(x)
        elif item is not None and hasattr(item, "untyped_storage"):
            self.add(item)

    def __enter__(self) -> LiveTensorBytes:
        self._mode = _mode_class()(self)
        self._mode.__enter__()
        self.active = True
        return self

    def __exit__(self, *exc: Any) -> None:
        self.active = False
        mode, self._mode = self._mode, None
        if mode is not None:
            mode.__exit__(*exc)

    def close(self) -> None:
        """Stop counting (the weak references go; no callback runs after)."""
        self.active = False
        with self._lock:
            self._live.clear()


def _autocast_nested() -> bool:
    """Whether this thread is inside an autocast context, so its cache of parameter casts is
    alive (it is cleared when the outermost context exits). ``torch.is_autocast_enabled`` does
    not say it: it is false inside autocast's own kernels, which exclude its dispatch key."""
    import torch

    depth = int(torch.autocast_increment_nesting())
    torch.autocast_decrement_nesting()
    return depth > 1


def _is_param_cast(t: Any) -> bool:
    """Whether ``t`` is autocast's copy of a parameter (``_to_copy`` of a leaf that requires
    grad, or a view of one, as ``linear`` saves ``weight.t()``): autocast keeps such casts in
    its cache until its context exits, checkpoint or not."""
    base = getattr(t, "_base", None)
    fn = getattr(t if base is None else base, "grad_fn", None)
    if fn is None or type(fn).__name__ != "ToCopyBackward0":
        return False
    try:
        nxt = fn.next_functions
        return len(nxt) == 1 and nxt[0][0] is not None and type(nxt[0][0]).__name__ == "AccumulateGrad"
    except Exception:
        return False
