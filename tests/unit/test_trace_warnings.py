"""Torch's warnings about what dynprof's own profiler met while it records stay out of the job's
output, and only while dynprof's trace records."""

from __future__ import annotations

import warnings

import pytest

from collectors.torch_trace import TraceOptions, TraceSession

torch = pytest.importorskip("torch")

# As torch raises it from the profiler's collection on FSDP2's DTensor, on the training thread.
SUBCLASS = "PythonSubclass (Triggered internally at /pytorch/torch/csrc/profiler/collection.cpp:664.)"


def _warned(message: str) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.warn(message, UserWarning, stacklevel=1)
    return [str(w.message) for w in caught]


def test_profiler_warnings_are_ignored_while_recording_and_only_then():
    filters_before = list(warnings.filters)
    session = TraceSession(TraceOptions(activities=["cpu"]), {"rank": 0})
    # GIVEN dynprof's trace recording
    session.start(first_step=1)
    try:
        # THEN torch's warning about the profiler is not shown; the job's own warnings are
        assert _warned(SUBCLASS) == []
        assert _warned("the job's own warning") == ["the job's own warning"]
    finally:
        session.stop()
    # AND once it stopped, the filters are as the job left them
    assert list(warnings.filters) == filters_before
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        warnings.warn(SUBCLASS, UserWarning, stacklevel=1)
    assert [str(w.message) for w in caught] == [SUBCLASS]
