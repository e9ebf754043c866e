"""The checks every framework loop must pass under dynprof (inherited by each test class)."""

from __future__ import annotations

import itertools
import json
import math
from datetime import datetime
from pathlib import Path
from typing import Any

from _scenario import DURATION_S, HANG_TIMEOUT_S, STEP_TRACE_STEPS, Case, Outcome, Scenario, normalize, read_trace

# Stopping a profiler pauses the training thread while torch collects what was recorded: the
# pause grows with the events recorded, in both modes. How long it is on a given machine is a
# figure for scripts/bench_agent.py (`--trace-pause`), not a bound here: a loaded machine
# stretches any pause. What the tests check instead cannot move with the load: a duration-mode
# trace records no more events per step than the step-mode trace of the same job (at most
# EVENTS_PER_STEP_FACTOR times as many), so its stop costs what step mode's costs.
EVENTS_PER_STEP_FACTOR = 2.0
# Two clocks measure one interval (time.time() in the agent, the profiler's clock in the trace),
# and created_at is written to the millisecond: the tolerance of comparing them.
CLOCK_TOLERANCE_S = 0.005
CRASH_MARKERS = ("Segmentation fault", "Fatal Python error", "core dumped", "Aborted")


def _steps(trace: dict[str, Any]) -> list[dict[str, Any]]:
    steps = [
        e
        for e in trace.get("traceEvents", [])
        if e.get("ph") == "X"
        and str(e.get("name", "")).startswith("ProfilerStep#")
        and e.get("cat") != "gpu_user_annotation"  # the GPU-timeline copy of each step
    ]
    return sorted(steps, key=lambda e: e.get("ts", 0))


def _events(trace: dict[str, Any]) -> int:
    """How many complete events (operators, annotations, kernels) a trace holds."""
    return sum(1 for e in trace.get("traceEvents", []) if e.get("ph") == "X")


def _reported_pause(summary: dict[str, Any]) -> bool:
    """The manifest reports the training thread's stop pause, as a real number of milliseconds."""
    pause = summary.get("training_thread_pause_ms")
    return isinstance(pause, int | float) and math.isfinite(pause) and pause >= 0


def _clear_refusal(outcome: Outcome) -> bool:
    """The CLI refused with an error a person can act on: non-zero exit, no traceback, names the profiler."""
    proc = outcome.proc
    return (
        proc is not None
        and proc.returncode not in (0, 1)
        and "Traceback" not in proc.stderr
        and "profiler" in proc.stderr.lower()
    )


def _names_the_jobs_profiler(text: str) -> bool:
    text = text.lower()
    return "profiler" in text and ("by the job" in text or "job started its own" in text or "job's own" in text)


def yielded_to_the_jobs_profiler(outcome: Outcome) -> bool:
    """dynprof stood back for a job's own profiler, and said so: refused outright, or every
    process's trace ended (failed or partial) with a reason that names the job's profiler."""
    if _clear_refusal(outcome):
        return True
    proc = outcome.proc
    if proc is None or "Traceback" in proc.stderr:
        return False
    try:
        results = json.loads(proc.stdout)["results"]
    except (ValueError, KeyError, TypeError):
        return False
    for res in results:
        if res.get("status") == "complete":
            return False
        stopped_by = ""
        if res.get("artifact"):
            manifest = json.loads((Path(res["artifact"]) / "manifest.json").read_text())
            stopped_by = str((manifest.get("summary") or {}).get("stopped_by"))
        if stopped_by != "job-profiler" and not _names_the_jobs_profiler(str(res.get("error") or "")):
            return False
    return bool(results)


def _agents(outcome: Outcome | None, pids: list[int]) -> list[dict[str, Any]]:
    assert outcome is not None and outcome.ok, outcome.describe() if outcome else "ps not run"
    rows = {row["pid"]: row for row in outcome.json()["agents"]}
    missing = [pid for pid in pids if pid not in rows]
    assert not missing, f"no agent listed for pid {missing}: {sorted(rows)}"
    return [rows[pid] for pid in pids]


class FrameworkChecks:
    CASES: list[Case] = []

    def test_job_exits_cleanly_and_is_not_killed_by_a_signal(self, scenario: Scenario) -> None:
        # GIVEN the job, run once plain and once under dynprof with every capture taken
        plain, traced = scenario.plain, scenario.traced
        # THEN both ran to their end and exited 0 (a negative code is the signal that killed it)
        assert plain.returncode == 0, f"plain run: exit {plain.returncode} {plain.error}\n{plain.tail()}"
        assert traced.returncode == 0, f"under dynprof: exit {traced.returncode} {traced.error}\n{traced.tail()}"
        crashed = [line for line in traced.lines if any(m in line for m in CRASH_MARKERS)]
        assert not crashed, crashed

    def test_step_trace_has_exactly_the_requested_steps(self, scenario: Scenario) -> None:
        # WHEN `dynprof start --steps 3` traced the running job
        outcome = scenario.step_trace
        assert outcome is not None, "not attempted: " + scenario.traced.error
        if scenario.case.own_profiler and yielded_to_the_jobs_profiler(outcome):
            return  # dynprof may stand back for a job's own profiler (clearly said), never crash it
        # THEN each process wrote a complete trace of exactly three consecutive ProfilerSteps
        for res, manifest in scenario.artifacts(outcome):
            assert res["status"] == "complete" and manifest["status"] == "complete", (res, manifest.get("error"))
            numbers = [
                int(s["name"].split("#")[1]) for s in _steps(read_trace(Path(res["artifact"]) / "trace.json.gz"))
            ]
            assert numbers and numbers == list(range(numbers[0], numbers[0] + STEP_TRACE_STEPS)), numbers
            assert manifest["summary"]["steps_captured"] == STEP_TRACE_STEPS

    def test_step_trace_optimizer_spans_nest_in_profiler_steps(self, scenario: Scenario) -> None:
        outcome = scenario.step_trace
        assert outcome is not None, "not attempted: " + scenario.traced.error
        if scenario.case.own_profiler and yielded_to_the_jobs_profiler(outcome):
            return
        for res, _ in scenario.artifacts(outcome):
            trace = read_trace(Path(res["artifact"]) / "trace.json.gz")
            steps = _steps(trace)
            spans = [
                e
                for e in trace["traceEvents"]
                if e.get("ph") == "X" and str(e.get("name", "")).startswith("Optimizer.step#")
            ]
            # THEN no optimizer step span crosses a ProfilerStep boundary
            crossing = []
            for span in spans:
                begin, end = span["ts"], span["ts"] + span.get("dur", 0)
                for step in steps:
                    s_begin, s_end = step["ts"], step["ts"] + step.get("dur", 0)
                    if begin < s_end and end > s_begin and not (s_begin <= begin and end <= s_end):
                        crossing.append((span["name"], step["name"]))
            assert not crossing, f"{len(crossing)} Optimizer.step spans cross a ProfilerStep: {crossing[:5]}"

    def test_duration_trace_is_complete(self, scenario: Scenario) -> None:
        # WHEN `dynprof start --duration 1` traced the running job
        outcome = scenario.duration_trace
        assert outcome is not None, "not attempted: " + scenario.traced.error
        if scenario.case.own_profiler and yielded_to_the_jobs_profiler(outcome):
            return
        # THEN each process wrote a complete trace of the job's operators, ended by its duration
        for res, manifest in scenario.artifacts(outcome):
            assert res["status"] == "complete" and manifest["status"] == "complete", (res, manifest.get("error"))
            assert manifest["summary"]["stopped_by"] == "duration"
            trace = read_trace(Path(res["artifact"]) / "trace.json.gz")
            assert any(str(e.get("name", "")).startswith("aten::") for e in trace["traceEvents"])

    def test_duration_trace_honours_the_request_and_pauses_as_step_mode_does(self, scenario: Scenario) -> None:
        outcome = scenario.duration_trace
        assert outcome is not None, "not attempted: " + scenario.traced.error
        if scenario.case.own_profiler and yielded_to_the_jobs_profiler(outcome):
            return
        per_step_events = []
        if scenario.step_trace is not None and not yielded_to_the_jobs_profiler(scenario.step_trace):
            for res, manifest in scenario.artifacts(scenario.step_trace):
                s = manifest.get("summary", {})
                assert _reported_pause(s), s
                trace = read_trace(Path(res["artifact"]) / "trace.json.gz")
                per_step_events.append(_events(trace) / max(1, s["steps_captured"]))
        for res, manifest in scenario.artifacts(outcome):
            summary = manifest.get("summary", {})
            # THEN at least about the requested second was profiled (never less)
            assert summary["profiled_s"] >= DURATION_S * 0.9, summary
            # and it stopped at the first safe point after that: the wait for it lies within the
            # step it fell in, the last ProfilerStep of the trace (however long a loaded machine
            # made that step)
            trace = read_trace(Path(res["artifact"]) / "trace.json.gz")
            steps = _steps(trace)
            if summary.get("steps_captured"):
                assert steps, "no ProfilerStep in a trace that captured steps"
                last_step_s = steps[-1].get("dur", 0) / 1e6
                assert summary["stop_waited_s"] <= last_step_s + CLOCK_TOLERANCE_S, (summary, steps[-1])
            # and the stop pause is not counted in profiled_s: the profiled window ended before
            # the pause, which ended before the export created the artifact
            assert _reported_pause(summary), summary
            created = datetime.fromisoformat(manifest["created_at"].replace("Z", "+00:00")).timestamp()
            paused_until = summary["profiled_until"] + summary["training_thread_pause_ms"] / 1000
            assert paused_until <= created + 0.001 + CLOCK_TOLERANCE_S, (summary, manifest["created_at"])
            # and it recorded no more per step than the step-mode trace did (what the stop pause
            # grows with): it paused training as step mode does
            steps_captured = max(1, summary.get("steps_captured") or 0)
            if per_step_events:
                allowed = EVENTS_PER_STEP_FACTOR * max(per_step_events)
                assert _events(trace) / steps_captured <= allowed, (summary, per_step_events)

    def test_stacks_name_a_frame_of_the_program(self, scenario: Scenario) -> None:
        # WHEN `dynprof stacks --pid P --full` read the training job
        outcome = scenario.stacks
        assert outcome is not None and outcome.ok, outcome.describe() if outcome else scenario.traced.error
        # THEN the dump shows the program's own code
        assert scenario.case.program in outcome.proc.stdout, outcome.proc.stdout[-3000:]  # type: ignore[union-attr]

    def test_ps_step_count_follows_the_training(self, scenario: Scenario) -> None:
        # WHEN `dynprof ps --json` was asked three times: a second apart right after READY (or after
        # the job created a new optimizer), and again after the captures
        pids = scenario.traced.pids
        assert pids, scenario.traced.error
        reads = [_agents(o, pids) for o in (scenario.steps_before, scenario.steps_soon_after, scenario.steps_after)]
        # THEN each rank's step count moved on with the training every time
        for rank_reads in zip(*reads):
            steps = [row["step"] for row in rank_reads]
            assert steps[0] and all(b is not None and b > a for a, b in itertools.pairwise(steps)), steps
        assert scenario.stage_lines_seen, f"no {scenario.case.wait_for!r} line"

    def test_ps_names_the_torch_the_job_imported(self, scenario: Scenario) -> None:
        # WHEN `dynprof ps --json` lists the job, which imported torch before its first step
        pids = scenario.traced.pids
        assert pids, scenario.traced.error
        # THEN its torch version is shown
        for row in _agents(scenario.steps_before, pids):
            assert row["torch_imported"] and row["torch"], {k: row.get(k) for k in ("pid", "torch", "torch_imported")}

    def test_hang_watchdog_stays_quiet_while_training(self, scenario: Scenario) -> None:
        # GIVEN the job ran under `dynprof run --hang-timeout 3` and kept training
        outcome = scenario.hang_listing
        assert outcome is not None and outcome.ok, outcome.describe() if outcome else scenario.traced.error
        # THEN no hang was reported
        assert outcome.json()["artifacts"] == [], f"hang reported (timeout {HANG_TIMEOUT_S:g} s): {outcome.json()}"
        assert not [line for line in scenario.traced.lines if "no optimizer step" in line]

    def test_store_keeps_no_temporary_directories(self, scenario: Scenario) -> None:
        # GIVEN the job has ended and `dynprof ls` has read the store
        assert scenario.hang_listing is not None, scenario.traced.error
        # THEN no capture left a hidden in-progress directory behind
        assert scenario.leftover_tmp == [], scenario.leftover_tmp

    def test_job_output_has_nothing_but_its_own_lines(self, scenario: Scenario) -> None:
        # GIVEN the lines the job prints by itself (plain run)
        own = {normalize(line) for line in scenario.plain.lines}
        # THEN under dynprof it printed nothing else but lines prefixed `dynprof:`
        foreign = [
            line
            for line in scenario.traced.lines
            if normalize(line) not in own and not line.startswith("dynprof:") and line.strip()
        ]
        assert not foreign, "lines the job does not print by itself:\n" + "\n".join(foreign[:40])

    def test_losses_are_identical_with_and_without_dynprof(self, scenario: Scenario) -> None:
        plain, traced = scenario.plain.losses(), scenario.traced.losses()
        assert plain, scenario.plain.tail()
        # THEN every loss the plain run computed is bit-identical under dynprof (traces taken)
        differ = {
            tag: (values, traced.get(tag, [])[: len(values)])
            for tag, values in plain.items()
            if traced.get(tag, [])[: len(values)] != values
        }
        assert not differ, f"{len(differ)} of {len(plain)} losses differ, e.g. {list(differ.items())[:3]}"
