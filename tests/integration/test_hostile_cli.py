"""Every subcommand against hostile input: extreme numbers, nan/inf, huge and odd strings, missing
files, directories, FIFOs and devices in place of files, dead, foreign and special pids.

The rule: a clean message and a documented exit code, never a traceback and never a hang.
Most cases run in-process through ``main([...])`` (fast); the ones that need a real pipe, a
zombie or another user run as real processes.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path

import pytest

from dynprof.cli import COMMANDS, main
from dynprof.store import ArtifactStore
from tests.support.other_user import as_nobody, needs_root
from tests.support.records import record_doc

ROOT = Path(__file__).resolve().parents[2]
# README "Exit codes" (0-11, 130 after Ctrl-C); healthcheck: 0 healthy .. 3 could not run.
DOCUMENTED = set(range(12)) | {130}
HEALTHCHECK_DOCUMENTED = {0, 1, 2, 3}


def _run_main(argv: list[str]) -> tuple[int | None, str, str]:
    """(exit code, stdout, stderr) of ``main(argv)``; an escaping exception is a traceback."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code: int | None = main(argv)
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        except BaseException:
            err.write(traceback.format_exc())
            code = None
    return code, out.getvalue(), err.getvalue()


def _fixtures(tmp: Path) -> dict[str, object]:
    junk = tmp / "junk.bin"
    junk.write_bytes(os.urandom(4096))
    empty = tmp / "empty"
    empty.write_bytes(b"")
    array = tmp / "array.json"
    array.write_text('[1, 2, {"a": null}]')
    deep = tmp / "deep.json"
    deep.write_text("[" * 100_000 + "]" * 100_000)
    loop = tmp / "loop"
    loop.symlink_to(loop)
    fifo = tmp / "fifo"
    os.mkfifo(fifo)
    a_dir = tmp / "a-dir"
    a_dir.mkdir()
    child = subprocess.Popen(["true"])
    child.wait()
    return {
        "junk": str(junk),
        "array": str(array),
        "numbers": [
            "nan",
            "inf",
            "-inf",
            "-1",
            "0",
            "1e309",
            "4294967296",
            str(2**64),
            "2**64",
            "9" * 5000,
            "0x10",
            "",
            " ",
            "\x1b[2J",
            "\udcff",
            "1" * 400 + ".5",
        ],
        "pids": ["0", "-1", "1", str(child.pid), "4194305", str(2**64), "abc", "1,,", ",", "9" * 5000],
        "strings": ["", "x" * 5000, "\x1b[31mred", "../../etc", "a\nb", "\udcff", "\x00", "-"],
        "inputs": [
            "/nonexistent/x",
            "/",
            "/dev/zero",
            str(fifo),
            str(a_dir),
            "/dev/null",
            str(junk),
            str(empty),
            str(array),
            str(deep),
            str(loop),
            "/proc/self/mem",
            "\x00",
            "x" * 5000,
        ],
        "outputs": [
            "/nonexistent/x",
            "/",
            str(a_dir),
            "/proc/self/mem",
            "\x00",
            "x" * 5000,
            str(tmp / ("y" * 300)),
            str(tmp / "out.file"),
        ],
    }


def hostile_cases(tmp: Path) -> list[list[str]]:
    f = _fixtures(tmp)
    numbers, pids, strings = f["numbers"], f["pids"], f["strings"]
    inputs, outputs = f["inputs"], f["outputs"]
    junk, array = f["junk"], f["array"]
    assert isinstance(numbers, list) and isinstance(pids, list) and isinstance(strings, list)
    assert isinstance(inputs, list) and isinstance(outputs, list)
    assert isinstance(junk, str) and isinstance(array, str)
    nowhere = "/nonexistent-command-xyz"  # `run` must never reach exec in-process
    cases: list[list[str]] = []
    for sub in ("start", "stop", "stacks", "nccl", "memory"):
        cases += [[sub, "--pid", p] for p in pids]
        cases += [[sub, "--pid", str(os.getpid())]]
        cases += [[sub, "--job", s] for s in strings]
        cases += [[sub, "--all"], [sub], [sub, "--pid", "1", "--job", "j"]]
    for v in numbers:
        for opt in ("--steps", "--duration", "--max-duration", "--at-step", "--timeout"):
            cases.append(["start", "--all", opt, v])
        cases += [
            ["stop", "--all", "--timeout", v],
            ["stacks", "--all", "--timeout", v],
            ["nccl", "--all", "--timeout", v],
            ["memory", "--all", "--timeout", v],
            ["memory", "--all", "--history-start", v],
            ["ps", "--timeout", v],
            ["ls", "--limit", v],
            ["memory-report", junk, "--top", v],
            ["serve", "--port", v],
        ]
        for opt in (
            "--timeout-scale",
            "--min-disk-gib",
            "--xid-window",
            "--expect-devices",
            "--fail-below",
            "--warn-below",
            "--peer-fail",
            "--peer-warn",
        ):
            cases.append(["healthcheck", "--no-save", opt, v])
        for opt in (
            "--hang-timeout",
            "--hang-first-step-timeout",
            "--memory-oom-interval",
            "--memory-oom-max",
            "--flight-recorder",
            "--host-memory-fraction",
            "--memory-history",
            "--host-memory-limit",
        ):
            cases.append(["run", opt, v, "--", nowhere])
    for s in strings:
        cases += [
            ["show", s],
            ["ps", "--job", s],
            ["ls", "--job", s],
            ["ls", "--kind", s],
            ["start", "--all", "--activities", s],
            ["run", "--job-id", s, "--", nowhere],
            ["healthcheck", "--no-save", "--skip", s],
            ["healthcheck", "--no-save", "--backend", "smi", "--smi-tool", s],
            ["serve", "--host", s],
        ]
    for path in inputs:
        cases += [
            ["memory-report", path, "--no-html"],
            ["stacks", "--core", path],
            ["stacks", "--core", junk, "--executable", path],
            ["healthcheck", "--no-save", "--baseline", path],
            ["healthcheck", "--no-save", "--disk", path],
        ]
        cases += [["show", path], ["show", path, "--verify"]]
        if path != "/":  # learning from the whole filesystem is slow, not wrong
            cases.append(["healthcheck", "baseline", "learn", path])
    for path in ("/nonexistent/x", "\x00", "x" * 5000, "/dev/zero", str(tmp / "fifo"), str(tmp), junk):
        cases.append(["serve", "--token-file", path])  # each refused before anything listens
    for path in outputs:
        cases += [
            ["memory-report", junk, "-o", path],
            ["memory-report", junk, "--torch-viz", path],
            ["healthcheck", "--no-save", "--prometheus", path],
            ["healthcheck", "baseline", "learn", array, "-o", path],
        ]
    cases += [["run"], ["run", "--"], ["run", "--", ""], ["run", "--", "/"], ["run", "--", junk]]
    cases += [["no-such-command"], [], ["--version"], ["--help"]]
    for name, _, _ in COMMANDS:
        cases += [[name, "--no-such-flag"], [name, "--help"], [name, "\x1b[2J"]]
    return cases


def test_every_subcommand_survives_hostile_arguments(tmp_path, dynprof_dirs):
    # GIVEN some artifacts in the store, and ~900 hostile command lines over every subcommand
    for rank in range(3):
        writer = ArtifactStore().create("trace", job="\x1b[31mjob", rank=rank)
        writer.write_text("x.txt", "data")
        writer.finish("complete")
    cases = hostile_cases(tmp_path)
    assert {c[0] for c in cases if c} >= {name for name, _, _ in COMMANDS}

    # WHEN each runs
    bad = []
    slow = []
    for argv in cases:
        t0 = time.monotonic()
        code, out, err = _run_main(argv)
        took = time.monotonic() - t0
        allowed = HEALTHCHECK_DOCUMENTED if argv[:1] == ["healthcheck"] else DOCUMENTED
        if code is None or "Traceback" in out + err or code not in allowed:
            bad.append(f"{[a[:40] for a in argv]}: exit {code}\n{(out + err)[-1500:]}")
        if took > 30:
            slow.append(f"{[a[:40] for a in argv]}: {took:.0f} s")

    # THEN none shows a traceback or an undocumented exit code, and none hangs
    print(f"\nhostile CLI inputs tried: {len(cases)}; failures: {len(bad)}")
    assert not bad, f"{len(bad)} of {len(cases)} hostile inputs failed:\n" + "\n".join(bad[:15])
    assert not slow, slow


@pytest.mark.parametrize(
    "argv,code",
    [
        (["start", "--pid", "1", "--duration", "inf"], 2),
        (["start", "--pid", "1", "--max-duration", "1e12"], 2),
        (["start", "--pid", "1", "--steps", "4294967296"], 2),
        (["start", "--pid", "1", "--at-step", str(2**64)], 2),
        (["serve", "--port", "99999"], 2),
        (["serve", "--port", "-1"], 2),
        (["healthcheck", "--timeout-scale", "0"], 3),
        (["healthcheck", "--timeout-scale", "-1"], 3),
        (["healthcheck", "--timeout-scale", "nan"], 3),
        (["healthcheck", "--timeout-scale", "inf"], 3),
        (["healthcheck", "--min-disk-gib", "-5"], 3),
        (["healthcheck", "--min-disk-gib", "nan"], 3),
        (["healthcheck", "--xid-window", "-1"], 3),
        (["healthcheck", "--prometheus", "/nonexistent/x.prom"], 3),
    ],
)
def test_out_of_range_arguments_are_usage_errors_naming_the_option(argv, code):
    # WHEN a number out of range (or an impossible output file) is given
    got, _, err = _run_main(argv)
    # THEN it is refused before anything runs, with the option named
    assert got == code, err
    option = next(a for a in argv if a.startswith("--") and a not in ("--pid",))
    assert f"argument {option}:" in err and "Traceback" not in err


def test_healthcheck_module_entry_point_refuses_a_missing_prometheus_directory():
    result = subprocess.run(
        [sys.executable, "-m", "healthcheck", "--no-save", "--prometheus", "/nonexistent/x.prom"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=str(ROOT),
    )
    assert result.returncode == 3
    assert "directory /nonexistent does not exist" in result.stderr and "Traceback" not in result.stderr


def test_a_closed_pipe_ends_ls_quietly(dynprof_dirs):
    # GIVEN a store whose `ls` output is larger than a pipe's buffer (64 KiB): the writer blocks
    # until the reader goes away, so it surely meets the closed pipe (one wide cell widens all rows)
    for rank in range(250):
        ArtifactStore().create("trace", job="j", rank=rank).finish("complete")
    ArtifactStore().create("k" * 200, job="j", rank=0).finish("complete")
    # WHEN the reader takes one line and goes away (`dynprof ls | head -1`)
    proc = subprocess.Popen(
        [sys.executable, "-m", "dynprof", "ls"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        cwd=str(ROOT),
    )
    assert proc.stdout is not None and proc.stderr is not None
    first = proc.stdout.readline()
    proc.stdout.close()
    err = proc.stderr.read().decode()
    code = proc.wait(timeout=60)
    # THEN the command ends quietly with 0
    assert first.startswith(b"ID")
    assert code == 0, err
    assert "Traceback" not in err and "BrokenPipe" not in err and "Exception ignored" not in err


def test_a_run_dir_that_is_a_file_is_a_clear_error(tmp_path, monkeypatch, capsys):
    # GIVEN DYNPROF_RUN_DIR naming a file, or a path under a file
    blocker = tmp_path / "file"
    blocker.write_text("")
    for run_dir in (blocker, blocker / "sub"):
        monkeypatch.setenv("DYNPROF_RUN_DIR", str(run_dir))
        # WHEN commands that use it run (run stops before starting the job: a real process, as
        # in-process it would replace the test runner were it to start the job)
        for argv in (["ps"], ["start", "--all", "--steps", "1"]):
            code = main(argv)
            err = capsys.readouterr().err
            # THEN a clear error, exit 1
            assert code == 1, (argv, err)
            assert f"cannot use {run_dir} as a dynprof runtime directory" in err
        ran = _cli("run", "--", sys.executable, "-c", "print('job ran')")
        assert ran.returncode == 1 and "job ran" not in ran.stdout, ran.stdout + ran.stderr
        assert f"cannot use {run_dir} as a dynprof runtime directory" in ran.stderr


def test_a_run_dir_too_long_for_a_socket_is_said_before_the_job_starts(monkeypatch):
    long_dir = "/tmp/" + "d" * 110
    monkeypatch.setenv("DYNPROF_RUN_DIR", long_dir)
    try:
        ran = _cli("run", "--", sys.executable, "-c", "print('job ran')")
    finally:
        import shutil

        shutil.rmtree(long_dir, ignore_errors=True)
    assert ran.returncode == 1 and "job ran" not in ran.stdout
    assert "too long a path for the agents' sockets" in ran.stderr and "Traceback" not in ran.stderr


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "dynprof", *args], capture_output=True, text=True, timeout=60, cwd=str(ROOT)
    )


def test_stacks_of_a_zombie_says_it_has_exited(capsys):
    # GIVEN a child that exited and was not reaped
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            with open(f"/proc/{child.pid}/stat", "rb") as fh:
                if fh.read().rsplit(b")", 1)[1].split()[0] == b"Z":
                    break
            time.sleep(0.05)
        # WHEN its stacks are asked for
        code = main(["stacks", "--pid", str(child.pid), "--no-save"])
        err = capsys.readouterr().err
    finally:
        child.wait()
    # THEN it is "no such process" (3), named a zombie, not "not a Python process"
    assert code == 3, err
    assert "zombie" in err and "not a Python process" not in err


def test_a_target_exiting_while_its_stacks_are_read_is_exit_3(monkeypatch, capsys):
    from collectors.stacks import readers

    # GIVEN a process that exits while the reader works on it
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])

    def reader_sees_it_exit(pid, **_):
        child.kill()
        child.wait()
        raise readers.CaptureError(
            "py-spy", "Failed to get process executable name. Check that the process is running."
        )

    monkeypatch.setattr(readers, "capture_py_spy", reader_sees_it_exit)
    monkeypatch.setattr(readers, "capture_pystack", reader_sees_it_exit)
    monkeypatch.setattr(readers, "ptrace_refusal", lambda pid: None)
    try:
        # WHEN its stacks are read
        code = main(["stacks", "--pid", str(child.pid), "--no-save"])
        err = capsys.readouterr().err
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    # THEN exit 3 with a message that says so, not the reader's raw error with exit 1
    assert code == 3, err
    assert f"process {child.pid} has exited while its stacks were being read" in err


def _write_record(run_dir: Path, pid: int, **fields: object) -> None:
    agents = run_dir / "agents"
    agents.mkdir(mode=0o700, exist_ok=True)
    record = record_doc(
        pid,
        ppid=os.getppid(),
        job_id="job",
        cmdline=["python", "train.py"],
        started_at=time.time(),
        socket=str(agents / f"{pid}.sock"),
    )
    record.update(fields)
    (agents / f"{pid}.json").write_text(json.dumps(record))


def test_ps_escapes_control_characters_and_exits_8_on_an_agent_error(dynprof_dirs, capsys):
    # GIVEN a record (of a live process whose agent socket is dead) with escapes in its job and
    # command line, and damaged records beside it
    _write_record(
        dynprof_dirs["run"],
        os.getpid(),
        job_id="\x1b[31mEVIL\x1b[0m",
        cmdline=["\x1b]0;owned\x07python", "\u202etxt.exe", "\udcff"],
    )
    agents = dynprof_dirs["run"] / "agents"
    (agents / "1.json").write_text("[1, 2]")
    (agents / "2.json").write_text(json.dumps({"pid": "2", "cmdline": 5}))
    (agents / "3.json").write_text("[" * 100_000)

    # WHEN ps lists the agents
    code = main(["ps"])
    out, err = capsys.readouterr()

    # THEN nothing reaches the terminal raw, the agent's error is said, and the exit code is 8
    assert code == 8, err
    assert "\x1b" not in out and "\x07" not in out and "\u202e" not in out
    assert "\\x1b[31mEVIL\\x1b[0m" in out and "\\u202e" in out
    assert f"agent of pid {os.getpid()}" in err and "Traceback" not in out + err
    # AND --json carries the same rows, escaped by JSON itself
    assert main(["ps", "--json"]) == 8
    rows = json.loads(capsys.readouterr().out)["agents"]
    assert [r["state"] for r in rows] == ["error"] and rows[0]["job"] == "\x1b[31mEVIL\x1b[0m"


def test_ls_escapes_control_characters_from_manifests(dynprof_dirs, capsys):
    ArtifactStore().create("trace", job="j", rank=0).finish("complete")
    manifest = next(dynprof_dirs["artifacts"].rglob("manifest.json"))
    data = json.loads(manifest.read_text())
    data["kind"] = "\x1b[2Jtrace"
    manifest.write_text(json.dumps(data))
    code = main(["ls"])
    out = capsys.readouterr().out
    assert code == 0 and "\x1b" not in out and "\\x1b[2Jtrace" in out


@needs_root
def test_commands_on_another_users_process_fail_cleanly(monkeypatch):
    import shutil
    import tempfile

    # GIVEN a process of ours (root), and the nobody user with directories of its own
    target = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    nobody_dir = Path(tempfile.mkdtemp(prefix="dp-nobody-", dir="/tmp"))
    os.chown(nobody_dir, 65534, 65534)
    monkeypatch.setenv("DYNPROF_RUN_DIR", str(nobody_dir / "run"))
    monkeypatch.setenv("DYNPROF_ARTIFACT_DIR", str(nobody_dir / "artifacts"))
    pid = str(target.pid)
    cases = [
        ["start", "--pid", pid, "--steps", "2"],
        ["stop", "--pid", pid],
        ["stacks", "--pid", pid, "--no-save"],
        ["stacks", "--pid", pid, "--no-save", "--method", "agent"],
        ["nccl", "--pid", pid],
        ["memory", "--pid", pid],
        ["stacks", "--pid", "1", "--no-save"],
    ]
    try:
        # WHEN nobody points each command at it
        results = [(argv, *as_nobody(lambda argv=argv: main(argv))) for argv in cases]
    finally:
        target.kill()
        target.wait()
        shutil.rmtree(nobody_dir, ignore_errors=True)
    # THEN each is refused as "permission denied" (4, or 11 for reading from outside), cleanly
    for argv, code, output in results:
        assert code in (4, 11), (argv, code, output)
        assert "Traceback" not in output and "belongs to another user" in output, (argv, output)


def test_a_healthcheck_cut_short_by_a_closed_pipe_never_reads_healthy(monkeypatch):
    from healthcheck import cli as hc_cli

    # GIVEN a reader that goes away before the verdict is printed
    def broken_pipe(args):
        raise BrokenPipeError(32, "Broken pipe")

    monkeypatch.setattr(hc_cli, "run_command", broken_pipe)
    # WHEN the healthcheck runs, through dynprof or on its own
    # THEN it says "could not run" (3), never "healthy" (0), and shows no traceback
    assert _run_main(["healthcheck", "--no-save"])[0] == 3
    with contextlib.redirect_stdout(io.StringIO()):  # not pytest's capture file: it would be silenced
        assert hc_cli.main(["--no-save"]) == 3


def test_stacks_output_escapes_what_the_target_names(monkeypatch, capsys):
    from collectors.stacks import Frame, ProcessStacks, ThreadStack, readers

    # GIVEN a target whose thread and file names carry terminal escapes
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])

    def read(pid, **_):
        frame = Frame(function="run\x1b[2J", file="/tmp/\x1b]0;owned\x07evil.py", line=3)
        thread = ThreadStack(tid=pid, name="\x1b[31mworker", main=True, frames=[frame])
        return ProcessStacks(pid=pid, method="py-spy", threads=[thread])

    monkeypatch.setattr(readers, "capture_py_spy", read)
    monkeypatch.setattr(readers, "ptrace_refusal", lambda pid: None)
    try:
        # WHEN its stacks are printed, every thread in full
        code = main(["stacks", "--pid", str(child.pid), "--no-save", "--full"])
        out = capsys.readouterr().out
    finally:
        child.kill()
        child.wait()
    # THEN the escapes are shown as text, never sent raw
    assert code == 0
    assert "\x1b" not in out and "\x07" not in out
    assert "run\\x1b[2J" in out
