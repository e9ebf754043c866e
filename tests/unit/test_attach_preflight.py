"""dynprof.attach._preflight: the checks made before touching a target, each with the error a
person can act on."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from dynprof import errors
from dynprof.attach import _preflight
from tests.support.procs import Children, wait_exec_done


@pytest.fixture
def not_python() -> Iterator[subprocess.Popen[bytes]]:
    """A live process that runs no Python (``sleep``)."""
    child = subprocess.Popen(["sleep", "30"])
    wait_exec_done(child.pid, None)
    try:
        yield child
    finally:
        child.kill()
        child.wait()


@pytest.fixture
def python_child() -> Iterator[object]:
    """``python_child(args, env)``: a live Python process (parked on its stdin)."""
    children = Children()

    def start(args: list[str], env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
        return children.start([sys.executable, *args, "-c", "import sys; sys.stdin.read()"], env)

    yield start
    children.close()


def test_this_process_passes_the_process_check():
    _preflight.check_process(os.getpid())  # raises on failure
    assert not _preflight.exited(os.getpid())


def test_a_zombie_is_not_found():
    # GIVEN a child that exited and is not reaped
    child = subprocess.Popen(["true"])
    try:
        os.waitid(os.P_PID, child.pid, os.WEXITED | os.WNOWAIT)
        # THEN it counts as exited, and checking it says so
        assert _preflight.exited(child.pid)
        with pytest.raises(errors.ProcessNotFound, match="zombie"):
            _preflight.check_process(child.pid)
    finally:
        child.wait()
    assert _preflight.exited(child.pid), "a reaped process is gone"


def test_another_users_process_names_both_users_and_how_to_run_as_the_owner(monkeypatch):
    # GIVEN /proc/PID owned by another uid
    real_stat = os.stat
    me = os.getpid()

    def stat(path, *a, **kw):
        found = real_stat(path, *a, **kw)
        if str(path) == f"/proc/{me}":
            return os.stat_result((found.st_mode, 0, 0, 1, 54321, 0, 0, 0, 0, 0))
        return found

    monkeypatch.setattr(_preflight.os, "stat", stat)
    # WHEN / THEN PermissionDenied, with `sudo -u OWNER` in the help
    with pytest.raises(errors.PermissionDenied, match="belongs to user 54321") as info:
        _preflight.check_process(me)
    assert f"sudo -u 54321 dynprof attach {me}" in info.value.help


def test_a_refused_mem_open_is_ptrace_refused_with_the_kernel_setting_named(monkeypatch):
    # GIVEN opening /proc/PID/mem refused
    real_open = os.open

    def refuse(path, *a, **kw):
        if str(path).endswith("/mem"):
            raise PermissionError(13, "Permission denied")
        return real_open(path, *a, **kw)

    monkeypatch.setattr(_preflight.os, "open", refuse)
    # WHEN / THEN exit 11, saying why and how to allow it
    with pytest.raises(errors.PtraceRefused, match=r"ptrace of process .* was refused") as info:
        _preflight.check_process(os.getpid())
    assert info.value.exit_code == 11
    assert "CAP_SYS_PTRACE" in str(info.value) and info.value.help == _preflight.PTRACE_HELP


def test_ptrace_scope_is_the_kernel_setting_or_none():
    path = Path("/proc/sys/kernel/yama/ptrace_scope")
    expected = int(path.read_text()) if path.exists() else None
    assert _preflight.ptrace_scope() == expected


def test_cap_sys_ptrace_is_read_from_the_effective_capabilities():
    line = next(x for x in Path("/proc/self/status").read_text().splitlines() if x.startswith("CapEff:"))
    expected = bool(int(line.split()[1], 16) >> _preflight.CAP_SYS_PTRACE & 1)
    assert _preflight.has_cap_sys_ptrace() is expected


def test_target_python_of_this_process_is_its_version():
    assert _preflight.target_python(os.getpid()) == tuple(sys.version_info[:2])


def test_a_process_that_runs_no_python_is_not_python(not_python):
    with pytest.raises(errors.NotPython, match=r"does not run CPython") as info:
        _preflight.target_python(not_python.pid)
    assert "(sleep)" in str(info.value) and info.value.exit_code == 10


def test_a_python_too_old_is_unsupported(monkeypatch):
    monkeypatch.setattr(_preflight, "python_version", lambda pid: (3, 9))
    with pytest.raises(errors.Unsupported, match=r"runs Python 3\.9; dynprof needs 3\.10 or newer"):
        _preflight.target_python(os.getpid())


def test_gdb_symbols_of_this_process_are_all_there():
    found = _preflight.gdb_symbols(os.getpid())
    assert set(found) == set(_preflight.GDB_SYMBOLS) and all(found.values())


def test_gdb_symbols_of_a_process_without_python_name_what_is_missing(not_python):
    with pytest.raises(errors.NotPython, match=r"lacks the C functions attach calls: .*Py_AddPendingCall"):
        _preflight.gdb_symbols(not_python.pid)


def test_no_gdb_on_path_says_how_to_install_one(monkeypatch):
    monkeypatch.setattr(_preflight.shutil, "which", lambda name: None)
    with pytest.raises(errors.DynprofError, match="gdb is not on PATH") as info:
        _preflight.find_gdb()
    assert "apt-get install gdb" in info.value.help


@pytest.mark.parametrize(
    ("args", "env", "says"),
    [
        ([], {"PYTHON_DISABLE_REMOTE_DEBUG": "1"}, "PYTHON_DISABLE_REMOTE_DEBUG"),
        (["-X", "disable-remote-debug"], None, "-X disable-remote-debug"),
        (["-Xdisable_remote_debug"], None, "-X disable-remote-debug"),
        ([], {"PYTHON_DISABLE_REMOTE_DEBUG": ""}, None),  # set but empty: not disabled
        ([], None, None),
    ],
)
def test_remote_debug_disabled_by_environment_or_option(python_child, args, env, says):
    child = python_child(args, env)  # type: ignore[operator]
    found = _preflight.remote_debug_disabled(child.pid)
    if says is None:
        assert found is None
    else:
        assert found is not None and says in found


def test_remote_debug_of_a_process_that_is_gone_is_not_known():
    child = subprocess.Popen(["true"])
    child.wait()
    assert _preflight.remote_debug_disabled(child.pid) is None
