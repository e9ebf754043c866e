"""`dynprof attach`: the agent started in real processes that were launched without it."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from collectors.torch_trace import profiler_steps, read_trace
from tests._ports import free_port as _free_port
from tests.support.ranks import rank_env

PROGRAM = "tests/integration/programs/attach_program.py"
ROOT = Path(__file__).resolve().parent.parent.parent

pytestmark = [
    pytest.mark.ptrace,
    pytest.mark.skipif(shutil.which("gdb") is None, reason="attach to Python < 3.14 needs gdb on PATH"),
]


def _attach(cli, *args: str, timeout: float = 120) -> tuple[subprocess.CompletedProcess[str], dict]:
    result = cli("attach", *args, "--json", timeout=timeout)
    return result, (json.loads(result.stdout) if result.stdout.strip() else {})


def _record(run_dir: Path, pid: int) -> dict | None:
    path = run_dir / "agents" / f"{pid}.json"
    return json.loads(path.read_text()) if path.exists() else None


def _iterations(artifact: str) -> list[str]:
    trace = read_trace(Path(artifact) / "trace.json.gz")
    names = {str(e.get("name", "")) for e in trace.get("traceEvents", []) if e.get("ph") == "X"}
    return sorted((n for n in names if n.startswith("iteration_")), key=lambda n: int(n.split("_")[1]))


@pytest.mark.gdb_calls
def test_plain_python_loop_attached_then_traced(spawn, cli, dynprof_dirs):
    # GIVEN a torch training loop started with plain python: no DYNPROF, no dynprof run
    target = spawn([PROGRAM, "--step-sleep", "0.005"], under_run=False)
    (pid,) = target.ready_pids()
    assert _record(dynprof_dirs["run"], pid) is None

    # WHEN dynprof attaches to it, with a `dynprof run` option
    result, out = _attach(cli, str(pid), "--hang-timeout", "30")

    # THEN the agent runs in it, registered where the CLI looks, started by attach through a
    # pending call, with the optimizer step hook in place although torch.optim was imported
    # before, and configured by the option (the hang watchdog is on)
    assert result.returncode == 0, result.stderr
    (proc,) = out["processes"]
    assert proc["status"] == "attached" and proc["method"] == "gdb-pending-call"
    assert proc["hook_installed"] is True
    assert "hang watchdog on: timeout 30 s" in Path(proc["log"]).read_text()
    record = _record(dynprof_dirs["run"], pid)
    assert record is not None and record["activation"] == "attach"
    # ... and nothing was bound in the job's __main__ nor printed into its output
    assert not [line for line in target.lines if "dynprof" in line or "Traceback" in line]

    # WHEN it is attached again
    again, out2 = _attach(cli, str(pid))
    # THEN that is a no-op that says so
    assert again.returncode == 0, again.stderr
    assert out2["processes"][0]["status"] == "already"
    plain = cli("attach", str(pid))
    assert f"pid {pid}: already has a dynprof agent (started by attach); nothing done" in plain.stderr

    # WHEN three steps are traced
    traced = cli("start", "--pid", str(pid), "--steps", "3", "--json")
    # THEN the trace holds exactly three steps of the loop
    assert traced.returncode == 0, traced.stderr
    (res,) = json.loads(traced.stdout)["results"]
    assert res["status"] == "complete"
    assert len(profiler_steps(read_trace(Path(res["artifact"]) / "trace.json.gz"))) == 3
    assert len(_iterations(res["artifact"])) >= 3
    assert target.proc.poll() is None


@pytest.mark.gdb_calls
def test_main_thread_in_sleep_uses_the_gil_state_fallback(spawn, cli, dynprof_dirs, parked):
    # GIVEN a process whose main thread sleeps in time.sleep (GIL released, no Python running),
    # for longer than any attach takes
    target = spawn([PROGRAM, "--hold", "sleep", "--hold-seconds", "240"], under_run=False)
    (pid,) = target.ready_pids()
    parked(pid)

    # WHEN dynprof attaches
    result, out = _attach(cli, str(pid), "--wait", "1")

    # THEN the bootstrap ran on the main thread under PyGILState_Ensure, and the agent answers
    assert result.returncode == 0, result.stderr
    (proc,) = out["processes"]
    assert proc["method"] == "gdb-gil-state", proc
    assert any("PyGILState_Ensure" in n for n in proc["notes"])
    ps = json.loads(cli("ps", "--json").stdout)
    assert pid in [a["pid"] for a in ps["agents"]]
    # ... and the sleep was not cut short: the job is still in it
    assert "RETURNED" not in target.lines and target.proc.poll() is None


@pytest.mark.gdb_calls
def test_gil_held_in_c_is_refused_with_the_stack_then_attaches_when_it_returns(
    spawn, cli, dynprof_dirs, parked, tmp_path
):
    # GIVEN a process whose main thread holds the GIL inside a C call until the test ends it
    release = tmp_path / "release"
    os.mkfifo(release)
    target = spawn([PROGRAM, "--hold", "gil", "--release-fifo", str(release)], under_run=False)
    (pid,) = target.ready_pids()
    parked(pid)

    # WHEN dynprof attaches
    result = cli("attach", str(pid), "--wait", "1")

    # THEN it refuses (timed out), naming the thread and where it holds the GIL
    assert result.returncode == 9, result.stderr
    assert "the main thread holds the GIL in native code" in result.stderr
    assert "in hold (" in result.stderr and "attach_program.py" in result.stderr
    assert "request stays queued" in result.stderr
    assert target.proc.poll() is None

    # WHEN the C call returns
    with open(release, "wb") as fifo:  # the target holds it open: this does not wait
        fifo.write(b"x")
    target.wait_for_line("RETURNED", timeout=60)
    deadline = time.monotonic() + 60
    while _record(dynprof_dirs["run"], pid) is None and time.monotonic() < deadline:
        time.sleep(0.1)

    # THEN the queued request ran by itself: the agent is there, and attach says so
    assert _record(dynprof_dirs["run"], pid) is not None
    again, out = _attach(cli, str(pid))
    assert again.returncode == 0 and out["processes"][0]["status"] == "already"


@pytest.mark.gdb_calls
def test_two_rank_gloo_job_attached_by_job_id_and_traced_at_the_same_step(spawn, cli, dynprof_dirs):
    # GIVEN a 2-rank gloo job started without dynprof, known only by torchrun's run id
    port = str(_free_port())
    targets = [
        spawn(
            [PROGRAM, "--dist", "--step-sleep", "0.02"],
            under_run=False,
            env=rank_env(rank, 2, port, LOCAL_RANK=str(rank), TORCHELASTIC_RUN_ID="gloojob"),
        )
        for rank in (0, 1)
    ]
    pids = [t.ready_pids(timeout=120)[0] for t in targets]

    # WHEN dynprof attaches to the job (one rank after the other: their step counters differ)
    result, out = _attach(cli, "--job", "gloojob", timeout=180)

    # THEN it found exactly the two ranks and attached both
    assert result.returncode == 0, result.stderr
    assert sorted(out["found"]) == sorted(pids)
    assert "found 2 process(es)" in result.stderr
    assert [p["status"] for p in out["processes"]] == ["attached", "attached"]

    # WHEN the job is traced
    traced = cli("start", "--job", "gloojob", "--steps", "3", "--json")

    # THEN both ranks traced the same three iterations of the loop, although their own step
    # counters (counted from each one's attach) named different steps
    assert traced.returncode == 0, traced.stderr
    results = json.loads(traced.stdout)["results"]
    assert sorted(r["rank"] for r in results) == [0, 1]
    assert results[0]["start_step"] != results[1]["start_step"], results
    iterations = [_iterations(r["artifact"]) for r in results]
    assert iterations[0] == iterations[1], iterations
    assert len(iterations[0]) >= 3


@pytest.mark.gdb_calls
def test_attach_flag_attaches_first(spawn, cli, dynprof_dirs):
    # GIVEN a plain Python process without torch
    target = spawn(["-c", "import os, time\nprint('READY', os.getpid(), flush=True)\ntime.sleep(120)"], under_run=False)
    (pid,) = target.ready_pids()
    # WHEN a command that needs an agent runs without --attach, it says how to get one
    plain = cli("memory", "--pid", str(pid))
    assert plain.returncode == 5
    assert f"dynprof attach {pid}" in plain.stderr and "--attach" in plain.stderr
    # WHEN it runs with --attach
    result = cli("memory", "--pid", str(pid), "--attach")
    # THEN the agent was attached first (and the command went on to its own verdict: no torch)
    assert f"pid {pid}: attached" in result.stderr, result.stderr
    assert result.returncode == 7, result.stderr
    assert _record(dynprof_dirs["run"], pid)["activation"] == "attach"


# -- preflight errors ---------------------------------------------------------------------------
def test_not_a_python_process_exits_10(cli):
    proc = subprocess.Popen(["sleep", "60"])
    try:
        time.sleep(0.2)
        result = cli("attach", str(proc.pid))
        assert result.returncode == 10, result.stderr
        assert "does not run CPython" in result.stderr
    finally:
        proc.kill()
        proc.wait()


def test_no_gdb_on_path_says_how_to_install_it(spawn, cli, tmp_path):
    target = spawn(["-c", "import os, time\nprint('READY', os.getpid(), flush=True)\ntime.sleep(60)"], under_run=False)
    (pid,) = target.ready_pids()
    result = cli("attach", str(pid), env={"PATH": str(tmp_path)})
    assert result.returncode == 1, result.stderr
    assert "gdb is not on PATH" in result.stderr and "apt-get install gdb" in result.stderr
    assert "3.14" in result.stderr


# -- where gdb cannot write a thread's registers (its XSAVE layout and the CPU's disagree) -------
_TICKER = "import os, time\nprint('READY', os.getpid(), flush=True)\nwhile True:\n    print('TICK', flush=True)\n    time.sleep(0.05)"
_REFUSING_GDB = """#!/bin/sh
for a in "$@"; do printf '%s\\n' "$a"; done >> "$0.args"
echo "Couldn't write extended state status: Bad address."
echo '$1 = 0'
echo '$2 = 0x0'
echo 'Cannot access memory at address 0x0'
echo '$3 = -98'
"""


def _mappings(pid: int) -> int:
    return len(Path(f"/proc/{pid}/maps").read_text().splitlines())


def _assert_refused_and_untouched(result, target, pid: int, maps_before: int, dynprof_dirs) -> None:
    assert result.returncode == 7, result.stderr
    assert f"gdb cannot write the registers of process {pid}" in result.stderr
    assert "nothing was run in the process" in result.stderr
    assert "Couldn't write extended state status" in result.stderr
    assert "dynprof run" in result.stderr and f"dynprof stacks --pid {pid}" in result.stderr
    assert "Traceback" not in result.stderr
    # THEN the target runs on, with no page mapped into it and no agent
    ticks = len([line for line in target.lines if line == "TICK"])
    target.wait_for_line("TICK", count=ticks + 3)
    assert target.proc.poll() is None
    assert _mappings(pid) == maps_before
    assert _record(dynprof_dirs["run"], pid) is None


def test_a_gdb_that_cannot_write_registers_is_asked_for_no_call_and_attach_says_why(spawn, cli, tmp_path, dynprof_dirs):
    # GIVEN a running Python process, and on PATH a gdb whose register write fails the way it
    # does where gdb and the CPU disagree on the XSAVE area's size
    target = spawn(["-c", _TICKER], under_run=False)
    (pid,) = target.ready_pids()
    fake = tmp_path / "bin" / "gdb"
    fake.parent.mkdir()
    fake.write_text(_REFUSING_GDB)
    fake.chmod(0o755)
    maps_before = _mappings(pid)

    # WHEN dynprof attaches to it with that gdb
    result = cli("attach", str(pid), "--method", "gdb", env={"PATH": f"{fake.parent}:{os.environ['PATH']}"})

    # THEN it refuses in words, with what to do instead, and the process is as it was
    _assert_refused_and_untouched(result, target, pid, maps_before, dynprof_dirs)
    # THEN gdb was asked for the register write first, and for every call only under its result
    args = (tmp_path / "bin" / "gdb.args").read_text().splitlines()
    probe = args.index("set $dynprof_regs = (($mxcsr = $mxcsr ^ 1), ($mxcsr = $mxcsr ^ 1), 1)")
    calls = [i for i, a in enumerate(args) if a.startswith("p ") and "(*)" in a]
    assert calls and all(i > probe and "$dynprof_regs == 1 ? " in args[i] for i in calls), args


@pytest.mark.gdb_calls_refused
def test_attach_refuses_where_gdb_cannot_write_registers(spawn, cli, dynprof_dirs):
    # GIVEN a machine whose gdb cannot write a thread's registers back (conftest's probe), and
    # a running Python process
    target = spawn(["-c", _TICKER], under_run=False)
    (pid,) = target.ready_pids()
    maps_before = _mappings(pid)

    # WHEN dynprof attaches to it with the real gdb
    result = cli("attach", str(pid), "--method", "gdb")

    # THEN it refuses in words before calling anything, and the process is as it was
    _assert_refused_and_untouched(result, target, pid, maps_before, dynprof_dirs)


# What the attach bootstrap does to import dynprof in the target (see dynprof.attach._bootstrap):
# its own sys.path first, then the CLI's copy appended. Run in the target's own conditions, it
# prints what that import finds, so the test checks its precondition instead of assuming it.
_IMPORT_PROBE = """
import json, sys
home = sys.argv[1]
try:
    try:
        import dynprof.agent
    except ImportError:
        sys.path.append(home)
        import dynprof.agent
    import dynprof.proto
    missing = None
except ImportError as exc:
    missing = exc.name
print(json.dumps({"executable": sys.executable, "missing": missing, "sys_path": sys.path}))
"""


@pytest.mark.gdb_calls
def test_dynprof_not_importable_in_the_target_names_its_python(tmp_path):
    # GIVEN a CLI that runs its own copy of dynprof from a directory holding nothing else (the
    # bootstrap appends that directory to the target's sys.path), and a target Python started
    # isolated (-I: no PYTHON* variables, no user site, no current directory; -S: no
    # site-packages and no .pth, so no editable install), so that protobuf is importable in the
    # target from nowhere, whatever this machine has installed
    home = tmp_path / "home"
    shutil.copytree(ROOT / "dynprof", home / "dynprof", ignore=shutil.ignore_patterns("__pycache__"))
    work = tmp_path / "target-cwd"
    work.mkdir()
    isolated = [sys.executable, "-I", "-S"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    probe = subprocess.run(
        [*isolated, "-c", _IMPORT_PROBE, str(home.resolve())],
        capture_output=True,
        text=True,
        env=env,
        cwd=str(work),
        timeout=120,
    )
    assert probe.returncode == 0, probe.stderr
    found = json.loads(probe.stdout)
    assert found["missing"] == "google", f"precondition: the target must lack protobuf, it found: {found}"
    target_python = found["executable"]
    proc = subprocess.Popen(
        [*isolated, "-c", "import os, time\nprint('READY', os.getpid(), flush=True)\ntime.sleep(120)"],
        stdout=subprocess.PIPE,
        text=True,
        env=env,
        cwd=str(work),
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline().startswith("READY")

        # WHEN that CLI attaches to it
        cli_env = dict(os.environ)
        cli_env["PYTHONPATH"] = os.pathsep.join(p for p in (str(home), os.environ.get("PYTHONPATH", "")) if p)
        result = subprocess.run(
            [sys.executable, "-m", "dynprof", "attach", str(proc.pid)],
            capture_output=True,
            text=True,
            env=cli_env,
            cwd=str(home),
            timeout=120,
        )

        # THEN it fails with exit code 7, naming the target's Python, what it lacks and the
        # install command for that Python; and it says it tried the CLI's own copy
        assert result.returncode == 7, result.stdout + result.stderr
        assert "cannot import dynprof" in result.stderr
        assert f"its Python: {target_python}" in result.stderr
        assert f"{target_python} -m pip install protobuf" in result.stderr
        assert f"this CLI's copy, {home.resolve()}," in result.stderr
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.gdb_calls
def test_target_exiting_during_attach_exits_3(spawn, dynprof_dirs):
    # GIVEN a process whose main thread sleeps, and an attach that waits long for it (where gdb
    # cannot write registers, attach refuses at its first probe, exit 7, before the target exits:
    # that refusal has its own test)
    target = spawn(["-c", "import os, time\nprint('READY', os.getpid(), flush=True)\ntime.sleep(60)"], under_run=False)
    (pid,) = target.ready_pids()
    attach = subprocess.Popen(
        [sys.executable, "-m", "dynprof", "attach", str(pid), "--wait", "60"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=str(ROOT),
    )
    try:
        # WHEN the target exits while attach is under way
        work = dynprof_dirs["run"] / "attach"
        deadline = time.monotonic() + 60
        while not (work.exists() and any(work.iterdir())) and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.5)
        os.kill(pid, signal.SIGKILL)
        _, err = attach.communicate(timeout=60)
        # THEN attach says so, with exit code 3
        assert attach.returncode == 3, err
        assert f"process {pid} exited during attach" in err
    finally:
        if attach.poll() is None:
            attach.kill()
            attach.wait()


# -- other users, ptrace refused (root acting as nobody: tests/support/other_user.py) -------------
def _start_as_nobody(nobody, code: str) -> tuple[subprocess.Popen[str], int]:
    prog = nobody.base / "nobody_program.py"
    prog.write_text(code + "\nimport os, time\nprint('READY', os.getpid(), flush=True)\ntime.sleep(60)\n")
    os.chmod(prog, 0o644)
    proc = subprocess.Popen(
        nobody.argv([nobody.python, str(prog)]),
        stdout=subprocess.PIPE,
        text=True,
        env=nobody.full_env(),
        cwd=str(nobody.base),
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert line.startswith("READY"), line
    return proc, int(line.split()[1])


def test_another_users_process_exits_4(nobody, cli):
    # GIVEN a Python process of user nobody
    proc, pid = _start_as_nobody(nobody, "")
    try:
        # WHEN root attaches to it
        result = cli("attach", str(pid))
        # THEN it refuses: the agent's socket and records would belong to the wrong user
        assert result.returncode == 4, result.stderr
        assert f"process {pid} belongs to user nobody" in result.stderr
        assert f"sudo -u nobody dynprof attach {pid}" in result.stderr
    finally:
        proc.kill()
        proc.wait()


def test_ptrace_refused_exits_11_and_names_the_settings(nobody):
    # GIVEN a process of nobody that made itself non-dumpable (ptrace refused, even to its user)
    code = "import ctypes\nctypes.CDLL(None).prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE 0"
    proc, pid = _start_as_nobody(nobody, code)
    try:
        # WHEN nobody, without CAP_SYS_PTRACE, attaches to it
        result = nobody.run_dynprof("attach", str(pid))
        # THEN it exits 11, naming the sysctl and the Kubernetes securityContext line
        assert result.returncode == 11, result.stderr
        assert "ptrace of process" in result.stderr and "refused" in result.stderr
        assert "kernel.yama.ptrace_scope" in result.stderr
        assert "capabilities: {add: [SYS_PTRACE]}" in result.stderr
    finally:
        proc.kill()
        proc.wait()
