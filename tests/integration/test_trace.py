"""End-to-end traces of real training processes (CPU torch)."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from collectors.torch_trace import profiler_steps, read_trace

PROGRAM = "tests/integration/programs/train_program.py"
# The loop the tests that only trace and ask share (the module's ``shared_target``): each gets it
# with an idle agent, past however many traces the tests before it took.
LOOP = [PROGRAM, "--step-sleep", "0.005", "--max-seconds", "1800"]


def _trace_of(result_json: dict) -> tuple[dict, dict]:
    (res,) = result_json["results"]
    manifest = json.loads((Path(res["artifact"]) / "manifest.json").read_text())
    return read_trace(Path(res["artifact"]) / "trace.json.gz"), manifest


def test_steps_mode_captures_exactly_n_steps(shared_target, cli):
    # GIVEN a training loop running under `dynprof run`
    target = shared_target(LOOP)
    (pid,) = target.ready_pids()

    # WHEN five steps are traced
    result = cli("start", "--pid", str(pid), "--steps", "5", "--json")

    # THEN the artifact holds exactly five consecutive ProfilerStep spans
    assert result.returncode == 0, result.stderr
    trace, manifest = _trace_of(json.loads(result.stdout))
    steps = profiler_steps(trace)
    numbers = [int(s["name"].split("#")[1]) for s in steps]
    assert len(numbers) == 5, numbers
    assert numbers == list(range(numbers[0], numbers[0] + 5))
    assert manifest["status"] == "complete"
    assert manifest["summary"]["steps_captured"] == 5
    assert manifest["summary"]["training_thread_pause_ms"] >= 0
    assert trace["distributedInfo"]["world_size"] == 1


def test_unbounded_start_then_stop(shared_target, cli):
    # GIVEN a running loop
    target = shared_target(LOOP)
    (pid,) = target.ready_pids()

    # WHEN a trace is started without a bound
    started = cli("start", "--pid", str(pid))
    # THEN it returns once the trace is active
    assert started.returncode == 0, started.stderr
    assert "tracing in 1 process" in started.stdout
    (status,) = [a for a in json.loads(cli("ps", "--json").stdout)["agents"] if a["pid"] == pid]
    assert status["state"] == "tracing"

    # WHEN it is stopped
    stopped = cli("stop", "--pid", str(pid), "--json")

    # THEN the artifact is written, complete, with the steps that ran meanwhile
    assert stopped.returncode == 0, stopped.stderr
    (res,) = json.loads(stopped.stdout)["results"]
    assert res["status"] == "complete"
    trace = read_trace(Path(res["artifact"]) / "trace.json.gz")
    assert len(profiler_steps(trace)) >= 1


def test_two_ranks_of_one_job_start_at_the_same_step(spawn, cli):
    # GIVEN a 2-rank gloo job launched by torchrun under `dynprof run`
    target = spawn(
        [
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "2",
            PROGRAM,
            "--dist",
            "--step-sleep",
            "0.002",
        ],
        env={"DYNPROF_JOB_ID": "twojob"},
    )
    target.ready_pids(count=2, timeout=120)

    # WHEN one command traces the job's ranks (the torchrun launcher is not a rank and is left out)
    result = cli("start", "--job", "twojob", "--steps", "4", "--json")

    # THEN each rank's trace covers the same four steps
    assert result.returncode == 0, result.stderr
    results = json.loads(result.stdout)["results"]
    assert sorted(r["rank"] for r in results) == [0, 1]
    step_names = []
    for res in results:
        trace = read_trace(Path(res["artifact"]) / "trace.json.gz")
        step_names.append([s["name"] for s in profiler_steps(trace)])
        assert trace["distributedInfo"]["world_size"] == 2
        assert trace["distributedInfo"]["rank"] == res["rank"]
    assert step_names[0] == step_names[1]
    assert len(step_names[0]) == 4


def test_duration_mode_for_a_loop_without_optimizer(spawn, cli):
    # GIVEN a loop that runs forward passes only (no optimizer step to align to)
    target = spawn([PROGRAM, "--no-optimizer", "--step-sleep", "0.002"])
    (pid,) = target.ready_pids()

    # WHEN half a second is traced
    result = cli("start", "--pid", str(pid), "--duration", "0.5", "--json")

    # THEN the trace holds the forward passes' operators over about that long
    assert result.returncode == 0, result.stderr
    trace, manifest = _trace_of(json.loads(result.stdout))
    names = {e.get("name") for e in trace["traceEvents"]}
    assert "aten::linear" in names
    # (no upper bound in seconds: a loaded machine delays the stop; that its duration, not the
    # cap, ended it is what shows the request was honoured)
    assert manifest["summary"]["profiled_s"] >= 0.4
    assert manifest["summary"]["stopped_by"] == "duration"


def test_second_start_is_refused_as_busy(shared_target, cli):
    target = shared_target(LOOP)
    (pid,) = target.ready_pids()
    first = cli("start", "--pid", str(pid), "--steps", "100000", "--no-wait")
    assert first.returncode == 0, first.stderr

    second = cli("start", "--pid", str(pid), "--steps", "5")

    assert second.returncode == 6
    assert "already" in second.stderr and "dynprof stop" in second.stderr
    stopped = cli("stop", "--pid", str(pid), "--json")
    assert stopped.returncode == 0, stopped.stderr
    (res,) = json.loads(stopped.stdout)["results"]
    assert res["status"] == "partial"  # fewer steps than the 100000 requested


def test_trace_is_flushed_as_partial_when_the_process_exits(spawn, cli, dynprof_dirs, tmp_path):
    # GIVEN a loop that ends by itself once told to, traced without a bound
    stop = tmp_path / "stop"
    target = spawn([PROGRAM, "--step-sleep", "0.005", "--stop-file", str(stop)])
    (pid,) = target.ready_pids()
    assert cli("start", "--pid", str(pid)).returncode == 0

    # WHEN the process exits mid-trace
    stop.write_text("stop\n")
    target.wait_for_line("DONE", timeout=60)
    target.proc.wait(timeout=30)

    # THEN the trace was written and marked partial
    listing = json.loads(cli("ls", "--kind", "trace", "--json").stdout)["artifacts"]
    assert [a["status"] for a in listing] == ["partial"]
    manifest = json.loads((Path(listing[0]["path"]) / "manifest.json").read_text())
    assert manifest["summary"]["stopped_by"] == "exit"
    assert len(profiler_steps(read_trace(Path(listing[0]["path"]) / "trace.json.gz"))) >= 1


def test_trace_ends_by_itself_at_the_hard_cap_without_the_cli(shared_target, cli):
    # GIVEN an unbounded trace whose CLI returned at once
    target = shared_target(LOOP)
    (pid,) = target.ready_pids()
    before = {a["path"] for a in json.loads(cli("ls", "--kind", "trace", "--json").stdout)["artifacts"]}
    asked_at = time.time()
    assert cli("start", "--pid", str(pid), "--max-duration", "1", "--no-wait").returncode == 0

    # THEN the agent ended it by itself and wrote the artifact
    deadline = time.monotonic() + 120
    listing = []
    while time.monotonic() < deadline and not listing:
        listing = [
            a for a in json.loads(cli("ls", "--kind", "trace", "--json").stdout)["artifacts"] if a["path"] not in before
        ]
        time.sleep(0.2)
    assert listing, "no artifact after the cap"
    manifest = json.loads((Path(listing[0]["path"]) / "manifest.json").read_text())
    summary = manifest["summary"]
    assert summary["stopped_by"] == "cap" and summary["profiled_s"] > 0
    # the cap (1 s from the request) never came early: the stop was due a full second after
    # the request or later (the trace itself starts at the next step boundary after the
    # request: on a loaded machine, a fraction of the second later)
    stop_due = summary["profiled_until"] - summary["stop_waited_s"]
    assert stop_due >= asked_at + 1.0 - 0.01, (asked_at, summary)


def test_at_step_starts_after_that_step(spawn, cli):
    # GIVEN a loop and a step K comfortably in its future
    target = spawn([PROGRAM, "--step-sleep", "0.01"])
    (pid,) = target.ready_pids()

    # WHEN a trace is requested at step K (asked again with a later K if a slow machine let K
    # pass before the request arrived: that refusal is the next test's)
    for _ in range(5):
        k = json.loads(cli("ps", "--json").stdout)["agents"][0]["step"] + 300
        result = cli("start", "--pid", str(pid), "--steps", "2", "--at-step", str(k), "--json")
        if not (result.returncode == 8 and "has passed" in result.stderr):
            break

    # THEN the first traced step is K+1
    assert result.returncode == 0, result.stderr
    trace, _ = _trace_of(json.loads(result.stdout))
    assert [s["name"] for s in profiler_steps(trace)] == [f"ProfilerStep#{k + 1}", f"ProfilerStep#{k + 2}"]


def test_at_step_in_the_past_is_refused(shared_target, cli):
    target = shared_target(LOOP)
    (pid,) = target.ready_pids()
    result = cli("start", "--pid", str(pid), "--steps", "2", "--at-step", "1")
    assert result.returncode == 8
    assert "step 1 has passed" in result.stderr


def test_all_profiler_options_are_passed_to_torch(shared_target, cli):
    target = shared_target(LOOP)
    (pid,) = target.ready_pids()
    result = cli(
        "start",
        "--pid",
        str(pid),
        "--steps",
        "2",
        "--record-shapes",
        "--with-stack",
        "--profile-memory",
        "--with-flops",
        "--with-modules",
        "--activities",
        "cpu",
        "--json",
    )
    assert result.returncode == 0, result.stderr
    trace, manifest = _trace_of(json.loads(result.stdout))
    assert manifest["options"]["record_shapes"] and manifest["options"]["with_stack"]
    linear = [e for e in trace["traceEvents"] if e.get("name") == "aten::addmm" and e.get("ph") == "X"]
    assert linear and "Input Dims" in linear[0]["args"]  # --record-shapes
    assert any(e.get("cat") == "python_function" for e in trace["traceEvents"])  # --with-stack
    # torch records the options it ran with in the trace's metadata
    assert [trace.get(k) for k in ("record_shapes", "with_stack", "profile_memory", "with_flops", "with_modules")] == [
        1
    ] * 5


MP_PROGRAM = "tests/integration/programs/mp_spawn_program.py"


def test_ranks_started_by_mp_spawn_are_found_and_traced(spawn, cli):
    # GIVEN ranks that learn their rank after start-up (torch.multiprocessing.spawn), a waiting
    # parent and a spawned helper process that never steps; any port the program has the system
    # pick is taken as soon as it lets it go (as may happen on a loaded machine)
    taker = str(Path(__file__).resolve().parent / "programs" / "port_taker")
    path = os.pathsep.join(p for p in (taker, os.environ.get("PYTHONPATH")) if p)
    env = {"DYNPROF_JOB_ID": "mpjob", "PYTHONPATH": path}
    target = spawn([MP_PROGRAM, "--mode", "ranks"], env=env)
    pids = target.ready_pids(count=2, timeout=120)

    # WHEN the job is traced
    result = cli("start", "--job", "mpjob", "--steps", "3", "--json")

    # THEN exactly the two ranks were traced, each knowing its rank, at the same steps
    assert result.returncode == 0, result.stderr
    results = json.loads(result.stdout)["results"]
    assert sorted(r["pid"] for r in results) == sorted(pids)
    assert sorted(r["rank"] for r in results) == [0, 1]
    names = [[s["name"] for s in profiler_steps(read_trace(Path(r["artifact"]) / "trace.json.gz"))] for r in results]
    assert names[0] == names[1] and len(names[0]) == 3


def test_spawned_helper_of_a_process_is_not_a_target(spawn, cli):
    # GIVEN a single training process with a spawned helper process beside it (both agents)
    target = spawn([MP_PROGRAM, "--mode", "single"], env={"DYNPROF_JOB_ID": "onejob"})
    (pid,) = target.ready_pids(timeout=120)
    agents = [a for a in json.loads(cli("ps", "--json").stdout)["agents"] if a["job"] == "onejob"]
    assert len(agents) == 2

    # WHEN the job is traced, THEN only the training process is
    result = cli("start", "--job", "onejob", "--steps", "2", "--json")
    assert result.returncode == 0, result.stderr
    assert [r["pid"] for r in json.loads(result.stdout)["results"]] == [pid]


def test_a_process_of_the_job_that_never_steps_is_skipped_with_a_note(spawn, cli):
    # GIVEN two unrelated processes of one job: a trainer and a loop without optimizer
    env = {"DYNPROF_JOB_ID": "mixjob"}
    trainer = spawn([PROGRAM, "--step-sleep", "0.005"], env=env)
    evaluator = spawn([PROGRAM, "--no-optimizer", "--step-sleep", "0.005"], env=env)
    (tpid,) = trainer.ready_pids()
    (epid,) = evaluator.ready_pids()

    # WHEN the job is traced in step mode
    result = cli("start", "--job", "mixjob", "--steps", "2", "--json")

    # THEN the trainer is traced and the other is named as skipped, instead of waiting forever
    assert result.returncode == 0, result.stderr
    assert [r["pid"] for r in json.loads(result.stdout)["results"]] == [tpid]
    assert f"not targeting 1 process(es) that are not trainers: pid {epid} (no optimizer step yet)" in result.stderr
