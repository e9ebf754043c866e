"""dynprof.errors: the error classes' stable exit codes and help, and the pid probe."""

from __future__ import annotations

import os
import subprocess

import pytest

from dynprof import errors
from dynprof.errors import (
    AgentError,
    ArtifactError,
    Busy,
    DynprofError,
    MissingFile,
    NoAgent,
    NodesFailed,
    NotPython,
    PermissionDenied,
    ProcessNotFound,
    PtraceRefused,
    StoreError,
    Timeout,
    Unsupported,
    UsageError,
    probe_pid,
    process_gone,
)

# The table of the module docstring (the README's exit codes): stable, so scripts can rely on them.
DOCUMENTED = {
    DynprofError: 1,
    UsageError: 2,
    ProcessNotFound: 3,
    PermissionDenied: 4,
    NoAgent: 5,
    Busy: 6,
    Unsupported: 7,
    AgentError: 8,
    Timeout: 9,
    NotPython: 10,
    PtraceRefused: 11,
    NodesFailed: 12,
    ArtifactError: 1,
    MissingFile: 1,
    StoreError: 1,
}


@pytest.mark.parametrize(("cls", "code"), DOCUMENTED.items(), ids=lambda v: getattr(v, "__name__", str(v)))
def test_each_error_has_its_documented_exit_code(cls, code):
    assert issubclass(cls, DynprofError)
    assert cls("x").exit_code == code


def test_the_exit_codes_in_the_docstring_are_those_of_the_classes():
    # GIVEN the documented table (" 3    target process not found")
    doc = errors.__doc__ or ""
    # THEN every code 0..12 is listed in it
    for code in range(13):
        assert f"\n{code:>2}    " in doc, f"exit code {code} is not documented"


def test_the_message_is_the_str_and_help_defaults_to_the_class_help():
    # GIVEN an error raised without help
    exc = ProcessNotFound("no process with pid 5")
    # THEN str() is the message alone and help names the fix
    assert str(exc) == exc.message == "no process with pid 5"
    assert "dynprof ps" in exc.help


def test_a_given_help_wins_even_when_empty():
    assert NoAgent("x", help="do this").help == "do this"
    assert NoAgent("x", help="").help == ""
    assert DynprofError("x").help == ""


def test_ptrace_refused_is_caught_as_permission_denied():
    # A caller that handles PermissionDenied also handles a refused ptrace.
    with pytest.raises(PermissionDenied):
        raise PtraceRefused("refused")


def test_probe_pid_passes_for_this_process():
    probe_pid(os.getpid())  # raises on failure
    assert process_gone(os.getpid()) is None


@pytest.mark.parametrize("pid", [0, -1])
def test_probe_pid_refuses_a_pid_that_is_not_positive_as_usage(pid):
    with pytest.raises(UsageError, match=f"invalid pid {pid}"):
        probe_pid(pid)


def test_a_reaped_process_is_not_found():
    # GIVEN a child that exited and was reaped
    child = subprocess.Popen(["true"])
    child.wait()
    # WHEN / THEN it is "not found" (a pid is not reused this fast on a quiet machine)
    with pytest.raises(ProcessNotFound, match=str(child.pid)):
        probe_pid(child.pid)
    assert process_gone(child.pid) == "has exited"


def test_a_zombie_is_not_found_and_says_it_is_a_zombie():
    # GIVEN a child that exited and is not yet reaped
    child = subprocess.Popen(["true"])
    try:
        os.waitid(os.P_PID, child.pid, os.WEXITED | os.WNOWAIT)  # exited, left unreaped
        # WHEN it is probed THEN it is gone, and the reason names the zombie
        with pytest.raises(ProcessNotFound, match="zombie"):
            probe_pid(child.pid)
    finally:
        child.wait()


def test_another_users_process_is_permission_denied(monkeypatch):
    # GIVEN kill(pid, 0) answering EPERM, as for another user's process
    def refuse(pid, sig):
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(errors.os, "kill", refuse)
    # WHEN / THEN
    with pytest.raises(PermissionDenied, match="belongs to another user") as info:
        probe_pid(12345)
    assert info.value.exit_code == 4
