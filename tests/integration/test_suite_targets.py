"""The suite's own targets (tests/conftest.py's ``spawn``) end with their test, children too.

A training job's spawned helpers (multiprocessing's resource tracker, DataLoader workers started
with "spawn", a helper Process) outlive a terminated parent. Left running, they went on
registering in the test's run directory after its teardown had removed it.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

from tests.conftest import Target

# A parent that starts a child in its own session's group, says the child's pid, and waits.
PARENT = (
    "import subprocess, sys, time\n"
    "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'])\n"
    "print('CHILD', child.pid, flush=True)\n"
    "time.sleep(600)\n"
)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            state = fh.read().rsplit(b")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state not in (b"Z", b"X")


def test_a_stopped_target_leaves_no_process_of_its_session():
    # GIVEN a target started as the suite starts them, whose child outlives a terminated parent
    proc = subprocess.Popen(
        [sys.executable, "-c", PARENT],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    target = Target(proc)
    child = int(target.wait_for_line("CHILD")[0].split()[1])
    assert os.getpgid(child) == proc.pid

    # WHEN the suite stops it
    target.stop()

    # THEN the child is gone too (SIGKILL is delivered at once; its reaping by init may lag)
    deadline = time.monotonic() + 60
    while _alive(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(child), f"pid {child} of the stopped target's session is still running"
