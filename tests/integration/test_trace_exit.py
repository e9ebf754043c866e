"""A trace that the job's exit overtakes: flushed, waited for (bounded), and always accounted for."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from collectors.torch_trace import profiler_steps, read_trace

ROOT = Path(__file__).resolve().parents[2]
PROGRAM = "tests/integration/programs/exit_while_writing_program.py"
TRAIN = "tests/integration/programs/train_program.py"


def _connected(pid: int, timeout: float) -> bool:
    """Whether process ``pid`` (a dynprof command) opened a socket (to an agent) within
    ``timeout``: the command opens none before it asks one."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            links = [os.readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd")]
        except OSError:  # an fd closed meanwhile, or the command ended
            links = []
            if not os.path.exists(f"/proc/{pid}"):
                return False
        if any(link.startswith("socket:") for link in links):
            return True
        time.sleep(0.02)
    return False


def _dynprof_lines(target) -> list[str]:
    return [line for line in target.lines if line.startswith("dynprof:")]


def _trace_artifacts(cli) -> list[dict]:
    return json.loads(cli("ls", "--kind", "trace", "--json").stdout)["artifacts"]


def _wait_for_state(cli, pid: int, state: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        agents = json.loads(cli("ps", "--json").stdout)["agents"]
        if any(a["pid"] == pid and a["state"] == state for a in agents):
            return
        time.sleep(0.05)
    raise AssertionError(f"process {pid} never reached trace state {state!r}")


def _exit_mid_trace(target, cli, *start_args: str) -> int:
    """Start a trace of ``target``'s ready process (``dynprof start --no-wait START_ARGS``) and
    wait for the job's exit; the process's pid."""
    (pid,) = target.ready_pids()
    assert cli("start", "--pid", str(pid), *start_args, "--no-wait").returncode == 0
    target.wait_for_line("EXITING", timeout=60)
    target.proc.wait(timeout=120)
    return pid


def test_a_write_longer_than_the_exit_wait_leaves_a_failed_artifact_and_says_so(spawn, cli, tmp_path):
    # GIVEN a loop that exits mid-trace, whose trace takes longer to write than the exit waits
    target = spawn([PROGRAM, "--release-file", str(tmp_path / "never")], env={"DYNPROF_TRACE_EXIT_WAIT_S": "1"})

    # WHEN the job exits
    pid = _exit_mid_trace(target, cli)

    # THEN the store holds a failed artifact that says why
    (listed,) = _trace_artifacts(cli)
    assert listed["status"] == "failed"
    manifest = json.loads((Path(listed["path"]) / "manifest.json").read_text())
    assert manifest["pid"] == pid
    assert "had not finished after 1 s" in manifest["error"]
    assert "DYNPROF_TRACE_EXIT_WAIT_S" in manifest["error"]
    assert [f["name"] for f in manifest["files"]] == []  # no half-written trace file listed
    # AND the job's output says so in one line, naming the artifact
    (line,) = _dynprof_lines(target)
    assert line.startswith("dynprof: warning: the job exited before its trace was written (not finished after 1 s)")
    assert listed["path"] in line
    # AND no temporary directory of the write is left in the store
    kind_dir = Path(listed["path"]).parent
    assert [p.name for p in kind_dir.iterdir()] == [Path(listed["path"]).name]


def test_a_write_cut_off_by_the_exit_leaves_no_temporary_file_behind(spawn, cli, tmp_path):
    # GIVEN a loop that exits mid-trace, whose trace write is cut off by the exit after torch
    # wrote the uncompressed trace and before it was compressed
    job_tmp = tmp_path / "job-tmp"
    job_tmp.mkdir()
    target = spawn(
        [PROGRAM, "--release-file", str(tmp_path / "never"), "--hold-in", "torch-write"],
        env={"DYNPROF_TRACE_EXIT_WAIT_S": "1", "TMPDIR": str(job_tmp)},
    )

    # WHEN the job exits
    _exit_mid_trace(target, cli)

    # THEN the store holds a failed artifact with its manifest alone
    (listed,) = _trace_artifacts(cli)
    assert listed["status"] == "failed"
    assert [p.name for p in Path(listed["path"]).iterdir()] == ["manifest.json"]
    # AND the job's temporary directory holds no file of the write (torch's own cache
    # directories, such as torchinductor_USER, are no concern here)
    assert [p.name for p in job_tmp.iterdir() if not p.is_dir()] == []


def test_a_finished_trace_still_being_written_when_the_job_exits_is_not_lost(spawn, cli, tmp_path):
    # GIVEN a trace of 2 steps that ended by itself, whose write outlasts the exit's wait
    target = spawn(
        [PROGRAM, "--release-file", str(tmp_path / "never"), "--exit-on", "exporting"],
        env={"DYNPROF_TRACE_EXIT_WAIT_S": "1"},
    )

    # WHEN the job exits while the trace is being written
    _exit_mid_trace(target, cli, "--steps", "2")

    # THEN the store holds a failed artifact that says why, and one line of the output says so
    (listed,) = _trace_artifacts(cli)
    assert listed["status"] == "failed"
    manifest = json.loads((Path(listed["path"]) / "manifest.json").read_text())
    assert "the job exited while this trace was being written" in manifest["error"]
    (line,) = _dynprof_lines(target)
    assert line.startswith("dynprof: warning: the job exited before its trace was written")
    assert listed["path"] in line


def test_a_trace_written_at_exit_is_named_on_the_jobs_stderr(spawn, cli, tmp_path):
    # GIVEN a loop that exits mid-trace, whose trace is written within the exit's wait
    release = tmp_path / "release"
    release.write_text("go\n")
    target = spawn([PROGRAM, "--release-file", str(release)])
    (pid,) = target.ready_pids()
    # (start waits for the trace to be active; the job traces 3 steps and exits, often between
    # two of start's looks: start then names the trace the exit wrote, never "no agent")
    started = cli("start", "--pid", str(pid), "--json")
    assert started.returncode == 0, started.stdout + started.stderr

    # WHEN the job exits
    target.wait_for_line("EXITING", timeout=60)
    target.proc.wait(timeout=120)

    # THEN the partial trace is in the store, and one line of the job's output names it
    (listed,) = _trace_artifacts(cli)
    doc = json.loads(started.stdout)
    assert [r["artifact"] for r in doc.get("results", [])] in ([], [listed["path"]]), doc
    assert listed["status"] == "partial"
    assert len(profiler_steps(read_trace(Path(listed["path"]) / "trace.json.gz"))) >= 1
    assert _dynprof_lines(target) == [f"dynprof: trace written at exit (partial): {listed['path']}"]


def test_stop_during_the_jobs_exit_says_where_the_trace_is_being_written(spawn, cli, tmp_path):
    # GIVEN a traced loop that has exited its training loop, its exit hook writing the trace
    release = tmp_path / "release"
    target = spawn([PROGRAM, "--release-file", str(release)])
    (pid,) = target.ready_pids()
    assert cli("start", "--pid", str(pid)).returncode == 0
    target.wait_for_line("EXITING", timeout=60)
    _wait_for_state(cli, pid, "exporting")

    # WHEN the trace is stopped without waiting
    quick = cli("stop", "--pid", str(pid), "--no-wait", "--json")

    # THEN stop succeeds and says the trace is being written at exit, and where
    assert quick.returncode == 0, quick.stdout + quick.stderr
    (res,) = json.loads(quick.stdout)["results"]
    assert res["status"] == "writing-at-exit"
    where = res["artifact"]
    assert where
    assert f"pid {pid}: the job is exiting and its trace is being written at exit to {where}" in quick.stderr

    # WHEN it is stopped again, waiting, and the write then finishes (once that stop has
    # reached the agent: a loaded machine may take seconds to start the command)
    waiting = subprocess.Popen(
        [sys.executable, "-m", "dynprof", "stop", "--pid", str(pid)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=str(ROOT),
    )
    try:
        assert _connected(waiting.pid, timeout=60), "the waiting stop never connected to the agent"
        release.write_text("go\n")
        out, err = waiting.communicate(timeout=120)
    finally:
        if waiting.poll() is None:
            waiting.kill()
            waiting.communicate()
    waited = subprocess.CompletedProcess(waiting.args, waiting.returncode, out, err)

    # THEN it names the partial trace, written where it said
    assert waited.returncode == 0, waited.stdout + waited.stderr
    assert "being written at exit" in waited.stderr
    assert waited.stdout.strip() == f"pid {pid}: partial: {where}"
    target.proc.wait(timeout=60)
    manifest = json.loads((Path(where) / "manifest.json").read_text())
    assert manifest["status"] == "partial"
    assert manifest["summary"]["stopped_by"] == "exit"


def test_stop_without_a_trace_names_the_process_once(spawn, cli):
    # GIVEN a loop that is not traced
    target = spawn([TRAIN, "--step-sleep", "0.01"])
    (pid,) = target.ready_pids()

    # WHEN it is stopped
    result = cli("stop", "--pid", str(pid))

    # THEN the one line says so, with the pid once
    assert result.returncode == 1
    assert result.stdout.strip() == f"pid {pid}: no trace is running [NOT_RUNNING]"


def test_spans_past_the_described_ones_are_counted_not_lumped_into_the_last(spawn, cli, tmp_path):
    # GIVEN a loop of short optimizer-only steps that exits after 10 005 traced steps
    release = tmp_path / "release"
    release.write_text("go\n")
    target = spawn([PROGRAM, "--release-file", str(release), "--optimizer-only", "--steps-after-trace", "10005"])
    (pid,) = target.ready_pids()
    assert cli("start", "--pid", str(pid)).returncode == 0

    # WHEN it exits mid-trace, after more spans than the manifest describes one by one
    target.wait_for_line("EXITING", timeout=300)
    target.proc.wait(timeout=300)

    # THEN the first 10 000 spans are described (one optimizer step each), and the rest counted
    (listed,) = _trace_artifacts(cli)
    assert listed["status"] == "partial"
    summary = json.loads((Path(listed["path"]) / "manifest.json").read_text())["summary"]
    per_span = summary["optimizer_steps_per_span"]
    assert len(per_span) == 10_000
    assert set(per_span) == {1}
    omitted = summary["optimizer_steps_per_span_omitted"]
    assert omitted >= 5
    spans = profiler_steps(read_trace(Path(listed["path"]) / "trace.json.gz"))
    assert len(per_span) + omitted == len(spans)
