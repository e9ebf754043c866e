"""`dynprof stacks` on real processes: a hung 2-rank gloo job, a GIL-holding rank, bad input."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from collectors.stacks import ProcessStacks

HANG = "tests/integration/programs/hang_program.py"
pytestmark = pytest.mark.ptrace


def test_hung_gloo_job_splits_into_two_groups(hang_job, cli):
    # GIVEN a 2-rank gloo job where rank 0 waits in all_reduce and rank 1 sleeps before it
    hang_job("hungjob", "sleep")

    # WHEN the stacks of the job are read
    result = cli("stacks", "--job", "hungjob", "--json")

    # THEN two groups: rank 0 in the collective, rank 1 in its sleep, and one artifact holds it all
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout)
    groups = {tuple(g["ranks"]): g for g in out["groups"]}
    assert set(groups) == {(0,), (1,)}
    assert groups[(0,)]["headline"].startswith("in all_reduce (torch/distributed/distributed_c10d.py:")
    assert "collective_wait" in groups[(0,)]["headline"]
    assert groups[(1,)]["headline"].startswith("in wait_for_data (")
    assert groups[(1,)]["diverges_at"]["function"] == "main"
    assert {p["method"] for p in out["processes"]} == {"py-spy"}
    art = Path(out["artifact"])
    names = {p.name for p in art.iterdir()}
    assert {"merged.json", "merged.txt", "manifest.json"} <= names
    assert sum(n.endswith(".json") and n.startswith("rank") for n in names) == 2
    assert sum(n.endswith(".txt") and n.startswith("rank") for n in names) == 2
    shown = cli("show", str(art))
    assert shown.returncode == 0 and "rank 1: in wait_for_data" in shown.stdout


def test_rank_holding_the_gil_in_c_still_gives_its_stack(hang_job, cli):
    # GIVEN rank 1 stuck in a C call that holds the GIL (its agent cannot answer)
    pids = hang_job("giljob", "gil")

    # WHEN the stacks are read, with native frames
    result = cli("stacks", "--job", "giljob", "--native", "--full")

    # THEN rank 1's stack names the function it is stuck in and says it holds the GIL
    assert result.returncode == 0, result.stderr
    assert "rank 1: in spin_holding_gil" in result.stdout
    assert "main thread holds the GIL in: rank 1" in result.stdout
    assert (
        "sleep [libc.so.6]" in result.stdout
        or "__GI___clock_nanosleep" in result.stdout
        or "clock_nanosleep" in result.stdout
    )
    # and the in-process reader indeed cannot answer: the agent is blocked behind the GIL
    agent = cli("stacks", "--pid", str(pids[1]), "--method", "agent", "--timeout", "2")
    assert agent.returncode == 9, agent.stdout + agent.stderr
    assert "did not answer" in agent.stderr


def test_pid_without_agent_and_native_frames(spawn, cli):
    # GIVEN a plain Python process started without dynprof
    target = spawn(
        ["-c", "import os,time\nprint('READY', os.getpid(), flush=True)\ndef parked():\n time.sleep(60)\nparked()"],
        under_run=False,
    )
    (pid,) = target.ready_pids()
    time.sleep(0.2)
    for native in ([], ["--native"]):
        result = cli("stacks", "--pid", str(pid), "--json", *native)
        assert result.returncode == 0, result.stderr
        (group,) = json.loads(result.stdout)["groups"]
        assert group["headline"].startswith("in parked (")
        if native:
            assert any(f["native"] for f in group["frames"])


def test_dead_pid_exits_3(cli):
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    result = cli("stacks", "--pid", str(proc.pid))
    assert result.returncode == 3
    assert f"no process with pid {proc.pid}" in result.stderr


def test_non_python_pid_exits_10(cli):
    proc = subprocess.Popen(["sleep", "60"])
    try:
        time.sleep(0.2)
        result = cli("stacks", "--pid", str(proc.pid))
        assert result.returncode == 10, result.stderr
        assert "is not a Python process" in result.stderr and "(sleep)" in result.stderr
    finally:
        proc.kill()
        proc.wait()


# -- another user (root acting as nobody: tests/support/other_user.py) ---------------------------
def test_another_users_pid_exits_4(nobody, spawn):
    # GIVEN a process of root's
    target = spawn(["-c", "import os,time\nprint('READY', os.getpid(), flush=True)\ntime.sleep(60)"], under_run=False)
    (pid,) = target.ready_pids()
    # WHEN user nobody reads its stacks
    result = nobody.run_dynprof("stacks", "--pid", str(pid))
    # THEN it is refused as another user's, saying who may read it
    assert result.returncode == 4, result.stderr
    assert f"process {pid} belongs to another user" in result.stderr
    assert "same user as the target process, or as root" in result.stderr


def _nondumpable_target(nobody, under_run: bool) -> tuple[subprocess.Popen[str], int]:
    prog = nobody.base / "nodump_program.py"
    prog.write_text(
        "import ctypes, os, time\n"
        "ctypes.CDLL(None).prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE 0: no ptrace, even by the same user\n"
        "def guarded_loop():\n"
        "    while True:\n"
        "        time.sleep(0.05)\n"
        "print('READY', os.getpid(), flush=True)\n"
        "guarded_loop()\n"
    )
    os.chmod(prog, 0o644)
    inner = [nobody.python, str(prog)]
    argv = nobody.dynprof("run", "-q", "--", *inner) if under_run else nobody.argv(inner)
    proc = subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=nobody.full_env(), cwd=str(nobody.base)
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert line.startswith("READY"), line + proc.stdout.read()
    pid = int(line.split()[1])
    if under_run:
        deadline = time.monotonic() + 20
        while not (Path(nobody.env["DYNPROF_RUN_DIR"]) / "agents" / f"{pid}.json").exists():
            assert time.monotonic() < deadline, "the agent did not register"
            time.sleep(0.05)
    return proc, pid


def test_ptrace_refused_falls_back_to_the_agent(nobody):
    # GIVEN a process that refuses ptrace (not dumpable) but runs the dynprof agent
    proc, pid = _nondumpable_target(nobody, under_run=True)
    try:
        # WHEN its stacks are read by a user without CAP_SYS_PTRACE
        result = nobody.run_dynprof("stacks", "--pid", str(pid), "--json")
        # THEN the agent answers, and the output says why and how to fix the first method
        assert result.returncode == 0, result.stderr
        out = json.loads(result.stdout)
        (p,) = out["processes"]
        assert p["method"] == "agent"
        assert "refused" in p["fallback_reason"] and "CAP_SYS_PTRACE" in p["fallback_help"]
        assert out["groups"][0]["headline"].startswith("in guarded_loop (")
        saved = ProcessStacks.from_json(json.loads((Path(out["artifact"]) / f"pid{pid}.json").read_text()))
        assert saved.method == "agent"
    finally:
        proc.kill()
        proc.wait()


def test_ptrace_refused_without_agent_exits_11(nobody):
    # GIVEN a process that refuses ptrace and runs no agent
    proc, pid = _nondumpable_target(nobody, under_run=False)
    try:
        # WHEN its stacks are read by a user without CAP_SYS_PTRACE
        result = nobody.run_dynprof("stacks", "--pid", str(pid))
        # THEN it exits 11, saying why and how to have an agent to fall back on
        assert result.returncode == 11, result.stderr
        assert "refused" in result.stderr and "CAP_SYS_PTRACE" in result.stderr
        assert "dynprof run" in result.stderr
    finally:
        proc.kill()
        proc.wait()


def test_core_file(tmp_path, spawn, cli):
    if shutil.which("gcore") is None:
        pytest.skip("needs gcore (gdb) to write a core file")
    target = spawn(
        [
            "-c",
            "import os,time\ndef in_the_core():\n print('READY', os.getpid(), flush=True)\n"
            " time.sleep(60)\nin_the_core()",
        ],
        under_run=False,
    )
    (pid,) = target.ready_pids()
    core = tmp_path / "core"
    subprocess.run(["gcore", "-o", str(core), str(pid)], capture_output=True, timeout=120, check=True)
    result = cli("stacks", "--core", f"{core}.{pid}", "--executable", sys.executable, "--json")
    assert result.returncode == 0, result.stderr
    (group,) = json.loads(result.stdout)["groups"]
    assert group["headline"].startswith("in in_the_core (")
