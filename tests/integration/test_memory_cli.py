"""`dynprof memory` against real processes on a CPU machine, and the agent's CUDA hook there."""

from __future__ import annotations

import json

from dynprof.client import AgentClient

PROGRAM = "tests/integration/programs/train_program.py"


def test_memory_on_a_process_without_cuda_says_so(spawn, cli):
    # GIVEN a CPU training loop under `dynprof run`
    target = spawn([PROGRAM, "--step-sleep", "0.005"])
    (pid,) = target.ready_pids()

    # WHEN a snapshot, history start and history stop are asked for
    snap = cli("memory", "--pid", str(pid))
    start = cli("memory", "--pid", str(pid), "--history-start", "1000")
    stop = cli("memory", "--pid", str(pid), "--history-stop", "--json")

    # THEN each fails with "no CUDA" (exit 7) and says what to do, and nothing is written
    assert snap.returncode == 7, snap.stderr
    assert "has not used CUDA" in snap.stderr and "what to do:" in snap.stderr
    assert start.returncode == 7 and "has not used CUDA" in start.stderr
    assert stop.returncode == 7
    (res,) = json.loads(stop.stdout)["results"]
    assert res["status"] == "failed" and "NO_CUDA" in res["error"]
    # AND the agent did not initialise CUDA, and history stays off
    status = AgentClient.for_pid(pid).status()
    assert not status.cuda_initialized and status.memory_history == "off"


def test_memory_on_several_processes_reports_each(spawn, cli):
    # GIVEN two CPU training loops of one job
    a = spawn([PROGRAM, "--step-sleep", "0.005"])
    b = spawn([PROGRAM, "--step-sleep", "0.005"])
    pids = [a.ready_pids()[0], b.ready_pids()[0]]

    # WHEN both are asked for a snapshot
    res = cli("memory", "--pid", ",".join(map(str, pids)))

    # THEN each row says why it failed, and the exit code is the shared one (7)
    assert res.returncode == 7, res.stderr
    for pid in pids:
        assert str(pid) in res.stdout
    assert res.stdout.count("has not used CUDA") == 2


def test_bad_arguments(cli):
    res = cli("memory", "--all", "--history-start", "0")
    assert res.returncode == 2 and "argument --history-start: 0 is out of range (1.." in res.stderr
    res = cli("memory", "--all", "--history-start", "5", "--history-stop")
    assert res.returncode == 2  # argparse: not allowed together


def test_the_agent_hooks_cuda_start_without_starting_cuda(spawn):
    # GIVEN a process under `dynprof run` that imports torch (CPU build or not)
    code = (
        "import time, torch\n"
        "def queued():\n"
        "    return any(getattr(c, '__name__', '') == '_on_cuda_init' for c, _ in torch.cuda._queued_calls)\n"
        "deadline = time.monotonic() + 60\n"
        "while not queued() and time.monotonic() < deadline:\n"
        "    time.sleep(0.05)\n"  # the agent starts beside the program: give it the time it takes
        "print('QUEUED', queued(), 'INIT', torch.cuda.is_initialized(), flush=True)"
    )
    target = spawn(["-c", code])

    # WHEN torch has been imported
    (line,) = target.wait_for_line("QUEUED")

    # THEN the agent's start-up callback waits in torch's lazy-init queue, and CUDA is not initialised
    assert line == "QUEUED True INIT False", line
