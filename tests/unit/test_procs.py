"""Ending a child process together with the processes it started (dynprof.procs).

Each test starts a real process group: ``sh`` in a new session with ``sleep`` children. Every
process of the group holds the write end of the child's stdout, so reading it to its end
returns only once each of them has ended: that is how a test knows the whole group is gone.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time

from dynprof.procs import kill_group, stop_group


def start_group(script: str) -> subprocess.Popen[str]:
    """``sh -c SCRIPT`` leading a process group of its own; returns once it printed ``ready``."""
    proc = subprocess.Popen(["sh", "-c", script], stdout=subprocess.PIPE, text=True, start_new_session=True)
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == "ready"
    return proc


def rest_of_output(proc: subprocess.Popen[str]) -> str:
    """What the group still prints; returns when every process of the group has ended."""
    assert proc.stdout is not None
    out = proc.stdout.read()
    proc.stdout.close()
    return out


def test_kill_group_kills_the_child_and_every_process_it_started():
    # GIVEN a child that started two sleeping processes in its group
    proc = start_group("sleep 600 & sleep 600 & echo ready; wait")
    # WHEN the group is killed
    assert kill_group(proc) is True
    # THEN the child died of SIGKILL and its stdout ends: no process of the group is left
    assert proc.wait() == -signal.SIGKILL
    assert rest_of_output(proc) == ""


def test_kill_group_after_the_child_was_reaped_still_kills_what_it_left_behind():
    # GIVEN a child that started a sleeping process, exited and was reaped
    proc = start_group("sleep 600 & echo ready")
    assert proc.wait() == 0
    # WHEN its group is killed
    sent = kill_group(proc)
    # THEN the process it left behind got the signal
    assert sent is True
    assert rest_of_output(proc) == ""


def test_kill_group_of_a_group_that_is_gone_sends_nothing_and_raises_nothing():
    proc = subprocess.Popen(["true"], start_new_session=True)
    assert proc.wait() == 0
    assert kill_group(proc) is False
    assert stop_group(proc, grace_s=600) == 0  # nothing to stop: the exit status stands


def test_kill_group_of_a_group_that_is_not_ours_sends_nothing(monkeypatch):
    # GIVEN a group this process may not signal (another user's: EPERM)
    proc = start_group("echo ready; sleep 600")

    def refused(pgid: int, sig: int) -> None:
        raise PermissionError(1, "Operation not permitted")

    try:
        with monkeypatch.context() as m:
            m.setattr(os, "killpg", refused)
            # THEN nothing is sent, and no error raised
            assert kill_group(proc) is False
    finally:
        kill_group(proc)
        proc.wait()
        rest_of_output(proc)


def test_kill_group_sends_the_signal_asked_for():
    proc = start_group("trap 'echo hup; exit 5' USR1; echo ready; while :; do sleep 1; done")
    assert kill_group(proc, signal.SIGUSR1) is True
    assert proc.wait() == 5
    assert rest_of_output(proc) == "hup\n"


def test_stop_group_asks_with_sigterm_first_and_returns_the_exit_status():
    # GIVEN a child that ends itself on SIGTERM, with a sleeping process in its group
    proc = start_group("trap 'echo term; exit 3' TERM; echo ready; while :; do sleep 1; done")
    # WHEN the group is stopped with a long grace
    status = stop_group(proc, grace_s=600)
    # THEN it ended on SIGTERM (its handler ran), reaped, and the group is gone
    assert status == 3 and proc.returncode == 3
    assert rest_of_output(proc) == "term\n"


def test_stop_group_kills_a_group_that_ignores_sigterm():
    # GIVEN a child and a sleeping process that both ignore SIGTERM
    proc = start_group("trap '' TERM; sleep 600 & echo ready; wait")
    # WHEN the group is stopped (a grace long enough for SIGKILL's reaping on a loaded machine)
    status = stop_group(proc, grace_s=5.0)
    # THEN SIGKILL ended it, reaped, with the process it started
    assert status == -signal.SIGKILL and proc.returncode == -signal.SIGKILL
    assert rest_of_output(proc) == ""


def test_killing_a_child_kills_its_whole_process_group():
    # GIVEN a child in its own session that started a grandchild
    proc = subprocess.Popen(
        ["sh", "-c", "sleep 60 & echo $!; wait"], stdout=subprocess.PIPE, text=True, start_new_session=True
    )
    assert proc.stdout is not None
    grandchild = int(proc.stdout.readline())
    # WHEN the group is killed
    kill_group(proc)
    proc.wait(timeout=10)
    proc.stdout.close()
    # THEN the grandchild is gone too
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            os.kill(grandchild, 0)
        except ProcessLookupError:
            break
        try:  # reaped by init; a zombie still answers kill(0)
            with open(f"/proc/{grandchild}/stat") as fh:
                if fh.read().split(") ", 1)[1].startswith("Z"):
                    break
        except FileNotFoundError:
            break
        time.sleep(0.05)
    else:
        raise AssertionError("the grandchild outlived its group's kill")
