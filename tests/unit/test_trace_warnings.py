"""Torch's ``PythonSubclass`` warning (FSDP2's DTensor) never reaches the job's output.

libkineto opens the profiler range "PythonSubclass" in C++ before it runs a tensor subclass's
Python dispatch and closes it when that returns. dynprof's profiler stopped in between (a
duration-mode stop, or a deferred stop, runs as a pending call wherever the main thread is)
makes torch warn about the range at the operator's return: after dynprof's trace has ended, at
the job's own line (``adam.py:544`` under FSDP2). So dynprof never starts or stops its profiler
inside a tensor operator's Python dispatch: ``unsafe_reason`` names it, and the controller
retries a few milliseconds later. The job's warnings are never filtered.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import pytest

from collectors.torch_trace import TraceOptions, TraceSession
from dynprof.agent._safety import UnsafeReason, unsafe_reason

torch = pytest.importorskip("torch")
from torch.utils._pytree import tree_map  # noqa: E402


class _Subclass(torch.Tensor):
    """A wrapper tensor subclass whose Python dispatch runs ``during`` (as DTensor's runs
    sharding propagation), where a pending call of the agent may fire."""

    during: Callable[[], None] = staticmethod(lambda: None)

    @staticmethod
    def __new__(cls, elem):  # type: ignore[no-untyped-def]
        return torch.Tensor._make_wrapper_subclass(cls, elem.shape, dtype=elem.dtype)

    def __init__(self, elem):  # type: ignore[no-untyped-def]
        self.elem = elem

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        cls.during()
        unwrapped = tree_map(lambda x: x.elem if isinstance(x, _Subclass) else x, args)
        out = func(*unwrapped, **(kwargs or {}))
        return tree_map(lambda x: _Subclass(x) if isinstance(x, torch.Tensor) else x, out)


def _job_warnings(fn: Callable[[], None]) -> list[str]:
    """What the job would see: every warning raised while ``fn`` runs, with the job's filters."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fn()
    return [str(w.message) for w in caught]


def test_a_stop_inside_a_subclass_dispatch_makes_torch_warn_at_the_jobs_line():
    # GIVEN dynprof's trace recording a job whose tensors are a Python subclass
    session = TraceSession(TraceOptions(activities=["cpu"]), {"rank": 0})
    x = _Subclass(torch.ones(3))
    session.start(first_step=1)
    reasons: list[UnsafeReason | None] = []

    def stop_here() -> None:
        reasons.append(unsafe_reason(check_other_profiler=False))  # as a stop checks
        if session.stopped_at == 0.0:
            session.stop()

    _Subclass.during = staticmethod(stop_here)
    try:
        # WHEN the profiler is stopped inside the operator's Python dispatch
        seen = _job_warnings(lambda: x.sqrt())
    finally:
        _Subclass.during = staticmethod(lambda: None)
        if session.stopped_at == 0.0:
            session.stop()
    # THEN torch warns at the operator's return, into the job's output: that is why
    assert any(m.startswith("PythonSubclass") for m in seen), seen
    # AND dynprof's safety check names that moment unsafe
    assert reasons[0] is UnsafeReason.DISPATCH


def test_trace_of_subclass_ops_stopped_at_a_safe_point_warns_nothing():
    # GIVEN dynprof's trace recording subclass operators, whose dispatch asks for the stop
    # (as a pending call of a duration-mode trace lands there)
    session = TraceSession(TraceOptions(activities=["cpu"]), {"rank": 0})
    x = _Subclass(torch.ones(3))
    session.start(first_step=1)
    deferred: list[UnsafeReason] = []

    def stop_where_safe() -> None:
        reason = unsafe_reason(check_other_profiler=False)  # as a stop checks
        if reason is not None:
            deferred.append(reason)  # the controller retries later
        elif session.stopped_at == 0.0:
            session.stop()

    _Subclass.during = staticmethod(stop_where_safe)
    filters_before = list(warnings.filters)

    def job() -> None:
        for _ in range(3):
            x.sqrt()
        stop_where_safe()  # the retry, between operators

    try:
        # WHEN the job runs its operators and the stop waits for a safe point
        seen = _job_warnings(job)
    finally:
        _Subclass.during = staticmethod(lambda: None)
        stopped = session.stopped_at
        if stopped == 0.0:
            session.stop()
    # THEN the trace stopped, and the job saw no warning at all
    assert stopped > 0
    assert deferred, "the stop should have been asked for inside the dispatch"
    assert seen == [], seen
    # AND dynprof filtered none of the job's warnings
    assert list(warnings.filters) == filters_before
    assert _job_warnings(lambda: warnings.warn("PythonSubclass of the job", UserWarning, stacklevel=1)) == [
        "PythonSubclass of the job"
    ]


def test_outside_any_dispatch_is_a_safe_point():
    # GIVEN plain training-thread code  THEN nothing makes it unsafe
    assert unsafe_reason(check_other_profiler=False) is None
