"""A node's live per-rank progress (``GET /api/progress``) read from real training processes."""

from __future__ import annotations

import os
import signal

from dynprof.registry import list_records
from dynprof.sidecar.app import create_app
from dynprof.store import ArtifactStore
from dynprof.watch.model import NodeProgress
from dynprof.watch.progress import read_progress
from tests._ports import free_port
from tests.support.procs import terminate
from tests.support.serving import serve, write_token
from tests.support.waiting import wait_for


def _wait(pred, timeout: float = 60.0):
    return wait_for(pred, timeout)


def test_progress_of_a_stepping_rank_and_a_stopped_one(spawn, tmp_path):
    # GIVEN two ranks of one job: one stepping, one stopped with SIGSTOP after its first steps
    env = {"DYNPROF_JOB_ID": "pj", "RANK": "0", "WORLD_SIZE": "2"}
    stepping = spawn(["tests/integration/programs/train_program.py", "--step-sleep", "0.05"], env=env)
    stopped = spawn(["tests/integration/programs/train_program.py", "--step-sleep", "0.05"], env={**env, "RANK": "1"})
    (pid0,) = stepping.ready_pids()
    (pid1,) = stopped.ready_pids()
    _wait(lambda: {r.pid for r in list_records()} >= {pid0, pid1})
    os.kill(pid1, signal.SIGSTOP)
    try:
        # WHEN the sidecar is asked for the job's progress twice
        client = create_app(ArtifactStore(tmp_path / "s")).test_client()
        first = NodeProgress.from_json(client.get("/api/progress?job=pj").get_json())
        second = _wait(
            lambda: (
                p
                if (p := NodeProgress.from_json(client.get("/api/progress?job=pj").get_json()))
                and next(r for r in p.ranks if r.pid == pid0).step > next(r for r in first.ranks if r.pid == pid0).step
                else None
            )
        )
        # THEN both ranks are there, by rank; the stepping one advanced with a recent step and
        # a step time; the stopped one is unresponsive, in state "stopped", its step unchanged
        by_rank = {r.rank: r for r in second.ranks}
        assert set(by_rank) == {0, 1}
        assert by_rank[0].agent == "up" and by_rank[0].step_time_s > 0
        assert by_rank[0].last_step_age_s is not None and by_rank[0].cpu_s is not None
        assert by_rank[1].pid == pid1 and by_rank[1].process_state == "stopped"
        assert by_rank[1].agent == "unresponsive"
        assert read_progress(list_records(), "h", "another-job").ranks == []
    finally:
        os.kill(pid1, signal.SIGCONT)


def test_progress_refuses_an_overlong_job_name(tmp_path):
    client = create_app(ArtifactStore(tmp_path / "s")).test_client()
    answer = client.get("/api/progress?job=" + "j" * 300)
    assert answer.status_code == 400
    assert "200 characters" in answer.get_json()["error"]


def test_the_sidecars_poller_keeps_a_stopped_ranks_last_step(spawn, tmp_path):
    # GIVEN a real sidecar polling every 0.5 s, and a rank of a job that then stops (SIGSTOP)
    import json
    import subprocess
    import urllib.request

    rank = spawn(
        ["tests/integration/programs/train_program.py", "--step-sleep", "0.05"],
        env={"DYNPROF_JOB_ID": "pp", "RANK": "0", "WORLD_SIZE": "1"},
    )
    (pid,) = rank.ready_pids()
    token = write_token(tmp_path / "token", "progress-poller-token-0123456789\n")
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k != "DYNPROF_TOKEN_FILE"}
    with open(tmp_path / "serve.log", "wb") as log:
        server = serve(
            port,
            token,
            "--progress-every",
            "0.5",
            stdout=subprocess.DEVNULL,
            stderr=log,
            env=env,
            start_new_session=True,
        )

    def progress() -> NodeProgress | None:
        request = urllib.request.Request(
            f"http://127.0.0.1:{port}/api/progress?job=pp",
            headers={"Authorization": "Bearer progress-poller-token-0123456789"},
        )
        try:
            with urllib.request.urlopen(request, timeout=10) as answer:
                return NodeProgress.from_json(json.loads(answer.read()))
        except OSError:
            assert server.poll() is None, (tmp_path / "serve.log").read_text()
            return None

    stopped = False
    try:
        stepped = _wait(lambda: (p := progress()) and p.ranks and p.ranks[0].step > 0 and p)
        assert stepped.poll_every_s == 0.5
        os.kill(pid, signal.SIGSTOP)
        stopped = True
        # WHEN the poller has seen its agent not answer
        seen = _wait(lambda: (p := progress()) and p.ranks and p.ranks[0].agent == "unresponsive" and p)
        # THEN the rank keeps the step it reached and the time of it, its age growing
        (row,) = seen.ranks
        assert row.pid == pid and row.process_state == "stopped"
        assert row.step >= stepped.ranks[0].step > 0 and row.last_step_at > 0
        later = _wait(
            lambda: (
                (p := progress()) and p.ranks and (p.ranks[0].last_step_age_s or 0) > (row.last_step_age_s or 0) and p
            )
        )
        assert later.ranks[0].step == row.step
    finally:
        if stopped:
            os.kill(pid, signal.SIGCONT)
        terminate(server, 15)


def test_a_process_and_its_children_io_is_counted(tmp_path):
    import subprocess
    import sys

    import psutil

    from dynprof.watch.progress import _process_facts

    # GIVEN a process whose child writes 8 MB to a file once told to
    code = (
        "import os, subprocess, sys\n"
        "child = subprocess.Popen([sys.executable, '-c', "
        '\'import sys; sys.stdin.readline(); open(sys.argv[1], "wb").write(b"x" * (8 << 20)); '
        'print("WROTE", flush=True); sys.stdin.readline()\', sys.argv[1]], stdin=sys.stdin)\n'
        "child.wait()\n"
    )
    parent = subprocess.Popen(
        [sys.executable, "-c", code, str(tmp_path / "shard")],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    kids: list[psutil.Process] = []
    try:
        assert parent.stdin is not None and parent.stdout is not None
        kids = _wait(lambda: psutil.Process(parent.pid).children())
        before = _process_facts(parent.pid, kids)
        # WHEN the child writes
        parent.stdin.write("go\n")
        parent.stdin.flush()
        assert parent.stdout.readline().startswith("WROTE")
        after = _process_facts(parent.pid, kids)
        # THEN the parent's figure, its child's included, grew by at least what was written
        assert before.io_bytes is not None and after.io_bytes is not None
        assert after.io_bytes - before.io_bytes >= 8 << 20
        assert after.state != "gone" and after.cpu_s is not None
    finally:
        for kid in kids:
            kid.kill()
        parent.kill()
        parent.wait()


def test_a_cpu_rank_says_it_has_no_gpu_step_and_its_progress_row_has_none(spawn):
    # GIVEN a rank that trains on the CPU (CUDA never initialised in it)
    from dynprof.client import AgentClient

    rank = spawn(
        ["tests/integration/programs/train_program.py", "--step-sleep", "0.02"],
        env={"DYNPROF_JOB_ID": "pg", "RANK": "0", "WORLD_SIZE": "1"},
    )
    (pid,) = rank.ready_pids()
    _wait(lambda: pid in {r.pid for r in list_records()})
    client = AgentClient.for_pid(pid)
    first = client.status().step
    _wait(lambda: client.status().step > first)
    # WHEN its agent is asked for its status, and the node reads the job's progress
    status = client.status()
    progress = read_progress(list_records(), "h", "pg")
    # THEN its steps go on, no CUDA event was recorded, the marker is on (not off after an
    # error) and says why there is none; the progress row carries no GPU step and no reading
    assert status.step > first and not status.cuda_initialized
    g = status.gpu_step
    assert (g.recorded, g.step, g.done, g.note) == (False, 0, False, "no optimizer step on CUDA yet")
    (row,) = progress.ranks
    assert row.pid == pid and row.step > 0
    assert row.gpu_step is None and row.gpu is None
