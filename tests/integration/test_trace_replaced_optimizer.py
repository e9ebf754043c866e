"""Steps and trace spans of jobs that replace their optimizer mid-run or compile its step."""

from __future__ import annotations

import json
import time
from pathlib import Path

from collectors.torch_trace import profiler_steps, read_trace

PROGRAM = "tests/integration/programs/replace_optimizer_program.py"


def _step_of(cli, pid: int) -> int:
    (agent,) = [a for a in json.loads(cli("ps", "--json").stdout)["agents"] if a["pid"] == pid]
    return int(agent["step"])


def test_a_replaced_optimizer_begins_an_iteration_and_the_trace_spans_stay_one_each(spawn, cli):
    # GIVEN a loop that drops its SGD optimizer for a new AdamW at step 30
    target = spawn([PROGRAM, "--replace-at", "30", "--wait-trace"])
    (pid,) = target.ready_pids()

    # WHEN 6 steps across the replacement are traced (steps 28 to 33)
    result = cli("start", "--pid", str(pid), "--steps", "6", "--at-step", "27", "--json")

    # THEN each of the 6 spans is one iteration (one optimizer step), and nothing more is traced
    assert result.returncode == 0, result.stdout + result.stderr
    (res,) = json.loads(result.stdout)["results"]
    manifest = json.loads((Path(res["artifact"]) / "manifest.json").read_text())
    summary = manifest["summary"]
    assert summary["start_step"] == 27
    assert summary["optimizer_steps_per_span"] == [1] * 6
    assert summary["steps_captured"] == 6
    assert len(profiler_steps(read_trace(Path(res["artifact"]) / "trace.json.gz"))) == 6
    # AND dynprof's step count is the job's
    (line,) = target.wait_for_line("PAUSED", timeout=60)
    assert _step_of(cli, pid) == int(line.split()[1])


def test_a_replacement_that_keeps_the_old_optimizer_alive_still_counts_every_iteration(spawn, cli):
    # GIVEN a loop that replaces its optimizer at step 30 but keeps the old one referenced
    target = spawn([PROGRAM, "--replace-at", "30", "--keep-old"])
    (pid,) = target.ready_pids()

    # WHEN it has run on past the replacement
    (line,) = target.wait_for_line("PAUSED", timeout=60)
    time.sleep(0.1)

    # THEN dynprof counts as many steps as the job made
    assert _step_of(cli, pid) == int(line.split()[1])


COMPILED = "tests/integration/programs/compiled_step_program.py"


def test_the_manifest_counts_compiled_optimizer_steps_in_its_spans(spawn, cli):
    # GIVEN a loop whose optimizer step is compiled
    target = spawn([COMPILED])
    (pid,) = target.ready_pids(timeout=120)

    # WHEN 3 steps are traced
    result = cli("start", "--pid", str(pid), "--steps", "3", "--json")

    # THEN the manifest describes every span, and counts the compiled optimizer steps in them
    assert result.returncode == 0, result.stdout + result.stderr
    (res,) = json.loads(result.stdout)["results"]
    summary = json.loads((Path(res["artifact"]) / "manifest.json").read_text())["summary"]
    spans = profiler_steps(read_trace(Path(res["artifact"]) / "trace.json.gz"))
    per_span = summary["optimizer_steps_per_span"]
    assert len(per_span) == len(spans)
    assert sum(per_span) >= 1, per_span  # compiled steps ran in the traced spans
