"""The pieces of `dynprof attach` that need no debugger: symbols, method choice, job discovery,
step alignment of attached ranks, and the payload's promise to bind nothing in __main__."""

from __future__ import annotations

import ctypes
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from collectors.torch_trace.align import aligned_steps, boundary_offsets
from dynprof import errors
from dynprof.attach import _elf, _preflight, choose_method, find_job_processes
from dynprof.attach._bootstrap import THREAD_NAME, bootstrap_source, payload
from dynprof.proto import pb

ROOT = Path(__file__).resolve().parent.parent.parent


def test_symbols_resolved_from_dynsym_match_the_loaded_functions():
    # GIVEN this very process, WHEN its C API is resolved from /proc/self/maps and .dynsym
    found = _elf.resolve(os.getpid(), _preflight.GDB_SYMBOLS)
    # THEN each address is the one the dynamic loader gave the function
    assert found["Py_AddPendingCall"] == ctypes.cast(ctypes.pythonapi.Py_AddPendingCall, ctypes.c_void_p).value
    assert found["PyGILState_Ensure"] == ctypes.cast(ctypes.pythonapi.PyGILState_Ensure, ctypes.c_void_p).value
    assert found["mmap"] == ctypes.cast(ctypes.CDLL(None).mmap, ctypes.c_void_p).value
    assert _elf.python_version(os.getpid()) == tuple(sys.version_info[:2])
    # ... and the version can also be read from the exported Py_Version (a plain `python` executable)
    assert _elf._py_version_variable(os.getpid()) == tuple(sys.version_info[:2])


def test_a_non_elf_file_is_rejected(tmp_path):
    bad = tmp_path / "x.so"
    bad.write_bytes(b"not an elf" * 10)
    with pytest.raises(_elf.ElfError):
        _elf.dynamic_symbols(str(bad), ["mmap"])


def test_method_choice():
    pid = os.getpid()
    # Python < 3.14 targets: gdb, and remote-exec cannot be forced
    assert choose_method(pid, (3, 11), "auto") == ("gdb", [])
    with pytest.raises(errors.Unsupported, match=r"needs 3\.14"):
        choose_method(pid, (3, 11), "remote-exec")
    # a 3.14 target seen from another Python version: gdb, saying why not remote_exec
    if sys.version_info[:2] != (3, 14):
        method, notes = choose_method(pid, (3, 14), "auto")
        assert method == "gdb" and "sys.remote_exec not used" in notes[0]
    with pytest.raises(errors.UsageError):
        choose_method(pid, (3, 11), "pyrasite")


def test_remote_debugging_disabled_is_detected():
    env = {**os.environ, "PYTHON_DISABLE_REMOTE_DEBUG": "1"}
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"], env=env)
    other = subprocess.Popen([sys.executable, "-X", "disable-remote-debug", "-c", "import time; time.sleep(30)"])
    plain = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        time.sleep(0.3)
        assert "PYTHON_DISABLE_REMOTE_DEBUG" in (_preflight.remote_debug_disabled(proc.pid) or "")
        assert "-X disable-remote-debug" in (_preflight.remote_debug_disabled(other.pid) or "")
        assert _preflight.remote_debug_disabled(plain.pid) is None
    finally:
        for p in (proc, other, plain):
            p.kill()
            p.wait()


def test_payload_binds_nothing_in_main_and_reports(tmp_path):
    # GIVEN a payload whose bootstrap cannot import dynprof (no home, a bare sys.path)
    source = bootstrap_source(str(tmp_path), "", {}, "test")
    import dynprof

    checkout = os.path.dirname(os.path.dirname(os.path.abspath(dynprof.__file__)))
    code = (
        "import os, sys, threading\n"
        f"sys.path[:] = [p for p in sys.path if 'site-packages' not in p and os.path.abspath(p) != {checkout!r}]\n"
        "before = set(globals())\n"
        f"exec({payload(source)!r}, globals())\n"
        "after = set(globals())\n"
        # the bootstrap thread is a daemon: wait until it has written its report (on a loaded
        # machine or a slow disk that can take longer than any fixed sleep) before exiting
        f"[t.join(120) for t in threading.enumerate() if t.name == {THREAD_NAME!r}]\n"
        "print(sorted(after - before))\n"
    )
    # WHEN the main thread runs it
    out = subprocess.run([sys.executable, "-I", "-c", code], capture_output=True, text=True, timeout=180, cwd="/")
    # THEN __main__ gained no name, nothing was printed into the job, and the error was reported
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "['before']" and out.stderr == ""
    ran = json.loads((tmp_path / "ran.json").read_text())
    result = json.loads((tmp_path / "result.json").read_text())
    assert ran["via"] == "test" and ran["executable"] == sys.executable
    assert result["ok"] is False and result["kind"] == "import" and result["missing"] in ("dynprof", "dynprof.agent")


def test_job_processes_found_by_their_launchers_environment():
    # GIVEN a job's two ranks (torchrun's run id) and its launcher (no RANK), and another job
    def start(env: dict[str, str]) -> subprocess.Popen[bytes]:
        return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"], env={**os.environ, **env})

    rank0 = start({"TORCHELASTIC_RUN_ID": "jobA", "RANK": "0"})
    rank1 = start({"TORCHELASTIC_RUN_ID": "jobA", "RANK": "1"})
    launcher = start({"TORCHELASTIC_RUN_ID": "jobA"})
    other = start({"SLURM_JOB_ID": "jobB", "RANK": "0"})
    try:
        time.sleep(0.5)
        # WHEN the job's processes are looked for
        search = find_job_processes("jobA")
        # THEN the ranks are found, the launcher is skipped with its reason, the other job is not seen
        assert [p.pid for p in search.found] == [rank0.pid, rank1.pid]
        assert [(p.pid, why) for p, why in search.skipped] == [(launcher.pid, "no RANK: a launcher")]
        assert [p.rank for p in search.found] == [0, 1]
        assert [p.pid for p in find_job_processes("jobB").found] == [other.pid]
    finally:
        for p in (rank0, rank1, launcher, other):
            p.kill()
            p.wait()


def _status(step: int, last_step_at: float, step_time_s: float = 0.1) -> pb.Status:
    return pb.Status(step=step, last_step_at=last_step_at, step_time_s=step_time_s)


def test_attached_ranks_are_aligned_by_boundary_time_not_by_counter():
    # GIVEN two ranks of a synchronous job attached 4 s apart (counters differ by 40), read
    # either side of a boundary (rank 1's latest boundary is one step later than rank 0's)
    statuses = [_status(100, 1000.00), _status(61, 1000.10)]
    # WHEN the offsets are computed THEN rank 1's counter runs 40 behind rank 0's
    assert boundary_offsets(statuses) == [0, -40]
    # AND the steps each is asked to start after name the same boundary
    steps = aligned_steps(statuses, [0, -40], lead_s=0.3)
    assert steps[0] - steps[1] == 40 and steps[0] > 101
    # Without step times nothing can be said
    assert boundary_offsets([_status(3, 0.0, 0.0), _status(5, 0.0, 0.0)]) is None


def test_an_attach_result_describes_itself_for_a_person():
    from dynprof.attach import AttachResult

    # GIVEN a process attached through gdb without a step hook yet, and one that had an agent
    attached = AttachResult(
        pid=12,
        status="attached",
        method="gdb-pending-call",
        seconds=1.5,
        log="/run/a.log",
        hook_installed=False,
        notes=["slow"],
    )
    already = AttachResult(pid=13, status="already", method="none", activation="attach")
    # WHEN each is described
    # THEN one line says what happened, with the hook's and the notes' lines below
    assert attached.describe() == (
        "pid 12: attached (gdb, pending call, 1.50 s): agent ready, log /run/a.log\n"
        "  no optimizer step hook yet (torch.optim not imported): step mode starts once it is\n"
        "  note: slow"
    )
    assert already.describe() == "pid 13: already has a dynprof agent (started by attach); nothing done"
