"""`dynprof watch` on this node's agents (no sidecar), `serve --watch`, and a job without agents."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dynprof.identity import detect

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.ptrace
def test_watch_once_on_this_node_names_the_rank_that_holds_the_others(hang_job, cli):
    # GIVEN a 2-rank job: rank 0 waits in an all_reduce, rank 1 sleeps in wait_for_data
    hang_job("wjob")
    # WHEN the watch checks once, on this node's agents (with the job idle past the stall time)
    progressing = cli("watch", "--job", "wjob", "--once", "--json", "--stall-after", "60", timeout=120)
    time.sleep(2)  # the job is hung for good: this only puts its last step more than 1 s back
    out = cli("watch", "--job", "wjob", "--once", "--json", "--stall-after", "1", "--look-interval", "1", timeout=180)
    # THEN it exits with the hang code and one verdict naming rank 1 on this host
    assert progressing.returncode == 0, progressing.stderr
    (ok,) = [json.loads(line)["verdict"] for line in progressing.stdout.splitlines()]
    assert ok["kind"] == "ok" and "2 rank(s) progress" in ok["conclusion"]
    assert out.returncode == 20, out.stderr
    (event,) = [json.loads(line) for line in out.stdout.splitlines()]
    assert event["schema"] == "dynprof.watch.event" and event["schema_version"] == 1
    verdict = event["verdict"]
    host = detect().host
    assert verdict["kind"] == "hang"
    assert [(c["rank"], c["host"]) for c in verdict["culprits"]] == [(1, host)]
    assert verdict["culprits"][0]["where"].startswith("wait_for_data (")
    assert f"rank 1 on {host} is in wait_for_data" in verdict["conclusion"]
    assert set(verdict["evidence"]["healthcheck"]) == {host}
    # and the job runs without the flight recorder: the verdict says so, and no nccl artifact is left
    assert verdict["evidence"]["flight_recorder"]["note"] == "not on for this job (`dynprof run --flight-recorder`)"
    listed = cli("ls", "--job", "wjob", "--kind", "nccl", "--json")
    assert json.loads(listed.stdout)["artifacts"] == [], listed.stdout
    # and `dynprof show` prints the verdict artifact
    shown = cli("show", event["artifact"])
    assert shown.returncode == 0, shown.stderr
    assert "HANG job wjob: rank 1 on" in shown.stdout


def test_watch_of_a_job_without_agents_says_what_it_can_still_do(cli):
    # GIVEN no agent of job "nothere" on this node
    # WHEN
    out = cli("watch", "--job", "nothere", "--once")
    # THEN a clear error: what the watch needs, and what works without agents
    assert out.returncode == 5, out.stderr
    assert "no rank of job 'nothere' with a dynprof agent was found" in out.stderr
    assert "dynprof attach --job JOB" in out.stderr and "dynprof stacks --job JOB" in out.stderr


def _port_and_token(directory: Path, token: str) -> tuple[int, Path]:
    """A free loopback port (nothing listens on it once returned), and a token file of mode 0600."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    path = directory / "token"
    path.write_text(token + "\n")
    path.chmod(0o600)
    return port, path


@pytest.mark.ptrace
def test_serve_hosts_the_watch_and_logs_its_verdict(hang_job, tmp_path):
    # GIVEN a hung 2-rank job, and a sidecar started with --watch on it
    hang_job("sjob")
    port, token = _port_and_token(tmp_path, "serve-watch-token-0123456789")
    log = tmp_path / "serve.log"
    cmd = [
        sys.executable, "-m", "dynprof", "serve", "--port", str(port), "--token-file", str(token),
        "--watch", "--job", "sjob", "--interval", "1", "--stall-after", "1", "--look-interval", "1", "--no-healthcheck",
    ]  # fmt: skip
    with open(log, "wb") as fh:
        proc = subprocess.Popen(
            cmd,
            stdout=subprocess.DEVNULL,
            stderr=fh,
            cwd=str(ROOT),
            env=dict(os.environ),
            start_new_session=True,
        )
    try:
        # WHEN it runs
        deadline = time.monotonic() + 150
        text = ""
        while time.monotonic() < deadline and "HANG job sjob" not in text:
            assert proc.poll() is None, log.read_text()
            time.sleep(0.5)
            text = log.read_text()
        # THEN its log says the verdict, naming rank 1
        assert "dynprof: watching job sjob" in text
        assert "HANG job sjob: rank 1 on" in text, text
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_serve_refuses_a_watch_without_a_job(cli):
    out = cli("serve", "--watch")
    assert out.returncode == 2 and "--watch needs --job JOB" in out.stderr


def test_watch_once_whose_only_node_does_not_answer_says_so_not_no_agent(cli, tmp_path):
    # GIVEN a node where nothing listens
    port, token = _port_and_token(tmp_path, "watch-node-token-0123456789")
    # WHEN the watch checks once through it
    out = cli("watch", "--job", "j", "--once", "--hosts", f"127.0.0.1:{port}", "--token-file", str(token))
    # THEN the node that did not answer is the verdict (exit 12), not "no agent" (exit 5)
    assert out.returncode == 12, out.stderr
    assert f"127.0.0.1:{port}" in out.stderr and "no rank of job" in out.stderr
