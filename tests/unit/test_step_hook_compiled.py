"""dynprof's optimizer step hook inside a ``torch.compile``d optimizer step: no graph break, no
skipped frame, no recompile, every compiled step counted, and its step boundary taken once,
when the compile wrapper has returned."""

from __future__ import annotations

import sys
import threading

import pytest

from dynprof.agent._steps import StepTracker

torch = pytest.importorskip("torch")


def _dynprof_breaks(counters: dict) -> list[str]:
    """Graph breaks and skipped frames whose reason names dynprof's hook."""
    reasons = [*counters["graph_break"], *counters["unimplemented"]]
    return [r for r in reasons if "dynprof" in r]


def test_compiled_optimizer_step_has_no_break_from_the_step_hook():
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    tracker = StepTracker()
    tracker.install()
    try:
        model = torch.nn.Linear(8, 8)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        for p in model.parameters():
            p.grad = torch.ones_like(p)

        @torch.compile
        def step() -> None:
            opt.step()

        # GIVEN the agent's step hook installed
        assert tracker.hook_installed
        # WHEN a compiled function steps the optimizer six times
        for _ in range(6):
            step()
        tracker.fold_compiled()

        # THEN no graph break or skipped frame comes from dynprof, no frame recompiled
        assert _dynprof_breaks(counters) == []
        assert counters["frames"]["total"] == counters["frames"]["ok"], dict(counters["frames"])
        assert not counters["recompiles"], dict(counters["recompiles"])
        # AND each compiled step is one step
        assert tracker.step == 6
        assert tracker.optimizer_steps == 0  # none of them ran the eager path
    finally:
        tracker.uninstall()
        torch._dynamo.reset()


def _compiled_loop(tracker: StepTracker, steps: int) -> tuple[list[tuple[int, object, object]], dict]:
    """Run ``steps`` iterations of a loop whose optimizer step is compiled, with a boundary
    listener that records (step, unsafe reason, the thread's profile function) at each."""
    from torch._dynamo.utils import counters

    from dynprof.agent._safety import unsafe_reason

    model = torch.nn.Linear(8, 8)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    x = torch.randn(4, 8)

    @torch.compile(backend="eager")
    def step() -> None:
        opt.step()

    seen: list[tuple[int, object, object]] = []
    tracker.add_listener(lambda n: seen.append((n, unsafe_reason(check_other_profiler=False), sys.getprofile())))
    for _ in range(steps):
        loss = model(x).sum()
        opt.zero_grad()
        loss.backward()
        step()
    return seen, {"recompiles": dict(counters["recompiles"]), "breaks": _dynprof_breaks(counters)}


def test_a_compiled_step_hands_each_boundary_out_of_the_compiled_region_once():
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    tracker = StepTracker()
    tracker.install()
    stop = threading.Event()

    def status_reader() -> None:  # what the status handler and the hang watchdog do meanwhile
        while not stop.is_set():
            tracker.fold_compiled()

    reader = threading.Thread(target=status_reader, daemon=True)
    reader.start()
    try:
        # GIVEN a listener (a trace armed) and a thread folding compiled steps meanwhile
        # WHEN 20 compiled optimizer steps run
        seen, dynamo = _compiled_loop(tracker, 20)
    finally:
        stop.set()
        reader.join()
        tracker.uninstall()
        torch._dynamo.reset()

    # THEN each step's boundary came once, with its own step number, when the compile wrapper
    # had returned: outside the compiled region, with no profile function left behind
    assert [n for n, _, _ in seen] == list(range(1, 21)), seen
    assert {reason for _, reason, _ in seen} == {None}, seen
    assert sys.getprofile() is None
    assert tracker.inexact_boundaries == 0
    assert tracker.step == 20
    # AND waiting for the wrapper cost no graph break and no recompile
    assert dynamo == {"recompiles": {}, "breaks": []}, dynamo


def test_a_compile_wrapper_that_holds_several_steps_is_not_waited_for():
    torch._dynamo.reset()
    tracker = StepTracker()
    tracker.install()
    model = torch.nn.Linear(8, 8)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(4, 8)

    def iteration() -> None:
        loss = model(x).sum()
        opt.zero_grad()
        loss.backward()
        opt.step()

    @torch.compile(backend="eager")
    def three_iterations() -> None:  # a compiled loop: Dynamo runs it eagerly, its callees compiled
        for _ in range(3):
            iteration()

    seen: list[int] = []
    tracker.add_listener(seen.append)
    try:
        # GIVEN a listener
        # WHEN a compiled function runs three compiled optimizer steps, twice
        three_iterations()
        three_iterations()
    finally:
        tracker.uninstall()
        torch._dynamo.reset()

    # THEN every step is counted, the boundaries come while the wrapper runs (not all at its
    # return), and the ones taken inside it or not taken are counted as inexact
    assert tracker.step == 6
    assert seen == [2, 3, 5, 6], seen
    assert tracker.inexact_boundaries == 6
    assert sys.getprofile() is None
