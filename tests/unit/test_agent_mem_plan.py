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

from collectors.memory.plan.timing import TIMED_STEPS
from dynprof.agent._mem_plan import ARMED_FOR_S, MemoryPlanner
from dynprof.agent._server import CommandError
from dynprof.agent._steps import StepTracker
from dynprof.proto import pb

pytestmark = pytest.mark.usefixtures("eager_process")


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(4, 16)
        self.b = torch.nn.Linear(16, 4)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


def setup(model, timed=False):
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    steps = StepTracker()
    steps.hook_installed = True
    steps.optimizers = {id(opt): weakref.ref(opt)}
    agent = types.SimpleNamespace(steps=steps)
    planner = MemoryPlanner(agent)
    if not timed:
        planner.timed_steps = 0  # the measured step right after the arming boundary
    return planner, steps, opt


def stepping_job():
    """Three blocks, their planner and step tracker, and a training step over them."""
    model = torch.nn.Sequential(Block(), Block(), Block())
    planner, steps, opt = setup(model, timed=True)
    x = torch.randn(3, 4)

    def train_step():
        model(x).sum().backward()
        opt.step()
        opt.zero_grad()

    return model, planner, steps, train_step


def hooks(model):
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())


def test_the_blocks_are_timed_in_plain_steps_then_one_step_is_measured_and_answered_by_token():
    # GIVEN a planner over a job's model and optimizer
    model, planner, steps, train_step = stepping_job()
    # WHEN a client arms it, another asks with another token, and the steps go by
    armed = planner.handle(pb.MemoryPlanRequest(token="a"))
    with pytest.raises(CommandError) as busy:
        planner.handle(pb.MemoryPlanRequest(token="b"))
    steps._notify(1)  # the boundary before the timed steps
    timing = (hooks(model), torch._C._autograd._top_saved_tensors_default_hooks(False) is not None)
    for n in range(TIMED_STEPS):
        train_step()
        steps._notify(2 + n)
    # the boundary before the measured step is behind
    during = (hooks(model), torch._C._autograd._top_saved_tensors_default_hooks(False) is not None)
    again = planner.handle(pb.MemoryPlanRequest(token="a"))
    train_step()
    steps._notify(2 + TIMED_STEPS)  # the boundary after it
    done = planner.handle(pb.MemoryPlanRequest(token="a"))

    # THEN it was armed, the other was busy; the timed steps had the timer's two hooks per block
    # and no saved-tensor hook, the measured step the measurement's; none is left after
    assert armed[1].status == "armed"
    assert busy.value.code == pb.BUSY
    assert timing == (6, False)
    assert during == (6, True) and again[1].status == "measuring"
    assert hooks(model) == 0 and torch._C._autograd._top_saved_tensors_default_hooks(False) is None
    assert steps._listeners == ()
    # AND the answer is the measurement: three blocks, each freeing the ReLU's output (3x16 floats),
    # each block's forward timed in the plain steps
    doc = json.loads(done[1].summary_json)
    assert done[1].status == "complete"
    assert [b["freeable_bytes"] for b in doc["blocks"]] == [3 * 16 * 4] * 3
    assert doc["timed_steps"] == TIMED_STEPS
    assert all(b["forward_s"] > 0 and b["recompute_s"] <= b["forward_s"] for b in doc["blocks"])
    assert doc["model_scan_s"] > 0  # what finding the model cost, reported
    # AND it is kept for the advice of a later OOM
    assert planner.last_measurement == doc


def test_a_run_dropped_while_timing_has_its_hooks_taken_off_at_the_next_boundary(monkeypatch):
    # GIVEN a run timing the blocks whose steps stopped coming (an evaluation, a paused job)
    model, planner, steps, train_step = stepping_job()
    planner.handle(pb.MemoryPlanRequest(token="a"))
    steps._notify(1)
    assert hooks(model) == 6
    # WHEN a new request comes after the armed time is over (the server thread)
    monkeypatch.setattr(planner.run, "armed_at", planner.run.armed_at - ARMED_FOR_S - 1)
    armed = planner.handle(pb.MemoryPlanRequest(token="b"))
    # THEN the new run is armed; the old timer's hooks stay (only the training thread may take
    # them off) but pass everything through, and come off at the next boundary
    assert armed[1].status == "armed" and hooks(model) == 6
    train_step()
    steps._notify(2)
    assert hooks(model) == 6  # the new run's timer, the old one's gone
    assert planner.run.token == "b" and planner.run.state == "timing"
    for n in range(TIMED_STEPS + 1):
        train_step()
        steps._notify(3 + n)
    assert json.loads(planner.handle(pb.MemoryPlanRequest(token="b"))[1].summary_json)["timed_steps"] == TIMED_STEPS
    assert hooks(model) == 0 and steps._listeners == ()


def test_bad_tokens_and_unmeasurable_jobs_are_refused_with_the_reason():
    model = torch.nn.Sequential(Block(), Block())
    planner, steps, _opt = setup(model)
    for token in ("", "x" * 65, "a\nb"):
        with pytest.raises(CommandError) as bad:
            planner.handle(pb.MemoryPlanRequest(token=token))
        assert bad.value.code == pb.INVALID_ARGUMENT
    compiled = torch.compile(model)  # noqa: F841 (alive: the outermost module of the parameters)
    # the request is taken (the server thread reads nothing of the job) ...
    assert planner.handle(pb.MemoryPlanRequest(token="c"))[1].status == "armed"
    # ... and refused at the step boundary, where the training thread looks at the model
    steps._notify(1)
    with pytest.raises(CommandError) as refused:
        planner.handle(pb.MemoryPlanRequest(token="c"))
    assert refused.value.code == pb.UNSUPPORTED and "torch.compile" in refused.value.message
    assert "TORCHDYNAMO_DISABLE=1" in refused.value.help
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
    # WHEN a plan is asked and the next step boundary comes; THEN it is refused, with DeepSpeed
    # named where the process runs it
    planner.handle(pb.MemoryPlanRequest(token="z"))
    steps._notify(1)
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


def _torch_calls_of(fn):
    """Run ``fn`` on a thread of its own (as the agent's server thread runs a handler) and
    return every call it made into torch: Python functions in torch's files, and C functions
    or methods of torch's (a tensor's, a module's, an optimizer's)."""
    seen: list[str] = []
    out: list[object] = []

    def profile(frame, event, arg):
        if event == "call" and "/torch/" in frame.f_code.co_filename:
            seen.append(f"{frame.f_code.co_name} ({frame.f_code.co_filename})")
        elif event == "c_call":
            owner = getattr(arg, "__self__", None)
            module = str(getattr(arg, "__module__", None) or getattr(type(owner), "__module__", "") or "")
            if module.startswith("torch") or isinstance(owner, (torch.Tensor, torch.nn.Module, torch.optim.Optimizer)):
                seen.append(f"{getattr(arg, '__qualname__', arg)}")

    def run():
        sys.setprofile(profile)
        try:
            out.append(fn())
        except BaseException as exc:  # the caller checks
            out.append(exc)
        finally:
            sys.setprofile(None)

    t = threading.Thread(target=run)
    t.start()
    t.join(120)
    return seen, out[0] if out else None


def test_the_server_thread_never_touches_the_jobs_torch_objects():
    # GIVEN a job's model and optimizer, and a planner whose requests come on another thread
    # (the agent's server thread), while this thread (the training thread) steps
    _model, planner, steps, train_step = stepping_job()
    # WHEN a plan is armed, measured over one step and answered, each request on its own thread
    calls, armed = _torch_calls_of(lambda: planner.handle(pb.MemoryPlanRequest(token="s")))
    for n in range(1, TIMED_STEPS + 2):  # the blocks timed over plain steps, then one measured
        steps._notify(n)
        train_step()
    steps._notify(TIMED_STEPS + 2)
    calls2, done = _torch_calls_of(lambda: planner.handle(pb.MemoryPlanRequest(token="s")))

    # THEN the answer is the whole measurement, and the requests' thread called nothing of torch
    assert armed[1].status == "armed" and done[1].status == "complete", done
    assert len(json.loads(done[1].summary_json)["blocks"]) == 3
    assert calls == [] and calls2 == [], (calls, calls2)
    # AND the planner holds no reference to the job's model or optimizer once answered
    assert planner.run.measurement is None and planner.run.timer is None


def test_a_refusal_is_found_on_the_training_thread_and_told_to_the_next_request():
    # GIVEN a model compiled in place, and a plan armed from another thread
    model = torch.nn.Sequential(Block(), Block())
    model.compile()
    planner, steps, _opt = setup(model)
    calls, armed = _torch_calls_of(lambda: planner.handle(pb.MemoryPlanRequest(token="r")))
    # WHEN the step boundary comes (the training thread looks at the model) and the client asks
    steps._notify(1)
    calls2, refused = _torch_calls_of(lambda: planner.handle(pb.MemoryPlanRequest(token="r")))
    # THEN the refusal names torch.compile, nothing of torch was called off the training thread
    assert armed[1].status == "armed"
    assert isinstance(refused, CommandError) and refused.code == pb.UNSUPPORTED
    assert "compiled with torch.compile" in refused.message
    assert calls == [] and calls2 == []
    assert steps._listeners == ()


def test_an_evaluation_after_the_last_step_ends_the_measurement_and_the_client_is_told():
    # GIVEN a plan armed and begun at the job's last step boundary
    model = torch.nn.Sequential(Block(), Block())
    planner, steps, _opt = setup(model)
    planner.handle(pb.MemoryPlanRequest(token="e"))
    steps._notify(1)
    assert planner.handle(pb.MemoryPlanRequest(token="e"))[1].status == "measuring"
    # WHEN the job evaluates instead of stepping again
    with torch.no_grad():
        for _ in range(5):
            model(torch.randn(2, 4))
    reply = planner.handle(pb.MemoryPlanRequest(token="e"))[1]
    # THEN the measurement is over, removed, and the answer says why
    assert reply.status == "failed"
    doc = json.loads(reply.summary_json)
    assert "a forward ran without grad" in doc["error"] and "evaluation" in doc["help"]
    assert hooks(model) == 0 and torch._C._autograd._top_saved_tensors_default_hooks(False) is None
    assert steps._listeners == ()


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
