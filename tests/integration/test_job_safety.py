"""The job comes first: captures never crash, stall or pollute a healthy training job.

Each test puts dynprof's profiler control where torch cannot support it (inside backward, next
to the job's own profiler, across optimizer re-creation) and checks that the job lives on, its
output holds only its own lines and dynprof's prefixed ones, and its losses are unchanged.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

from collectors.torch_trace import profiler_steps, read_trace
from dynprof.agent._trace import ALIGN_DURATION_MAX_STEP_S

ROOT = Path(__file__).resolve().parents[2]
PROGRAM = "tests/integration/programs/safety_program.py"
JOB_LINE = re.compile(r"^(READY \d+|LOSS \d+ \S+|JOBTRACE \d+|DONE \d+)$")


def _foreign_lines(lines: list[str]) -> list[str]:
    """Output lines that neither the job nor dynprof's prefixed warnings wrote."""
    return [line for line in lines if line and not JOB_LINE.match(line) and not line.startswith("dynprof: ")]


def _alive(target) -> bool:
    return target.proc.poll() is None


def _agent_log(dynprof_dirs, pid: int) -> str:
    path = dynprof_dirs["run"] / "logs" / f"{pid}.log"
    return path.read_text() if path.exists() else ""


def _result(stdout: str) -> dict:
    (res,) = json.loads(stdout)["results"]
    return res


def _trace_steps(res: dict) -> list[int]:
    steps = profiler_steps(read_trace(Path(res["artifact"]) / "trace.json.gz"))
    return [int(s["name"].split("#")[1]) for s in steps]


def test_duration_traces_of_a_checkpointing_loop_start_and_stop_outside_backward(spawn, cli, dynprof_dirs):
    # GIVEN activation checkpointing, each block's backward also sleeping 10 ms in Python: most
    # of every step is backward, and a step (over 160 ms) is longer than the 0.1 s a --duration
    # trace waits for a step boundary, so its start and stop come at arbitrary moments on any
    # machine (on a fast one, 27 ms steps put every start and stop on a boundary, never in backward)
    assert 16 * 0.01 > ALIGN_DURATION_MAX_STEP_S
    target = spawn([PROGRAM, "--mode", "checkpoint", "--width", "128", "--depth", "16", "--backward-sleep", "0.01"])
    (pid,) = target.ready_pids()

    # WHEN duration traces are requested at arbitrary moments: ten, and more (up to 40) until
    # one has landed in backward (where most of each step is, but a moment is chance)
    statuses = []
    for i in range(40):
        result = cli("start", "--pid", str(pid), "--duration", "0.3", "--json")
        # (on failure: whether the job still runs, its last lines and its agent's log)
        assert result.returncode == 0, result.stdout + result.stderr + target.state(pid)
        statuses.append(_result(result.stdout)["status"])
        assert _alive(target), "\n".join(target.lines[-30:])
        if i >= 9 and "waits for a safe point: inside autograd's backward" in _agent_log(dynprof_dirs, pid):
            break

    # THEN every trace completed, the job never crashed, and some requests did land in backward
    # (where dynprof waited for a safe point instead of starting or stopping the profiler there)
    assert statuses == ["complete"] * len(statuses)
    log = _agent_log(dynprof_dirs, pid)
    assert "waits for a safe point: inside autograd's backward" in log, log[-2000:]
    assert _foreign_lines(target.lines) == []


def test_step_mode_with_the_optimizer_stepped_inside_backward(spawn, cli):
    # GIVEN PyTorch's "optimizer step in backward" recipe: every step boundary is in backward
    target = spawn([PROGRAM, "--mode", "opt-in-backward", "--step-sleep", "0.01"])
    (pid,) = target.ready_pids()

    # WHEN three steps are traced, three times
    for _ in range(3):
        result = cli("start", "--pid", str(pid), "--steps", "3", "--json")

        # THEN each trace holds three consecutive steps and the job lives on
        assert result.returncode == 0, result.stdout + result.stderr + target.state(pid)
        res = _result(result.stdout)
        assert res["status"] == "complete"
        numbers = _trace_steps(res)
        assert len(numbers) == 3 and numbers == list(range(numbers[0], numbers[0] + 3)), numbers
        assert _alive(target)
    assert _foreign_lines(target.lines) == []


def _shape(line: str) -> str:
    return re.sub(r"[0-9]+", "N", line)


def test_a_job_running_its_own_profiler_is_never_crashed(spawn, cli):
    # GIVEN a job whose own torch.profiler cycles (wait 3, warmup 1, active 2) and writes traces;
    # what it prints by itself, without dynprof
    alone = subprocess.run(
        [sys.executable, PROGRAM, "--mode", "own-profiler", "--max-steps", "14"],
        capture_output=True,
        text=True,
        timeout=600,  # a deadline for a hung run, not a bound on its speed
    )
    own_lines = {_shape(line) for line in (alone.stdout + alone.stderr).splitlines()}
    target = spawn([PROGRAM, "--mode", "own-profiler", "--step-sleep", "0.02"])
    (pid,) = target.ready_pids()

    # WHEN dynprof is asked for step and duration traces again and again
    outcomes = []
    for i in range(8):
        args = ["--steps", "2"] if i % 2 == 0 else ["--duration", "0.2"]
        result = cli("start", "--pid", str(pid), *args, "--json", "--timeout", "60")
        if result.returncode == 6:
            assert "profiler started by the job is already active" in result.stderr
            outcomes.append("refused")
        else:
            res = _result(result.stdout)
            outcomes.append(res["status"])
            if res["status"] == "failed":
                assert "torch.profiler" in (res["error"] or ""), res
            elif res["artifact"]:
                manifest = json.loads((Path(res["artifact"]) / "manifest.json").read_text())
                if res["status"] == "partial":
                    assert manifest["summary"]["stopped_by"] == "job-profiler"
                if "--steps" in args and res["status"] == "complete":
                    assert len(_trace_steps(res)) == 2  # no interleaved steps of the job's profiler
        assert _alive(target), "\n".join(target.lines[-30:])

    # THEN the job lived through all of it and its own profiler kept writing traces
    before = len([line for line in target.lines if line.startswith("JOBTRACE")])
    after = len(target.wait_for_line("JOBTRACE", timeout=90, count=before + 1))
    assert after > before, outcomes
    assert set(outcomes) <= {"complete", "partial", "refused", "failed"}, outcomes
    assert [line for line in _foreign_lines(target.lines) if _shape(line) not in own_lines] == []


def test_steps_keep_counting_across_a_recreated_optimizer_and_the_watchdog_stays_quiet(spawn, cli, tmp_path):
    # GIVEN a job that creates a fresh optimizer every 10 steps, under a hang watchdog, and
    # stops after its 45th step (in a marked phase) until the test lets it go on. The watchdog's
    # 20 s is far above a step here, even on a loaded machine (at 3 s, a machine running
    # `stress-ng --cpu 3` beside the suite starved a step inside backward long enough to be
    # reported: a hang by the watchdog's rule, not a miscount)
    park = tmp_path / "go-on"
    target = spawn(
        [
            "-m",
            "dynprof",
            "run",
            "-q",
            "--hang-timeout",
            "20",
            "--",
            sys.executable,
            PROGRAM,
            "--mode",
            "recreate",
            "--recreate-every",
            "10",
            "--step-sleep",
            "0.05",
            "--max-steps",
            "60",
            "--park-at",
            "45",
            "--park-file",
            str(park),
        ],
        under_run=False,
    )
    (pid,) = target.ready_pids()

    # WHEN it has trained 45 steps (four optimizers), and is read then (its step count is not a
    # race with a loaded machine: it waits), then trains on to the end
    target.wait_for_line("PARKED 45", timeout=300)
    listing = cli("ps", "--json", "--timeout", "10")
    park.write_text("")
    target.wait_for_line("DONE", timeout=300)
    assert listing.returncode == 0, listing.stderr
    ps = json.loads(listing.stdout)

    # THEN dynprof's step follows the training (one step per re-creation joins the iteration in
    # progress), and no hang was reported while it trained
    (agent,) = [a for a in ps["agents"] if a["pid"] == pid]
    assert 45 - 4 <= agent["step"] <= 46, agent
    hangs = json.loads(cli("ls", "--kind", "hang", "--json").stdout)["artifacts"]
    assert hangs == [], [(Path(h["path"]) / "manifest.json").read_text()[:3000] for h in hangs]


def test_traces_leave_the_job_output_and_losses_untouched(spawn, cli, tmp_path):
    # GIVEN a plain loop under dynprof that steps until the test lets it end (a job that ended by
    # a step count or a clock could end before both traces on a fast machine, or under a slow CLI)
    stop = tmp_path / "stop"
    target = spawn(
        [PROGRAM, "--mode", "plain", "--step-sleep", "0.03", "--max-seconds", "3600", "--stop-file", str(stop)]
    )
    (pid,) = target.ready_pids()

    # WHEN it is traced in step and duration mode, and then ends
    step_run = cli("start", "--pid", str(pid), "--steps", "3", "--json")
    duration_run = cli("start", "--pid", str(pid), "--duration", "0.3", "--json")
    stop.touch()
    (done,) = target.wait_for_line("DONE", timeout=300)
    target.proc.wait(timeout=120)
    # AND the same loop runs as many steps without dynprof, ended by their count
    steps = int(done.split()[1])
    plain = subprocess.run(
        [sys.executable, PROGRAM, "--mode", "plain", "--max-steps", str(steps), "--max-seconds", "3600"],
        capture_output=True,
        text=True,
        timeout=600,  # a deadline for a hung run, not a bound on its speed: a loaded machine is slow
    )
    assert plain.returncode == 0, plain.stderr
    expected = [line for line in plain.stdout.splitlines() if line.startswith("LOSS")]
    assert len(expected) == steps

    # THEN both traces completed, the losses are bit-identical and the output has nothing foreign
    assert step_run.returncode == 0 and duration_run.returncode == 0, step_run.stderr + duration_run.stderr
    assert _result(step_run.stdout)["status"] == "complete"
    assert _result(duration_run.stdout)["status"] == "complete"
    assert [line for line in target.lines if line.startswith("LOSS")] == expected
    # the optimizer's own range is never cut by a ProfilerStep boundary
    trace = read_trace(Path(_result(step_run.stdout)["artifact"]) / "trace.json.gz")
    optimizer_spans = [
        e for e in trace["traceEvents"] if e.get("ph") == "X" and str(e.get("name", "")).startswith("Optimizer.step#")
    ]
    assert optimizer_spans
    for span in optimizer_spans:
        begin, end = span["ts"], span["ts"] + span["dur"]
        for step in profiler_steps(trace):
            s0, s1 = step["ts"], step["ts"] + step["dur"]
            assert end <= s0 or begin >= s1 or (s0 <= begin and end <= s1), (span, step)
    assert _foreign_lines(target.lines) == [], _foreign_lines(target.lines)
    assert target.proc.returncode == 0


def test_duration_is_honoured_and_recorded(spawn, cli):
    # GIVEN a plain loop
    target = spawn([PROGRAM, "--mode", "plain", "--step-sleep", "0.01"])
    (pid,) = target.ready_pids()

    # WHEN a 1 s duration trace is taken
    result = cli("start", "--pid", str(pid), "--duration", "1", "--json")

    # THEN it recorded at least the second asked for, and stopped at the first step boundary
    # after it: the wait for that boundary lies within the last recorded step (however long a
    # loaded machine made it)
    res = _result(result.stdout)
    manifest = json.loads((Path(res["artifact"]) / "manifest.json").read_text())
    summary = manifest["summary"]
    assert summary["profiled_s"] >= 0.95, summary
    last_step = profiler_steps(read_trace(Path(res["artifact"]) / "trace.json.gz"))[-1]
    # (50 ms of slack: the two are read by different clocks, one thread preemption apart on a loaded machine)
    assert summary["stop_waited_s"] <= last_step["dur"] / 1e6 + 0.05, (summary, last_step)
    # AND the stop pause is reported apart, not added to it: the profiled window ended before the
    # pause, which ended before the export created the artifact (created_at is to the millisecond)
    assert summary["training_thread_pause_ms"] >= 0 and isinstance(summary["torch_warnings"], list)
    created = datetime.fromisoformat(manifest["created_at"].replace("Z", "+00:00")).timestamp()
    paused_until = summary["profiled_until"] + summary["training_thread_pause_ms"] / 1000
    assert paused_until <= created + 0.001 + 0.005, (summary, manifest["created_at"])


def test_a_trace_that_times_out_while_armed_names_no_older_artifact(spawn, cli):
    # GIVEN a process that already has a completed trace
    target = spawn([PROGRAM, "--mode", "plain", "--step-sleep", "0.01"])
    (pid,) = target.ready_pids()
    first = cli("start", "--pid", str(pid), "--steps", "2", "--json")
    assert _result(first.stdout)["status"] == "complete"

    # WHEN a second request waits for a step it never reaches before its cap
    result = cli("start", "--pid", str(pid), "--steps", "2", "--at-step", "100000000", "--max-duration", "1", "--json")

    # THEN it fails with its own reason and names no artifact (not the first trace's)
    res = _result(result.stdout)
    assert result.returncode == 1
    assert res["status"] == "failed" and res["artifact"] is None
    assert "within the cap" in res["error"]


def test_a_process_that_exits_mid_trace_is_reported_partial_with_its_path(spawn, cli, tmp_path):
    # GIVEN a loop that ends by itself when the test says so (after the trace has begun: a loop
    # that ended by a step count could end before a slow CLI asked)
    stop = tmp_path / "stop"
    target = spawn(
        [PROGRAM, "--mode", "plain", "--step-sleep", "0.02", "--max-seconds", "3600", "--stop-file", str(stop)]
    )
    (pid,) = target.ready_pids()

    # WHEN more steps are requested than it will run, and it ends while they are being traced
    start = subprocess.Popen(
        [sys.executable, "-m", "dynprof", "start", "--pid", str(pid), "--steps", "100000", "--json"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=str(ROOT),
    )
    try:
        deadline = time.monotonic() + 120
        while _state(cli, pid) != "tracing":
            assert time.monotonic() < deadline and start.poll() is None, start.communicate(timeout=60)
            time.sleep(0.1)
        stop.touch()
        out, err = start.communicate(timeout=300)
    finally:
        if start.poll() is None:
            start.kill()
            start.wait()

    # THEN the CLI names the partial trace the process flushed on its way out
    res = _result(out)
    assert res["status"] == "partial", (res, err)
    assert res["artifact"] and Path(res["artifact"]).is_dir()


def _state(cli, pid: int) -> str | None:
    """The agent's trace state of ``pid`` as `dynprof ps` reads it (None: not listed)."""
    agents = json.loads(cli("ps", "--json").stdout)["agents"]
    return next((a["state"] for a in agents if a["pid"] == pid), None)


def test_a_compiled_optimizer_step_is_counted_and_traced_without_graph_breaks(spawn, cli):
    # GIVEN a job whose optimizer step runs under torch.compile
    target = spawn([PROGRAM, "--mode", "compiled-step", "--step-sleep", "0.01"])
    (pid,) = target.ready_pids()
    target.wait_for_line("LOSS 20 ", timeout=120)

    # WHEN it is listed and traced for three steps
    listing = cli("ps", "--json", "--timeout", "10")
    result = cli("start", "--pid", str(pid), "--steps", "3", "--json")

    # THEN its steps are counted, the trace holds three steps, and Dynamo said nothing about
    # dynprof's hook (no graph break, no warning in the job's output)
    (agent,) = [a for a in json.loads(listing.stdout)["agents"] if a["pid"] == pid]
    assert agent["step"] >= 19, agent
    assert result.returncode == 0, result.stdout + result.stderr
    res = _result(result.stdout)
    assert res["status"] == "complete" and len(_trace_steps(res)) == 3
    assert not [line for line in target.lines if "dynprof/agent" in line or "Dynamo" in line]


def test_a_failing_export_is_one_line_in_the_job_output_never_a_traceback(spawn, cli, tmp_path):
    # GIVEN a job whose artifact store cannot be created (its path runs through a file)
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")
    target = spawn(
        [PROGRAM, "--mode", "plain", "--step-sleep", "0.01"], env={"DYNPROF_ARTIFACT_DIR": str(blocker / "store")}
    )
    (pid,) = target.ready_pids()

    # WHEN a trace is taken and its export fails
    result = cli(
        "start", "--pid", str(pid), "--steps", "2", "--json", env={"DYNPROF_ARTIFACT_DIR": str(blocker / "store")}
    )

    # THEN the CLI reports the failure with its reason, the job goes on, and its output holds
    # dynprof's one-line warning, no traceback
    res = _result(result.stdout)
    assert res["status"] == "failed" and "export" in res["error"], res
    # the agent wrote its warning before it reported the failure, but this process reads the
    # job's output on its own thread, which may not have read that line yet on a loaded machine
    target.wait_for_line("dynprof: ")
    time.sleep(0.5)
    assert _alive(target)
    assert not [line for line in target.lines if "Traceback" in line or line.startswith("  File ")]
    warnings = [line for line in target.lines if line.startswith("dynprof: ")]
    assert warnings and all("details in" in line for line in warnings), warnings
