"""collectors.memory.plan.capture: one training step measured for the memory plan, in-process
on CPU tensors: the hooks' clean-up and the measurement's document. (The blocks found in a model
and what refuses a measurement: test_collectors_memory_plan_blocks.py; the live-bytes meter:
test_collectors_memory_plan_meter.py.) The measurement's
arithmetic against hand-computed bytes and its clean-up when the step raises or is stopped from
another thread: test_collectors_memory_plan_measurement.py; the predicted peak against the real
one: test_collectors_memory_plan_predict.py, test_collectors_memory_plan_timeline.py.
"""

from __future__ import annotations

import gc
import sys
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode

from collectors.memory.plan import capture as pc
from collectors.memory.plan.capture import StepMeasurement, measure_step
from collectors.memory.plan.measurement import SCHEMA
from tests.unit._plan_models import Stack, step_of

pytestmark = pytest.mark.usefixtures("eager_process")

F32 = 4


# -- the measurement ---------------------------------------------------------------------------------------
def test_the_document_of_a_cpu_step():
    torch.manual_seed(0)
    model = Stack(3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    step = step_of(model, opt, torch.randn(5, 4))
    doc = measure_step(model, opt, step, overhead_of=0.25)
    assert doc["schema"] == SCHEMA and doc["device"] == "cpu" and doc["error"] == ""
    assert doc["typical_step_s"] == 0.25 and doc["step_s"] > 0
    assert doc["peak_source"] == "live tensor bytes after each operator (CPU)"
    assert doc["untracked_bytes"] == 0 and doc["drift_bytes"] == 0
    assert doc["peak_bytes"] == max(max(seg) for seg in doc["timeline"])
    assert doc["saved_tensors"] > 0 and doc["operators"] > 0
    params = sum(p.numel() for p in model.parameters()) * F32
    assert doc["parameter_bytes"] == params
    # zero_grad set the gradients to None after backward: each is counted at its parameter's size
    assert doc["gradient_bytes"] == params and doc["optimizer_state_bytes"] == 0
    for b in doc["blocks"]:
        assert b["class"] == "Block" and b["calls"] == 1 and not b["checkpointed"]
        assert b["parameter_bytes"] == (4 * 8 + 8 + 8 * 4 + 4) * F32
        assert b["forward_s"] > 0 and 0 <= b["recompute_s"] <= b["forward_s"]
        # each block's forward ends before its backward starts, both inside the timeline
        assert b["forward_end"] < b["backward_start"] < len(doc["timeline"])
        assert b["saved_bytes"] >= b["freeable_bytes"] > 0
        assert b["recompute_bytes"] >= b["freeable_bytes"]
    # backward runs the blocks in reverse
    starts = [b["backward_start"] for b in doc["blocks"]]
    assert starts == sorted(starts, reverse=True)


def test_the_blocks_are_listed_in_the_order_of_their_first_call():
    # GIVEN blocks registered 0, 1, 2 and run 2, 0, 2, 1 (block 2 twice, weights shared)
    model = Stack(3, order=[2, 0, 2, 1])
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    doc = measure_step([model], [opt], step_of(model, opt, torch.randn(2, 4)))
    assert [(b["name"], b["calls"]) for b in doc["blocks"]] == [("layers.2", 2), ("layers.0", 1), ("layers.1", 1)]


def test_optimizer_state_and_frozen_parameters_are_counted():
    model = Stack(2)
    for p in model.head.parameters():
        p.requires_grad_(False)
    opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad])
    step = step_of(model, opt, torch.randn(2, 4))
    step()  # Adam's state exists
    doc = measure_step(model, opt, step)
    stepped = sum(p.numel() for p in model.parameters() if p.requires_grad) * F32
    frozen = sum(p.numel() for p in model.head.parameters()) * F32
    assert doc["parameter_bytes"] == stepped + frozen
    assert doc["gradient_bytes"] == stepped
    assert doc["optimizer_state_bytes"] == 2 * stepped  # exp_avg, exp_avg_sq (the step counters are scalars)


def test_the_given_clock_times_the_blocks():
    ticks = iter(range(10**9))
    calls = []

    def clock() -> float:
        calls.append(1)
        return float(next(ticks))

    model = Stack(2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    doc = measure_step(model, opt, step_of(model, opt, torch.randn(2, 4)), clock=clock)
    assert len(calls) > 10
    assert all(b["forward_s"] >= 1 for b in doc["blocks"])  # at least one tick each


def test_a_hook_that_fails_is_reported_and_the_step_runs_on(monkeypatch):
    model = Stack(2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    before = [p.detach().clone() for p in model.parameters()]
    real_event = StepMeasurement._event

    def event(self: StepMeasurement) -> int:
        if self._stack:
            raise RuntimeError("event lost")
        return real_event(self)

    monkeypatch.setattr(StepMeasurement, "_event", event)
    doc = measure_step(model, opt, step_of(model, opt, torch.randn(2, 4)))
    assert doc["error"] == "forward pre-hook: event lost"
    assert any(not torch.equal(a, p) for a, p in zip(before, model.parameters()))  # the step ran
    assert _get_current_dispatch_mode() is None
    assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None


def test_stop_is_safe_twice_and_before_start_and_hooks_pass_through_after():
    model = Stack(2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    m = StepMeasurement([model], [opt])
    m.stop()
    m.stop()
    assert m.stopped and m.error == "" and not m.started
    # stopped: what autograd hands the hooks goes through untouched
    t = torch.ones(2)
    assert m._pack(t) is t
    assert m._unpack(t) is t
    m2 = StepMeasurement([model], [opt])
    saved = pc._Saved(0, t, m2)
    m2.stopped = True
    assert m2._unpack(saved) is t


def test_a_saved_tensor_let_go_after_the_measurement_is_ignored(monkeypatch):
    model = Stack(2)
    m = StepMeasurement([model], [torch.optim.SGD(model.parameters(), lr=0.1)])
    saved = pc._Saved(0, torch.ones(2), m)
    del saved  # not started: nothing recorded, nothing raised
    assert m._released == {}

    class Broken:
        def _let_go(self, owner: int, tensor: Any) -> None:
            raise RuntimeError("gone")

    escaped: list[Any] = []
    monkeypatch.setattr(sys, "unraisablehook", escaped.append)
    pc._Saved(0, torch.ones(1), Broken())  # type: ignore[arg-type]
    gc.collect()
    assert escaped == []  # its failure stays in __del__


def test_an_already_checkpointed_block_gets_no_hooks():
    model = Stack(3)
    model.layers[1].gradient_checkpointing = True
    m = StepMeasurement([model], [torch.optim.SGD(model.parameters(), lr=0.1)])
    m.start()
    try:
        assert len(model.layers[1]._forward_pre_hooks) == 0
        assert len(model.layers[0]._forward_pre_hooks) == 1 and len(model.layers[2]._forward_hooks) == 1
    finally:
        m.stop()
    assert all(len(b._forward_pre_hooks) == len(b._forward_hooks) == 0 for b in model.layers)


def test_the_module_imports_no_torch_until_asked():
    # the agent loads it into every job; torch is imported by what needs it, when it runs
    source = sys.modules[pc.__name__].__file__
    assert source is not None
    top = [line for line in open(source).read().splitlines() if line.startswith(("import ", "from "))]
    assert not any("torch" in line for line in top)
