"""`dynprof run --checkpoint` in the agent: an early step measured, the plan's blocks wrapped
at a step boundary, the next step's peak and time checked, the wrappers taken back on request,
and a job that did not ask never changed."""

from __future__ import annotations

import os
import time
import types
import weakref

import pytest
import torch

from dynprof.agent._mem_apply import FINAL, CheckpointApplier, install
from dynprof.agent._steps import StepTracker
from tests.support.plan_models import Model

pytestmark = pytest.mark.usefixtures("eager_process")


def job(seed: int = 0):
    torch.manual_seed(seed)
    model = Model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    x = torch.randn(512, 16)
    y = torch.randn(512, 1)

    def step() -> float:
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        return float(loss.item())

    return model, opt, step


def fake_agent(opt):
    steps = StepTracker()
    steps.hook_installed = True
    steps.optimizers = {id(opt): weakref.ref(opt)}
    ident = types.SimpleNamespace(job_id="job", host="host", rank=None)
    return types.SimpleNamespace(steps=steps, memory=None, trace=None, identity=ident, pid=os.getpid())


def wrapped(model) -> list[str]:
    return [n for n, m in model.named_modules() if "forward" in m.__dict__]


@pytest.fixture(autouse=True)
def short_phases(monkeypatch):
    """The state machine's phases as short as they go (the step counts below are written for
    them): measured after the 3rd boundary, 3 timed steps."""
    import dynprof.agent._mem_apply as apply

    monkeypatch.setattr(apply, "WARMUP_BOUNDARIES", 3)
    monkeypatch.setattr(apply, "TIMED_STEPS", 3)
    monkeypatch.setattr(apply, "BASELINE_SKIP", 0)


def train(applier, steps, step, n: int, on_step=None) -> list[float]:
    """``n`` steps, each followed by its boundary; a plan made on the agent's thread is waited for."""
    losses = []
    for i in range(1, n + 1):
        losses.append(step())
        steps._notify(i)
        deadline = time.monotonic() + 30
        while applier.state == "planning" and time.monotonic() < deadline:
            time.sleep(0.01)
        if on_step is not None:
            on_step(i)
    return losses


def test_the_plan_is_applied_verified_and_the_losses_are_bit_identical():
    # GIVEN the same deterministic CPU loop twice, once plain and once with --checkpoint 70%
    torch.use_deterministic_algorithms(True)
    try:
        _m, _o, plain_step = job()
        plain = [plain_step() for _ in range(14)]
        model, opt, step = job()
        agent = fake_agent(opt)
        applier = CheckpointApplier(agent, "80%")
        applier.start()
        seen: dict[int, list[str]] = {}

        # WHEN it trains 14 steps, each followed by its step boundary
        losses = train(applier, agent.steps, step, 14, on_step=lambda i: seen.setdefault(i, wrapped(model)))
    finally:
        torch.use_deterministic_algorithms(False)

    # THEN the plan was applied, its verified peak is under the budget and near the prediction
    s = applier.status()
    assert s["state"] == "applied", s
    assert s["modules"] and all(name.startswith("blocks.") for name in s["modules"])
    assert s["verified_peak_bytes"] <= s["budget_bytes"] < s["measured_peak_bytes"]
    assert s["verified_peak_bytes"] == s["predicted_peak_bytes"]  # the CPU meter: to the byte
    assert s["verified_step_s"] > 0 and s["predicted_step_s"] > 0 and s["rounds"] == 0
    # AND the blocks were wrapped from a step boundary after the measured step, not before
    assert seen[3] == [] and wrapped(model) == s["modules"]
    # AND the status names the first step that ran with them (the steps are counted from 0 and
    # seen[i] is the state after the i-th step's boundary, before step i runs)
    assert s["wrapped_from_step"] == min(i for i, names in seen.items() if names), seen
    # AND the job's losses are those of the plain run, bit for bit
    assert [x.hex() for x in losses] == [x.hex() for x in plain]
    # AND the listener is off once it is verified
    assert agent.steps._listeners == ()


def test_undo_takes_every_wrapper_back_at_the_next_boundary():
    # GIVEN a job whose plan is applied
    model, opt, step = job()
    agent = fake_agent(opt)
    applier = CheckpointApplier(agent, "80%")
    applier.start()
    train(applier, agent.steps, step, 14)
    assert applier.state == "applied" and wrapped(model)

    # WHEN the undo is asked (the server thread) and the job makes one more step
    asked = applier.request_undo()
    before = wrapped(model)
    train(applier, agent.steps, step, 1)

    # THEN the wrappers were there until the boundary and are gone after it
    assert asked == "pending" and before
    assert wrapped(model) == [] and applier.state == "undone"
    assert applier.request_undo() == "undone"
    assert all(m.forward.__func__ is type(m).forward for m in model.modules())


def test_a_budget_recomputation_cannot_reach_leaves_the_job_as_it_was():
    # GIVEN a budget under the floor (parameters and optimizer state alone exceed it)
    model, opt, step = job()
    agent = fake_agent(opt)
    applier = CheckpointApplier(agent, "5%")
    applier.start()

    # WHEN it trains
    train(applier, agent.steps, step, 8)

    # THEN it says so, with the floor, and wraps nothing
    s = applier.status()
    assert s["state"] == "unreachable" and "no set of blocks" in s["detail"] and s["floor_bytes"] > s["budget_bytes"]
    assert wrapped(model) == [] and applier.request_undo() == "nothing"


def test_a_budget_over_the_peak_wraps_nothing():
    model, opt, step = job()
    agent = fake_agent(opt)
    applier = CheckpointApplier(agent, "1G")
    applier.start()
    train(applier, agent.steps, step, 6)
    assert applier.state == "fits-already" and "nothing is wrapped" in applier.detail
    assert wrapped(model) == []


def test_a_block_already_checkpointed_by_the_job_is_refused_in_words():
    # GIVEN a job that wraps its blocks in torch.utils.checkpoint itself (the plan's own recipe)
    import torch.utils.checkpoint as cp

    model, opt, step = job()
    for b in model.blocks:
        fwd = b.forward
        b.forward = lambda *a, _f=fwd, **k: cp.checkpoint(_f, *a, use_reentrant=False, **k)
    agent = fake_agent(opt)
    applier = CheckpointApplier(agent, "80%")
    applier.start()

    # WHEN it trains
    train(applier, agent.steps, step, 10)

    # THEN nothing of dynprof's is wrapped around them, and the reason is said
    s = applier.status()
    if s["state"] == "refused":
        assert "already checkpointed" in s["detail"], s
    else:  # the measurement saw them as checkpointed: they were no candidates
        assert s["state"] in ("unreachable", "fits-already"), s
    assert not any(getattr(b.forward, "__dynprof_checkpoint__", False) for b in model.blocks)


def test_a_model_the_agent_cannot_see_is_refused():
    # GIVEN an optimizer over a bare tensor, held by no nn.Module
    w = torch.nn.Parameter(torch.randn(8, 8))
    opt = torch.optim.SGD([w], lr=0.1)
    agent = fake_agent(opt)
    applier = CheckpointApplier(agent, "80%")
    applier.start()

    # WHEN it steps
    for i in range(1, 5):
        (w @ w).sum().backward()
        opt.step()
        agent.steps._notify(i)

    # THEN it is refused in words
    assert applier.state == "refused" and "cannot be seen" in applier.detail


def test_a_job_that_did_not_ask_is_never_changed():
    # GIVEN no DYNPROF_CHECKPOINT, an empty one, off, or a bad one
    model, opt, step = job()
    agent = fake_agent(opt)

    # WHEN the agent installs
    got = [install(agent, env) for env in ({}, {"DYNPROF_CHECKPOINT": ""}, {"DYNPROF_CHECKPOINT": "off"})]
    bad = install(agent, {"DYNPROF_CHECKPOINT": "lots"})
    for i in range(1, 8):
        step()
        agent.steps._notify(i)

    # THEN there is no applier and no listener, and nothing is wrapped
    assert got == [None, None, None] and bad is None
    assert agent.steps._listeners == () and wrapped(model) == []


def test_final_states_stop_listening():
    assert set(FINAL) >= {"applied", "undone", "refused", "unreachable"}


def test_the_baseline_step_time_leaves_out_the_jobs_first_steps(monkeypatch):
    # GIVEN a job whose first two steps are slow (kernels chosen, a framework's first-step work)
    import dynprof.agent._mem_apply as apply

    monkeypatch.setattr(apply, "WARMUP_BOUNDARIES", 8)
    monkeypatch.setattr(apply, "BASELINE_SKIP", 2)
    _model, opt, _step = job()
    agent = fake_agent(opt)
    applier = CheckpointApplier(agent, "80%")
    applier.start()
    import itertools

    # 5 s and 4 s, then 0.1 s steps (and a clock that goes on for whatever else reads it)
    clock = itertools.chain([0.0, 5.0, 9.0, 9.1, 9.2, 9.3, 9.4, 9.5], itertools.count(9.6, 0.1))
    monkeypatch.setattr(apply.time, "perf_counter", lambda: next(clock))
    # WHEN the 8 boundaries before the measured step go by
    for i in range(1, 9):
        agent.steps._notify(i)
    # THEN the baseline is the job's steady step, not its first ones
    try:
        assert applier.state == "measuring"
        assert applier.baseline_step_s == pytest.approx(0.1)
    finally:
        applier.at_exit()  # the measured step never runs here: its hooks come off
    assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None
