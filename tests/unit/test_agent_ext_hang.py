"""The hang watchdog's checks, driven by hand: roles exempt from the first-step timeout, and
dynprof.phase as progress."""

from __future__ import annotations

import time
from pathlib import Path
from types import SimpleNamespace

import pytest

import dynprof
from dynprof import _phase, roles
from dynprof.agent._ext_hang import HangWatchdog


class _Steps:
    def __init__(self, last_progress_at: float) -> None:
        self.step = 1 if last_progress_at else 0
        self.last_progress_at = last_progress_at

    def fold_compiled(self) -> bool:
        return False


def _watchdog(tmp_path: Path, role: str, last_progress_at: float) -> HangWatchdog:
    ident = SimpleNamespace(rank=None, job_id="j", host="h")
    agent = SimpleNamespace(steps=_Steps(last_progress_at), role=role, identity=ident)
    wd = HangWatchdog(agent, timeout_s=0.5, first_step_timeout_s=0.5)  # type: ignore[arg-type]
    wd._dir = tmp_path
    return wd


@pytest.fixture
def checked(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(_phase, "_last_end", 0.0)  # no phase ended before the test
    made: list[HangWatchdog] = []

    def make(role: str, last_progress_at: float = 0.0) -> HangWatchdog:
        wd = _watchdog(tmp_path, role, last_progress_at)
        made.append(wd)
        return wd

    yield make
    for wd in made:
        wd._disarm()
        wd._close_file(remove_if_empty=True)


@pytest.mark.parametrize("role", [roles.LAUNCHER, roles.WORKER])
def test_no_first_step_dump_for_a_launcher_or_a_worker(checked, role):
    # GIVEN a process that never stepped, whose first-step timeout passed long ago
    wd = checked(role)
    wd._check()  # the first check notes the start
    wd._progress_at = time.time() - 60
    # WHEN the watchdog checks, THEN it dumps nothing and says why
    wd._check()
    assert wd.artifacts == [] and wd._dumps_this_stall == 0
    assert wd.state == f"a {role}: the first step is not watched"


def test_a_phase_in_progress_is_progress(checked):
    # GIVEN a process that stepped 60 s ago, under a 0.5 s timeout
    wd = checked(roles.TRAINER, last_progress_at=time.time() - 60)
    # WHEN the watchdog checks during a dynprof.phase, and right after it ended
    with dynprof.phase("eval"):
        wd._check()
        during = wd.state
    wd._check()
    # THEN it dumped nothing: busy, not hung, and the timeout counts from the phase's end
    assert wd.artifacts == [] and wd._dumps_this_stall == 0
    assert during == "busy: in phase eval"
    assert time.time() - wd._progress_at < 60


def test_a_process_that_never_stepped_and_is_no_launcher_is_dumped(checked):
    # GIVEN a process of no exempt role whose first-step timeout passed
    wd = checked(roles.OTHER)
    wd._check()
    wd._progress_at = time.time() - 60
    # WHEN the watchdog checks, THEN it dumps its stacks
    wd._check()
    assert len(wd.artifacts) == 1 and wd._dumps_this_stall == 1


def test_a_spawned_child_still_starting_arms_nothing_until_its_role_is_known(checked, monkeypatch):
    # GIVEN a process started by multiprocessing's spawn method that does not run its target
    # yet (it imports its parent's main module: slow on a loaded machine), whose first-step
    # timeout passed long ago, and whose role looks like any process's that never stepped
    import multiprocessing.process as mp_process

    monkeypatch.setattr("sys.orig_argv", ["python", "-c", "spawn_main()", "--multiprocessing-fork"])
    monkeypatch.setattr(mp_process, "_parent_process", None)
    wd = checked(roles.OTHER)
    wd._check()
    wd._progress_at = time.time() - 60

    # WHEN the watchdog checks while the child starts
    wd._check()
    # THEN it dumps nothing, arms no timer, and says what it waits for
    assert wd.artifacts == [] and wd._dumps_this_stall == 0 and not wd._armed_for
    assert wd.state == "waiting for its role (a spawned process starting)"

    # WHEN the child runs its target (multiprocessing sets its parent), as a process that never
    # steps: THEN its first-step timeout counts from then, and only then does it dump
    monkeypatch.setattr(mp_process, "_parent_process", object())
    wd._check()
    assert wd.artifacts == [] and wd._armed_for
    wd._progress_at = time.time() - 60
    wd._check()
    assert len(wd.artifacts) == 1


def test_role_pending_only_in_a_spawned_child_before_its_target(monkeypatch):
    import multiprocessing.process as mp_process

    spawned = ["python", "-c", "from multiprocessing.spawn import spawn_main", "--multiprocessing-fork"]
    monkeypatch.setattr(mp_process, "_parent_process", None)
    assert roles.role_pending(spawned)
    assert not roles.role_pending(["python", "train.py"])
    monkeypatch.setattr(mp_process, "_parent_process", object())
    assert not roles.role_pending(spawned)
