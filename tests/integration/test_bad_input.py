"""The CLI against processes that go away at awkward moments, and against hostile targets."""

from __future__ import annotations

import json
from pathlib import Path

EXIT_ON_STOP = "tests/integration/programs/exit_on_stop_program.py"


def test_stop_finds_the_artifact_of_a_process_that_exits_while_exporting(spawn, cli):
    # GIVEN a loop traced without a bound, which ends (and exits) as soon as its trace exports
    target = spawn([EXIT_ON_STOP])
    (pid,) = target.ready_pids()
    started = cli("start", "--pid", str(pid))
    assert started.returncode == 0, started.stderr

    # WHEN the trace is stopped: the process exits before the CLI hears back from it
    stopped = cli("stop", "--pid", str(pid), "--json")
    target.wait_for_line("DONE", timeout=30)

    # THEN stop reports the complete artifact the process wrote on its way out
    assert stopped.returncode == 0, stopped.stdout + stopped.stderr
    (res,) = json.loads(stopped.stdout)["results"]
    assert res["status"] == "complete", res
    manifest = json.loads((Path(res["artifact"]) / "manifest.json").read_text())
    assert manifest["status"] == "complete"
    assert manifest["pid"] == pid
