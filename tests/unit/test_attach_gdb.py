"""dynprof.attach._gdb against a scripted gdb: what gdb's output means, and the errors a person
sees (ptrace refused, registers that cannot be written, a full pending-call queue, a hang)."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from dynprof import errors
from dynprof.attach import _gdb
from dynprof.attach._gdb import GdbSession, RegistersRefused

SYMBOLS = {
    "mmap": 0x1000,
    "Py_AddPendingCall": 0x2000,
    "PyRun_SimpleString": 0x3000,
    "PyGILState_Ensure": 0x4000,
    "PyGILState_Release": 0x5000,
}
PROBE_OK = "$1 = 1\n" if _gdb._X86 else ""


def fake_gdb(tmp_path: Path, output: str, body: str = "") -> str:
    """A 'gdb' that records its arguments and prints ``output``."""
    (tmp_path / "out.txt").write_text(output)
    script = tmp_path / "gdb"
    script.write_text(
        f'#!/bin/sh\nfor a in "$@"; do printf "%s\\n" "$a"; done > {tmp_path}/argv.txt\n{body}cat {tmp_path}/out.txt\n'
    )
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    return str(script)


def session(tmp_path: Path, output: str, **kw) -> GdbSession:
    return GdbSession(fake_gdb(tmp_path, output), os.getpid(), SYMBOLS, **kw)


def test_fn_casts_the_absolute_address_to_the_functions_signature():
    s = GdbSession("gdb", 1, SYMBOLS)
    assert s.fn("PyGILState_Ensure") == "((int (*)(void)) 0x4000)"
    assert s.fn("mmap").endswith(" 0x1000)")


def test_gdb_reads_no_symbols_and_the_register_probe_runs_before_any_call(tmp_path):
    # GIVEN a session WHEN it runs one command
    s = session(tmp_path, PROBE_OK + "$2 = 7\n")
    found = s.run(["p 7"])
    # THEN gdb was asked to read no symbol file, and the probe comes before the command
    argv = (tmp_path / "argv.txt").read_text().splitlines()
    assert "--readnever" in argv and "set auto-solib-add off" in argv and "-batch" in argv
    assert argv[argv.index("-p") + 1] == str(os.getpid())
    if _gdb._X86:
        assert argv.index("set $dynprof_regs = 0") < argv.index("p 7")
    # AND the values printed are the commands' own (the probe's is not among them)
    assert found.values == ["7"]


def test_gdb_not_allowed_to_ptrace_is_ptrace_refused_with_the_help(tmp_path):
    s = session(tmp_path, "ptrace: Operation not permitted.\n")
    with pytest.raises(errors.PtraceRefused, match="not allowed to ptrace") as info:
        s.run(["p 1"])
    assert "ptrace_scope" in info.value.help


def test_gdb_that_finds_no_process_is_process_not_found(tmp_path):
    s = session(tmp_path, "ptrace: No such process.\n")
    with pytest.raises(errors.ProcessNotFound, match="exited during attach"):
        s.run(["p 1"])


def test_a_failed_register_probe_calls_nothing_and_says_what_gdb_said(tmp_path, monkeypatch):
    monkeypatch.setattr(_gdb, "_X86", True)  # the probe runs on x86 (any machine reads the answer alike)
    # GIVEN gdb that cannot write the extended register state
    said = "Couldn't write extended state status: Bad address."
    s = session(tmp_path, f"{said}\n$1 = 0\n$2 = 0\n")
    # WHEN it runs THEN RegistersRefused, an Unsupported, quoting gdb's line
    with pytest.raises(RegistersRefused) as info:
        s.run(["p 1"])
    assert isinstance(info.value, errors.Unsupported)
    assert info.value.said == said
    assert "nothing was run in the process" in str(info.value)
    assert f"dynprof stacks --pid {os.getpid()}" in info.value.help


def test_queue_pending_call_returns_the_page_address(tmp_path):
    s = session(tmp_path, PROBE_OK + "$2 = (char *) 0x7f12345000 ''\n$3 = 0\n")
    assert s.queue_pending_call(str(tmp_path / "payload"), 100) == 0x7F12345000
    argv = (tmp_path / "argv.txt").read_text()
    # one page for 100 bytes, and the payload file is restored into it
    assert f"(0, {_gdb.PAGE}, " in argv and f"restore {tmp_path / 'payload'} binary $buf" in argv


def test_a_payload_of_exactly_a_page_gets_room_for_its_terminating_nul(tmp_path):
    s = session(tmp_path, PROBE_OK + "$2 = (char *) 0x7f12345000\n$3 = 0\n")
    s.queue_pending_call("p", _gdb.PAGE)
    assert f"(0, {2 * _gdb.PAGE}, " in (tmp_path / "argv.txt").read_text()


def test_a_full_pending_call_queue_is_busy(tmp_path):
    s = session(tmp_path, PROBE_OK + "$2 = (char *) 0x7f12345000\n$3 = -1\n")
    with pytest.raises(errors.Busy, match="pending-call queue is full"):
        s.queue_pending_call("p", 10)


@pytest.mark.parametrize("address", ["0x0", "0xffffffffffffffff"])
def test_a_failed_mmap_is_an_error(tmp_path, address):
    s = session(tmp_path, PROBE_OK + f"$2 = (char *) {address}\n$3 = 0\n")
    with pytest.raises(errors.DynprofError, match="mmap failed"):
        s.queue_pending_call("p", 10)


def test_gdb_that_printed_too_little_is_an_error_with_its_output(tmp_path):
    s = session(tmp_path, PROBE_OK + "No symbol table is loaded.\n")
    with pytest.raises(errors.DynprofError, match="could not queue the bootstrap") as info:
        s.queue_pending_call("p", 10)
    assert "No symbol table is loaded." in info.value.help


def test_run_under_gil_state_is_false_when_the_thread_held_the_gil(tmp_path):
    held = session(tmp_path, PROBE_OK + "$2 = 0\n$3 = -99\n$4 = 1\n")
    assert held.run_under_gil_state(0x7000) is False
    ran = session(tmp_path, PROBE_OK + "$2 = 1\n$3 = 0\n$4 = 1\n")
    assert ran.run_under_gil_state(0x7000) is True
    assert "thread 1" in (tmp_path / "argv.txt").read_text()


def test_gdb_that_does_not_finish_is_interrupted_and_a_timeout(tmp_path):
    # GIVEN a gdb that hangs (and ends on SIGINT, as gdb interrupts its call)
    script = fake_gdb(tmp_path, "", body="exec sleep 30\n")
    s = GdbSession(script, os.getpid(), SYMBOLS, timeout=0.05)
    # WHEN / THEN a Timeout that says it was interrupted and detached
    with pytest.raises(errors.Timeout, match="interrupted and detached"):
        s.run(["p 1"])
