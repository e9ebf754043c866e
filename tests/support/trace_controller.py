"""The agent's trace controller as its unit tests use it: no agent, no profiler, no step hook.

``idle_controller(monkeypatch)`` is a :class:`dynprof.agent._trace.TraceController` of a rank
at step 10 whose optimizer step hook counts as installed (none is registered), with the job's
profiler watch stood in for: the controller under test never wraps torch. Cancel its timers
when done (``controller._cancel_timers()``).
"""

from __future__ import annotations

import types

import pytest

from dynprof.agent import _trace
from dynprof.agent._steps import StepTracker
from dynprof.identity import Identity


def idle_controller(monkeypatch: pytest.MonkeyPatch) -> _trace.TraceController:
    monkeypatch.setattr(_trace, "WATCH", types.SimpleNamespace(install=lambda: True, on_foreign_prepare=None))
    steps = StepTracker()
    steps.hook_installed = True  # as after torch.optim's import; no hook is registered
    steps.step = 10
    agent = types.SimpleNamespace(
        steps=steps, identity=Identity(host="h", rank=0, local_rank=0, world_size=1, job_id="j")
    )
    return _trace.TraceController(agent)  # type: ignore[arg-type]
