"""Each ProfilerStep# span of a trace is one training iteration, as the manifest says: with
Python stacks recorded, with optimizers stepped inside backward, with a compiled model and a
compiled optimizer step, and in duration mode (CPU)."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

from collectors.torch_trace import check_step_spans, profiler_steps, read_trace

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

    # WHEN two seconds are traced (hundreds of steps here; on a machine loaded enough to slow
    # the traced loop to a few steps a second, a trace may hold only partial spans: it is
    # checked all the same, and the loop is traced again, up to three times in all, until one
    # holds a span it does not flag)
    wholes: list[list[int]] = []
    for _ in range(3):
        check, manifest = _traced(cli, pid, "--duration", "2")
        wholes.append(_check_duration_spans(check, manifest["summary"]))
        if wholes[-1]:
            break

    # THEN a trace held spans not flagged partial, each one whole iteration
    assert wholes[-1] and set(wholes[-1]) == {1}, wholes


def _check_duration_spans(check: dict, summary: dict) -> list[int]:
    """The checks of one duration-mode trace; the optimizer steps of each span it does not
    flag partial (each must be 1)."""
    # the manifest says what each span holds
    assert summary["stopped_by"] == "duration"
    assert summary["span"] == "iteration"
    assert summary["optimizer_steps_per_span"] == check["per_span"], check
    # every span it does not flag partial is one whole iteration: one optimizer step
    first, last = summary["first_span_partial"], summary["last_span_partial"]
    whole = check["per_span"][1 if first else 0 : len(check["per_span"]) - (1 if last else 0)]
    assert set(whole) <= {1}, (check, first, last)
    if not (first or last):
        assert check["straddling"] == 0, check
    # a loop of short steps (a few ms; a heavily loaded machine may make them longer than the
    # 100 ms that duration mode aligns to) starts and ends at step boundaries (or, where the
    # start found the steps slower than that, or the boundary unsafe, the manifest says so)
    assert bool(summary["first_span_partial_why"]) == first, summary
    if summary["steps_captured"] >= 10 and first:
        why = summary["first_span_partial_why"]
        assert "over the 0.1 s" in why or "not a safe point" in why, summary
    # its end: at a boundary, or (a step on a loaded machine slower than the stop's grace of
    # three typical steps) partial, and then the manifest says that no boundary came in time
    assert bool(summary["last_span_partial_why"]) == last, summary
    # (a trace whose start was not at a boundary ends where the training thread is, and says so)
    if summary["steps_captured"] >= 10 and last:
        why = summary["last_span_partial_why"]
        unaligned = first and "did not start at a step boundary" in why
        assert "no step boundary came within" in why or unaligned, summary
    return list(whole)


TIMM_LIKE = "tests/integration/programs/timm_like_program.py"
# What one iteration of timm_like_program.py runs on its training thread, outside compiled code:
# the loss, zero_grad (before backward) and the loss's backward node.
ONE_ITERATION = ("aten::cross_entropy_loss", "Optimizer.zero_grad#AdamW.zero_grad", "NllLossBackward0")
COMPILED_REGION = "Torch-Compiled Region"


def _per_span(trace: dict) -> list[Counter]:
    """For each ProfilerStep# span: how many of ONE_ITERATION's events and of the compiled
    regions' runs start in it (on any thread)."""
    spans = [(s["ts"], s["ts"] + s["dur"]) for s in profiler_steps(trace)]
    counts = [Counter() for _ in spans]
    for e in trace["traceEvents"]:
        name = str(e.get("name", ""))
        key = COMPILED_REGION if name.startswith(COMPILED_REGION) else name
        if e.get("ph") != "X" or key not in (*ONE_ITERATION, COMPILED_REGION):
            continue
        for i, (a, b) in enumerate(spans):
            if a <= e.get("ts", 0) < b:
                counts[i][key] += 1
    return counts


@pytest.mark.parametrize(
    "style",
    [
        pytest.param(("--step-style", "decorator"), id="compiled-model-and-decorated-step"),
        pytest.param(("--step-style", "method"), id="compiled-model-and-compiled-opt-step"),
    ],
)
def test_compiled_optimizer_step_spans_are_one_iteration_each(spawn, cli, style):
    # GIVEN a timm-like loop: compiled model, compiled AdamW step over two parameter groups,
    # a float learning rate its schedule writes after every update
    target = spawn([TIMM_LIKE, *style])
    (pid,) = target.ready_pids(timeout=240)

    for _ in range(3):
        # WHEN three steps are traced (three times in a row: the field saw 3 of 3 go wrong)
        result = cli("start", "--pid", str(pid), "--steps", "3", "--json")
        assert result.returncode == 0, result.stdout + result.stderr
        (res,) = json.loads(result.stdout)["results"]
        art = Path(res["artifact"])
        manifest = json.loads((art / "manifest.json").read_text())
        per_span = _per_span(read_trace(art / "trace.json.gz"))

        # THEN three spans, each one whole iteration: one forward loss, one zero_grad, one
        # backward, and the same compiled regions (model and optimizer step) in every span
        summary = manifest["summary"]
        assert len(per_span) == 3, (per_span, summary)
        for counts in per_span:
            assert [counts[name] for name in ONE_ITERATION] == [1, 1, 1], (per_span, summary)
        assert per_span[0][COMPILED_REGION] > 0, per_span
        assert len({c[COMPILED_REGION] for c in per_span}) == 1, per_span
        # AND the manifest says so
        assert manifest["status"] == "complete"
        assert summary["steps_captured"] == 3, summary
        assert (summary["first_span_partial"], summary["last_span_partial"]) == (False, False), summary
        assert summary["optimizer_steps_per_span"] == [1, 1, 1], summary
