"""collectors.memory.plan.timing: each block's forward timed in the job's plain steps (the
plan's recompute cost), and the measurement's document built from those times."""

from __future__ import annotations

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from collectors.memory.plan.capture import measure_step
from collectors.memory.plan.timing import BlockTimer, on_cuda
from tests.unit._plan_models import Stack, step_of

pytestmark = pytest.mark.usefixtures("eager_process")


class FakeClock:
    """A clock that moves only when a block's inner layer runs: block ``i`` takes ``(i + 1)`` ms."""

    def __init__(self, model: Stack) -> None:
        self.now = 0.0
        for i, layer in enumerate(model.layers):
            layer.a.register_forward_pre_hook(lambda m, a, i=i: self.advance((i + 1) / 1000))

    def advance(self, s: float) -> None:
        self.now += s

    def __call__(self) -> float:
        return self.now


def blocks_of(model: Stack) -> list[tuple[str, torch.nn.Module]]:
    return [(f"layers.{i}", m) for i, m in enumerate(model.layers)]


def forward_hooks(model: torch.nn.Module) -> int:
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.layers)


def test_each_block_is_timed_per_call_over_complete_steps_only():
    # GIVEN three blocks, the first run twice a step, and a timer on them
    model = Stack(3, order=[0, 1, 0, 2])
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    clock = FakeClock(model)
    step = step_of(model, opt, torch.randn(2, 4))
    timer = BlockTimer(blocks_of(model), cuda=False, clock=clock)
    before = forward_hooks(model)
    # WHEN it times two steps, and a third begins but ends after the timer stops
    timer.start()
    for _ in range(2):
        step()
        timer.boundary()
    model(torch.randn(2, 4))
    timer.stop()
    # THEN each block's median per call is its own time; the unfinished step is not counted
    assert timer.steps == 2
    assert timer.per_call_s() == pytest.approx({"layers.0": 0.001, "layers.1": 0.002, "layers.2": 0.003})
    assert timer.timed_calls() == {"layers.0": 4, "layers.1": 2, "layers.2": 2}
    # AND its hooks are gone, and stopping again is harmless
    assert forward_hooks(model) == before
    timer.stop()
    assert timer.error == ""


def test_a_checkpoints_recompute_is_not_timed():
    # GIVEN a job that checkpoints its second block itself (its recompute runs in backward)
    model = Stack(3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    clock = FakeClock(model)
    x = torch.randn(2, 4)

    def step() -> None:
        h = model.layers[0](x)
        h = checkpoint(model.layers[1], h, use_reentrant=False)
        model.head(model.layers[2](h)).square().sum().backward()
        opt.step()
        opt.zero_grad()

    timer = BlockTimer(blocks_of(model), cuda=False, clock=clock)
    timer.start()
    for _ in range(3):
        step()
        timer.boundary()
    timer.stop()
    # THEN each block is timed once a step: the recompute in backward does not count
    assert timer.timed_calls() == {"layers.0": 3, "layers.1": 3, "layers.2": 3}
    assert timer.per_call_s()["layers.1"] == pytest.approx(0.002)
    assert timer.ended_early == ""


@pytest.mark.parametrize("mode", ["no_grad", "inference_mode", "past the time limit"])
def test_a_forward_that_shows_the_steps_are_not_coming_ends_the_timer(mode):
    # GIVEN a timer over a job that evaluates after its last step (or whose step outlasts the limit)
    model = Stack(2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    told = []
    timer = BlockTimer(
        blocks_of(model),
        cuda=False,
        clock=FakeClock(model),
        time_limit_s=0.0 if mode == "past the time limit" else None,
        on_end=told.append,
    )
    timer.start()
    if mode == "past the time limit":
        step_of(model, opt, torch.randn(2, 4))()
    else:
        with torch.no_grad() if mode == "no_grad" else torch.inference_mode():
            model(torch.randn(2, 4))
    # THEN it ended itself at the first block forward, its hooks off, and said why
    assert forward_hooks(model) == 0 and not timer.active
    assert len(told) == 1 and told[0] == timer.ended_early
    assert ("without grad" in told[0]) == (mode != "past the time limit")
    assert timer.per_call_s() == {}


def test_a_failing_clock_is_reported_and_the_step_runs_on():
    model = Stack(2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def broken() -> float:
        raise RuntimeError("no clock")

    timer = BlockTimer(blocks_of(model), cuda=False, clock=broken)
    timer.start()
    step_of(model, opt, torch.randn(2, 4))()
    timer.boundary()
    timer.stop()
    assert "no clock" in timer.error and timer.per_call_s() == {}


def test_an_inactive_timer_passes_everything_through():
    # a timer another thread turned off (the plan dropped) times nothing until its hooks come off
    model = Stack(2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    timer = BlockTimer(blocks_of(model), cuda=False, clock=FakeClock(model))
    timer.start()
    timer.active = False
    step_of(model, opt, torch.randn(2, 4))()
    timer.boundary()
    assert timer.steps == 0 and timer.timed_calls() == {"layers.0": 0, "layers.1": 0}
    timer.stop()
    assert forward_hooks(model) == 0


def test_the_measurement_takes_its_forward_times_from_the_timed_steps():
    # GIVEN a clock that ticks once per read, so a plain forward is one tick and a measured one
    # many (the measurement's own hooks read the clock too)
    ticks = iter(range(10**9))

    def clock() -> float:
        return float(next(ticks))

    model = Stack(3, order=[0, 1, 0, 2])
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    step = step_of(model, opt, torch.randn(2, 4))
    plain = measure_step(model, opt, step, clock=clock)
    # WHEN the blocks are timed over 2 plain steps before the measured one
    doc = measure_step(model, opt, step, clock=clock, timed_steps=2)
    # THEN each block's forward is one tick per call, its recompute the same share of it as in
    # the measured step, and the measured step's own forward is kept beside it
    assert plain["timed_steps"] == 0 and doc["timed_steps"] == 2
    for b in doc["blocks"]:
        assert b["forward_s"] == pytest.approx(1.0 * b["calls"]), b
        assert b["measured_forward_s"] > b["forward_s"]
        assert 0 < b["recompute_s"] <= b["forward_s"]
    # AND the measurement document survives its codec with the count of timed steps
    from collectors.memory.plan.measurement import from_json

    assert from_json(doc).timed_steps == 2


def test_on_cuda_reads_the_blocks_parameters():
    model = Stack(2)
    assert on_cuda(blocks_of(model)) is False
    assert on_cuda([("empty", torch.nn.ReLU())]) is False


def test_a_timer_that_failed_in_part_leaves_a_note_and_the_measured_times():
    # GIVEN a measurement whose plain steps were timed by a clock that fails
    model = Stack(2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    calls = iter(range(10**9))

    def clock() -> float:
        n = next(calls)
        if n < 2:  # the timer's two reads (its pre-hooks, 2 blocks, one step): both fail
            raise RuntimeError("no clock")
        return float(n)

    # WHEN the step is measured after one timed step
    doc = measure_step(model, opt, step_of(model, opt, torch.randn(2, 4)), clock=clock, timed_steps=1)
    # THEN the blocks keep the measured step's own times, and a note says why
    assert doc["timed_steps"] == 0
    measured = [b["measured_forward_s"] for b in doc["blocks"]]  # equal blocks share their median
    assert all(b["forward_s"] == pytest.approx(sum(measured) / 2) for b in doc["blocks"])
    assert any(
        "timing the blocks' forward in plain steps failed in part (forward pre-hook: no clock)" in n
        for n in doc["notes"]
    )
