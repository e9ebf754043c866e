"""End-to-end traces of real training processes (CPU torch)."""

from __future__ import annotations

import json
from pathlib import Path

from collectors.torch_trace import profiler_steps, read_trace

PROGRAM = "tests/integration/programs/train_program.py"


def _trace_of(result_json: dict) -> tuple[dict, dict]:
    (res,) = result_json["results"]
    manifest = json.loads((Path(res["artifact"]) / "manifest.json").read_text())
    return read_trace(Path(res["artifact"]) / "trace.json.gz"), manifest


def test_steps_mode_captures_exactly_n_steps(spawn, cli):
    # GIVEN a training loop running under `dynprof run`
    target = spawn([PROGRAM, "--step-sleep", "0.005"])
    (pid,) = target.ready_pids()

    # WHEN five steps are traced
    result = cli("start", "--pid", str(pid), "--steps", "5", "--json")

    # THEN the artifact holds exactly five consecutive ProfilerStep spans
    assert result.returncode == 0, result.stderr
    trace, manifest = _trace_of(json.loads(result.stdout))
    steps = profiler_steps(trace)
    numbers = [int(s["name"].split("#")[1]) for s in steps]
    assert len(numbers) == 5, numbers
    assert numbers == list(range(numbers[0], numbers[0] + 5))
    assert manifest["status"] == "complete"
    assert manifest["summary"]["steps_captured"] == 5
    assert manifest["summary"]["training_thread_pause_ms"] >= 0
    assert trace["distributedInfo"]["world_size"] == 1
