"""The agent's side of the memory plan: arming by token, one step measured between two step
boundaries, busy and bad requests, refusal of what it cannot measure right."""

from __future__ import annotations

import json
import sys
import threading
import types
import weakref

import pytest
import torch

from dynprof.agent._mem_plan import MemoryPlanner
from dynprof.agent._server import CommandError
from dynprof.agent._steps import StepTracker
from dynprof.proto import pb


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(4, 16)
        self.b = torch.nn.Linear(16, 4)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


def setup(model):
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    steps = StepTracker()
    steps.hook_installed = True
    steps.optimizers = {id(opt): weakref.ref(opt)}
    agent = types.SimpleNamespace(steps=steps)
    return MemoryPlanner(agent), steps, opt


def hooks(model):
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())


def test_one_step_is_measured_between_two_boundaries_and_answered_by_token():
    # GIVEN a planner over a job's model and optimizer
    model = torch.nn.Sequential(Block(), Block(), Block())
    planner, steps, opt = setup(model)
    x = torch.randn(3, 4)

    def train_step():
        model(x).sum().backward()
        opt.step()
        opt.zero_grad()

    # WHEN a client arms it, another asks with another token, and the steps go by
    armed = planner.handle(pb.MemoryPlanRequest(token="a"))
    with pytest.raises(CommandError) as busy:
        planner.handle(pb.MemoryPlanRequest(token="b"))
    steps._notify(1)  # the boundary before the measured step
    during = (hooks(model), torch._C._autograd._top_saved_tensors_default_hooks(False) is not None)
    again = planner.handle(pb.MemoryPlanRequest(token="a"))
    train_step()
    steps._notify(2)  # the boundary after it
    done = planner.handle(pb.MemoryPlanRequest(token="a"))

    # THEN it was armed, the other was busy, hooks were there during the step only
    assert armed[1].status == "armed"
    assert busy.value.code == pb.BUSY
    assert during == (6, True) and again[1].status == "measuring"
    assert hooks(model) == 0 and torch._C._autograd._top_saved_tensors_default_hooks(False) is None
    assert steps._listeners == ()
    # AND the answer is the measurement: three blocks, each freeing the ReLU's output (3x16 floats)
    doc = json.loads(done[1].summary_json)
    assert done[1].status == "complete"
    assert [b["freeable_bytes"] for b in doc["blocks"]] == [3 * 16 * 4] * 3
    assert doc["model_scan_s"] > 0  # what finding the model cost, reported
    # AND it is kept for the advice of a later OOM
    assert planner.last_measurement == doc


def test_bad_tokens_and_unmeasurable_jobs_are_refused_with_the_reason():
    model = torch.nn.Sequential(Block(), Block())
    planner, steps, _opt = setup(model)
    for token in ("", "x" * 65, "a\nb"):
        with pytest.raises(CommandError) as bad:
            planner.handle(pb.MemoryPlanRequest(token=token))
        assert bad.value.code == pb.INVALID_ARGUMENT
    compiled = torch.compile(model)  # noqa: F841 (alive: the outermost module of the parameters)
    with pytest.raises(CommandError) as refused:
        planner.handle(pb.MemoryPlanRequest(token="c"))
    assert refused.value.code == pb.UNSUPPORTED and "torch.compile" in refused.value.message
    assert steps._listeners == ()


@pytest.mark.parametrize("deepspeed", [False, True])
def test_an_optimizer_over_tensors_no_module_holds_is_refused_and_deepspeed_named(monkeypatch, deepspeed):
    # GIVEN a job whose optimizer steps flat copies of the parameters (as DeepSpeed ZeRO 1-2 does)
    model = torch.nn.Sequential(Block(), Block())
    flat = torch.nn.Parameter(torch.cat([p.detach().flatten() for p in model.parameters()]))
    planner, steps, opt = setup(model)
    opt.param_groups[0]["params"] = [flat]
    if deepspeed:
        monkeypatch.setitem(sys.modules, "deepspeed", types.ModuleType("deepspeed"))
    else:
        monkeypatch.delitem(sys.modules, "deepspeed", raising=False)
    # WHEN a plan is asked; THEN it is refused, with DeepSpeed named where the process runs it
    with pytest.raises(CommandError) as refused:
        planner.handle(pb.MemoryPlanRequest(token="z"))
    assert refused.value.code == pb.UNSUPPORTED
    assert "no nn.Module holds the optimizers' parameters" in refused.value.message
    assert ("DeepSpeed, whose ZeRO optimizer steps flattened partitions" in refused.value.message) == deepspeed
    assert steps._listeners == ()


def test_the_measurement_starts_and_stops_on_the_thread_that_steps():
    # GIVEN an armed planner WHEN the boundaries come on another thread (the training thread)
    model = torch.nn.Sequential(Block(), Block())
    planner, steps, opt = setup(model)
    planner.handle(pb.MemoryPlanRequest(token="t"))

    def training():
        steps._notify(1)
        model(torch.randn(2, 4)).sum().backward()
        opt.step()
        steps._notify(2)

    t = threading.Thread(target=training)
    t.start()
    t.join(60)
    # THEN this thread never had the saved-tensor hooks, and the answer is complete
    assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None
    assert planner.handle(pb.MemoryPlanRequest(token="t"))[1].status == "complete"


@pytest.mark.parametrize("state", ["armed", "tracing"])
def test_a_memory_plan_is_refused_while_a_trace_is_armed_or_records(state):
    # GIVEN a job with a dynprof trace armed (or recording)
    model = torch.nn.Sequential(Block(), Block())
    planner, steps, _opt = setup(model)
    planner.agent.trace = types.SimpleNamespace(state=state)
    # WHEN a memory plan is asked for
    with pytest.raises(CommandError) as busy:
        planner.handle(pb.MemoryPlanRequest(token="a"))
    # THEN it is busy, saying why, and nothing is armed
    assert busy.value.code == pb.BUSY and f"a dynprof trace is {state}" in busy.value.message
    assert "each operator of that step twice" in busy.value.message and "dynprof stop" in busy.value.help
    assert planner.run is None and steps._listeners == ()
    # AND once the trace is written (exporting) or idle, the plan is armed
    planner.agent.trace.state = "exporting"
    assert planner.handle(pb.MemoryPlanRequest(token="a"))[1].status == "armed"


def test_a_measurement_armed_when_a_trace_arms_too_gives_way_at_its_step():
    # GIVEN a measurement armed, then a trace armed before the measured step came
    model = torch.nn.Sequential(Block(), Block())
    planner, steps, _opt = setup(model)
    planner.agent.trace = types.SimpleNamespace(state="idle")
    planner.handle(pb.MemoryPlanRequest(token="a"))
    planner.agent.trace.state = "armed"
    # WHEN the step boundary comes
    steps._notify(1)
    # THEN nothing was installed, and the answer says the trace went first
    assert hooks(model) == 0 and torch._C._autograd._top_saved_tensors_default_hooks(False) is None
    assert steps._listeners == ()
    done = planner.handle(pb.MemoryPlanRequest(token="a"))
    assert done[1].status == "failed" and "a dynprof trace is armed" in json.loads(done[1].summary_json)["error"]
