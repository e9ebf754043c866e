"""dynprof's optimizer step hook inside a ``torch.compile``d optimizer step: no graph break, no
skipped frame, no recompile, and every compiled step counted."""

from __future__ import annotations

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
