"""Plain PyTorch loops that real jobs use: activation checkpointing, optimizer-in-backward,
a job with its own profiler, an optimizer re-created mid-run, autocast with GradScaler."""

from __future__ import annotations

import pytest
from _checks import FrameworkChecks
from _scenario import Case, Scenario

pytestmark = [pytest.mark.frameworks, pytest.mark.timeout(600)]


class TestTorchLoops(FrameworkChecks):
    CASES = [
        Case("checkpoint", "checkpoint_program.py", ("--step-sleep", "0.002")),
        Case("checkpoint_reentrant", "checkpoint_program.py", ("--reentrant", "--step-sleep", "0.002"), ci=False),
        Case("opt_in_backward", "opt_in_backward_program.py", ("--step-sleep", "0.002")),
        Case(
            "reoptimizer",
            "reoptimizer_program.py",
            ("--stage-steps", "200", "--step-sleep", "0.03"),
            plain_steps=230,
            wait_for="STAGE 2",
        ),
        Case("autocast_gradscaler", "amp_program.py", ("--step-sleep", "0.005")),
    ]


class TestOwnProfiler(FrameworkChecks):
    CASES = [Case("own_profiler", "own_profiler_program.py", ("--step-sleep", "0.005"), own_profiler=True)]

    def test_the_jobs_own_profiler_keeps_working(self, scenario: Scenario) -> None:
        # GIVEN a job that profiles itself in 3-step windows and reports each trace it receives
        def own(lines: list[str]) -> list[str]:
            return [line for line in lines if line.startswith("OWN_TRACE ")]

        # (the last one, flushed when the job leaves its `with profile(...)` block, may be shorter)
        plain, traced = own(scenario.plain.lines)[:-1], own(scenario.traced.lines)[:-1]
        assert plain and all(line.endswith(" steps 3") for line in plain), plain
        # THEN under dynprof it received at least as many traces, each still of its own 3 steps
        assert len(traced) >= len(plain), (len(traced), len(plain))
        assert all(line.endswith(" steps 3") for line in traced), [x for x in traced if not x.endswith(" steps 3")]
