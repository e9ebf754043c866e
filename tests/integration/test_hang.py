"""The hang watchdog in real training loops: it fires for a stuck loop, not for a stepping one."""

from __future__ import annotations

import json
import time
from pathlib import Path

from dynprof.store import ArtifactStore

PROGRAM = "tests/integration/programs/train_program.py"


def _hang_artifacts() -> list:
    return ArtifactStore().list(kind="hang")


RUN_WATCHED = ["-m", "dynprof", "run", "-q", "--hang-timeout", "1", "--", "python"]


def _start_stuck_loop(spawn, *extra: str) -> None:
    """A loop under a 1 s watchdog that stops stepping after 5 steps (EXTRA: how it is stuck)."""
    target = spawn(
        [*RUN_WATCHED, PROGRAM, "--stop-stepping-after", "5", *extra, "--max-seconds", "240"],
        under_run=False,
    )
    target.ready_pids()


def test_watchdog_dumps_the_stuck_function(spawn, cli):
    # GIVEN a loop that stops stepping after 5 steps, with a 1 s watchdog
    _start_stuck_loop(spawn)

    # WHEN it has been stuck for longer than the timeout
    deadline = time.monotonic() + 120
    while not _hang_artifacts() and time.monotonic() < deadline:
        time.sleep(0.1)

    # THEN a hang artifact names the function it is stuck in, and `dynprof ls` lists it
    (art,) = _hang_artifacts()[:1]
    assert art.status == "complete"
    summary = art.manifest["summary"]
    assert summary["step"] == 5 and summary["dump"] == 1
    assert summary["stalled_for_s"] >= 1.0  # never before its timeout (later on a loaded machine)
    assert summary["main_thread"][0].startswith("stuck_forever (")
    stacks = json.loads((Path(art.path) / "stacks.json").read_text())
    (main,) = [t for t in stacks["threads"] if t["main"]]
    assert main["frames"][0]["function"] == "stuck_forever"
    # the dump was taken by the monitor thread while it held the GIL (no C-timer dump of a live process)
    text = (Path(art.path) / "hang.txt").read_text()
    assert "most recent call first" in text and "Timeout" not in text
    listed = cli("ls", "--json")
    assert listed.returncode == 0 and str(art.path) in listed.stdout
    shown = cli("show", str(art.path))
    assert "main thread in stuck_forever (" in shown.stdout

    # AND a second dump follows after the longer interval (3 timeouts)
    deadline = time.monotonic() + 120
    while len(_hang_artifacts()) < 2 and time.monotonic() < deadline:
        time.sleep(0.1)
    second = _hang_artifacts()[0]
    assert second.manifest["summary"]["dump"] == 2
    assert second.manifest["summary"]["stalled_for_s"] >= 3.5


def test_watchdog_stays_quiet_while_steps_flow_and_before_the_first_step(spawn):
    # GIVEN a loop stepping every 20 ms for 4 s with a 3 s watchdog (150 steps' worth: no pause
    # of a loaded machine comes near), whose first step comes after 4 s
    target = spawn(
        [
            "-m",
            "dynprof",
            "run",
            "-q",
            "--hang-timeout",
            "3",
            "--",
            "python",
            "-c",
            "import time; time.sleep(4); import runpy, sys; sys.argv = ['p', '--step-sleep', '0.02', "
            "'--max-seconds', '4']; runpy.run_path('" + PROGRAM + "', run_name='__main__')",
        ],
        under_run=False,
    )
    target.wait_for_line("DONE", timeout=60)
    target.proc.wait(timeout=30)

    # THEN no hang was reported (neither the slow start nor the steps)
    assert _hang_artifacts() == []
    assert not any("no optimizer step" in line for line in target.lines), target.lines


def test_watchdog_backstop_dumps_a_process_stuck_in_c_holding_the_gil(spawn, cli):
    # GIVEN a loop that stops stepping inside a C call that holds the GIL for 6 s
    _start_stuck_loop(spawn, "--hold-gil-seconds", "6")

    # WHEN the watchdog thread cannot run (no GIL) past the timeout
    deadline = time.monotonic() + 120
    while not _hang_artifacts() and time.monotonic() < deadline:
        time.sleep(0.1)

    # THEN faulthandler's C timer dumped it (named in the artifact), inside the C call's caller
    (art,) = _hang_artifacts()[:1]
    stacks = json.loads((Path(art.path) / "stacks.json").read_text())
    assert "C timer" in " ".join(stacks["notes"])
    (main,) = [t for t in stacks["threads"] if t["main"]]
    assert main["frames"][0]["function"] == "stuck_holding_gil"
    assert "Timeout" in (Path(art.path) / "hang.txt").read_text()
