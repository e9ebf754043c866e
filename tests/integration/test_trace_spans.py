"""Each ProfilerStep# span of a trace is one training iteration, as the manifest says: with
Python stacks recorded, with optimizers stepped inside backward, and in duration mode (CPU)."""

from __future__ import annotations

import json
from pathlib import Path

from collectors.torch_trace import check_step_spans, read_trace

SAFETY = "tests/integration/programs/safety_program.py"
# safety_program.py --depth 2: two blocks of two Linear layers, then one Linear: 10 parameters.
PARAMETERS_AT_DEPTH_2 = 10


def _traced(cli, pid: int, *start_args: str) -> tuple[dict, dict]:
    result = cli("start", "--pid", str(pid), *start_args, "--json")
    assert result.returncode == 0, result.stderr
    (res,) = json.loads(result.stdout)["results"]
    art = Path(res["artifact"])
    return check_step_spans(read_trace(art / "trace.json.gz")), json.loads((art / "manifest.json").read_text())


def test_with_stack_each_span_holds_one_whole_optimizer_step(spawn, cli):
    # GIVEN a plain training loop
    target = spawn([SAFETY, "--mode", "plain", "--depth", "2", "--step-sleep", "0.002"])
    (pid,) = target.ready_pids()

    # WHEN three steps are traced with Python stacks
    check, manifest = _traced(cli, pid, "--steps", "3", "--with-stack")

    # THEN three spans, each with its one optimizer step inside, none straddling a boundary
    assert check["spans"] == 3, check
    assert check["per_span"] == [1, 1, 1], check
    assert check["straddling"] == 0, check
    summary = manifest["summary"]
    assert summary["span"] == "iteration"
    assert (summary["first_span_partial"], summary["last_span_partial"]) == (False, False)
    assert summary["optimizer_steps_per_span"] == [1, 1, 1]


def test_optimizer_in_backward_each_span_is_one_iteration(spawn, cli):
    # GIVEN one optimizer per parameter, stepped from post-accumulate-grad hooks in backward
    target = spawn([SAFETY, "--mode", "opt-in-backward", "--depth", "2"])
    (pid,) = target.ready_pids()

    # WHEN three steps are traced
    check, manifest = _traced(cli, pid, "--steps", "3")

    # THEN three spans, each holding every optimizer step of one iteration
    assert check["spans"] == 3, check
    assert check["per_span"] == [PARAMETERS_AT_DEPTH_2] * 3, check
    assert check["straddling"] == 0, check
    summary = manifest["summary"]
    assert (summary["first_span_partial"], summary["last_span_partial"]) == (False, False)
    assert summary["optimizer_steps_per_span"] == [PARAMETERS_AT_DEPTH_2] * 3


def test_duration_mode_spans_are_whole_iterations_or_flagged(spawn, cli):
    # GIVEN a plain loop of short steps
    target = spawn([SAFETY, "--mode", "plain", "--depth", "2", "--step-sleep", "0.002"])
    (pid,) = target.ready_pids()

    # WHEN a third of a second is traced
    check, manifest = _traced(cli, pid, "--duration", "0.3")

    # THEN the manifest says what each span holds
    summary = manifest["summary"]
    assert summary["stopped_by"] == "duration"
    assert summary["span"] == "iteration"
    assert summary["optimizer_steps_per_span"] == check["per_span"], check
    # AND every span it does not flag partial is one whole iteration: one optimizer step
    first, last = summary["first_span_partial"], summary["last_span_partial"]
    whole = check["per_span"][1 if first else 0 : len(check["per_span"]) - (1 if last else 0)]
    assert whole and set(whole) == {1}, (check, first, last)
    if not (first or last):
        assert check["straddling"] == 0, check
    # AND a loop of short steps (a few ms; a heavily loaded machine may make them longer than
    # the 100 ms that duration mode aligns to) starts and ends at step boundaries
    # (or, where the start found the steps slower than that, or the boundary unsafe, the manifest
    # says so in words)
    assert bool(summary["first_span_partial_why"]) == first, summary
    if summary["steps_captured"] >= 10 and first:
        why = summary["first_span_partial_why"]
        assert "over the 0.1 s" in why or "not a safe point" in why, summary
    if summary["steps_captured"] >= 10:
        assert not last, summary
