"""The CLI against processes that go away at awkward moments, and against hostile targets."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

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


LOG_PROGRAM = "tests/integration/programs/agent_log_program.py"


def _run_log_program(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, LOG_PROGRAM, *args],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=str(Path(__file__).resolve().parents[2]),
    )


def test_a_log_file_that_cannot_be_written_costs_the_job_one_warning_line():
    # GIVEN an agent whose log file is on a full device (every write: ENOSPC)
    # WHEN it logs warnings and errors, and stops
    done = _run_log_program("--full-log")

    # THEN the job's stderr holds no logging error blocks, only dynprof's own prefixed lines,
    # and one of them says the log cannot be written
    assert done.returncode == 0, done.stderr
    assert "DONE" in done.stdout
    assert "Logging error" not in done.stderr and "Traceback" not in done.stderr, done.stderr
    lines = done.stderr.splitlines()
    assert all(line.startswith("dynprof: ") for line in lines), lines
    assert sum("cannot write its log" in line for line in lines) == 1, lines


def test_nothing_is_logged_after_the_agent_stopped(dynprof_dirs):
    # GIVEN an agent that logged while it ran, then stopped
    # WHEN a thread of the process logs after the stop
    done = _run_log_program()

    # THEN the log ends with "agent stopped" and the late lines reach neither the log nor stderr
    assert done.returncode == 0, done.stderr
    pid = int(done.stdout.split()[1])
    text = (dynprof_dirs["run"] / "logs" / f"{pid}.log").read_text()
    assert text.rstrip().splitlines()[-1].endswith("agent stopped"), text
    assert "late" not in text and "late" not in done.stderr


@pytest.mark.gdb_calls
@pytest.mark.ptrace
@pytest.mark.skipif(shutil.which("gdb") is None, reason="attach to Python < 3.14 needs gdb on PATH")
def test_attach_does_not_report_ready_when_the_agent_s_server_died(spawn, cli):
    # GIVEN a process launched without dynprof in which the agent's server thread cannot start
    target = spawn(["tests/integration/programs/broken_server_program.py"], under_run=False)
    (pid,) = target.ready_pids()

    # WHEN dynprof attaches to it
    result = cli("attach", str(pid), "--wait", "1", "--ready-timeout", "10")

    # THEN attach says the agent does not answer, with the reason from the agent's log
    assert result.returncode == 8, result.stderr
    assert "agent ready" not in result.stderr
    assert "does not answer" in result.stderr
    assert "dynprof.agent._server" in result.stderr, result.stderr
    assert "Traceback" not in result.stderr
