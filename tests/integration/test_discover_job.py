"""Finding a job's nodes from its own rendezvous store: a real 2-rank gloo job split over two
simulated nodes (each rank with its own run directory, host name and sidecar address)."""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch")

from dynprof.job import discovery
from tests._ports import free_port
from tests.support.nodes import sidecar_nodes, split_job, token_file
from tests.support.ranks import rank_env

TRAIN = "tests/integration/programs/train_program.py"
# How long discovery may wait for each agent's answer in the timed call: far longer than the
# call takes when it does not wait for a stopped rank, however loaded the machine.
STOPPED_RANK_WAIT_S = 30.0  # the most an agent accepts
HANG = "tests/integration/programs/hang_program.py"
# The simulated nodes' sidecars are on loopback ports other than the sidecar port: allowed by name.
ALLOW = ("--allow-hosts", "127.0.0.1:9100,127.0.0.1:9101")


def _free_port() -> str:
    return str(free_port())


def _two_node_job(spawn: Any, job: str, run_dirs: list[Path], extra: list[str] = ()) -> list[Any]:  # type: ignore[assignment]
    port = _free_port()
    targets = []
    for rank in (0, 1):
        env = rank_env(
            rank,
            2,
            port,
            DYNPROF_JOB_ID=job,
            DYNPROF_RUN_DIR=str(run_dirs[rank]),
            DYNPROF_HOST=f"node-{rank}",
            DYNPROF_SIDECAR=f"127.0.0.1:{9100 + rank}",
        )
        args = ["-m", "dynprof", "run", "-q", "--", sys.executable, TRAIN, "--dist", "--step-sleep", "0.05", *extra]
        targets.append(spawn(args, under_run=False, env=env))
    for t in targets:
        t.ready_pids(timeout=90)
    return targets


@pytest.fixture
def node_dirs() -> Any:
    """Run directories of simulated nodes. Name it before ``spawn`` in a test's arguments: it is
    then removed after the processes that write into it have stopped."""
    dirs = [Path(tempfile.mkdtemp(prefix="dpn-", dir="/tmp")) for _ in range(3)]
    yield dirs
    import shutil

    for d in dirs:
        shutil.rmtree(d, ignore_errors=True)


def test_discover_finds_both_nodes_through_one_local_agent(node_dirs: list[Path], spawn: Any, cli: Any) -> None:
    # GIVEN a 2-rank gloo job whose ranks run on two "nodes" (separate run directories)
    _two_node_job(spawn, "disc1", node_dirs)
    # WHEN a CLI on node 1 (it sees rank 1's agent only) asks for the job's nodes
    deadline = time.monotonic() + 30
    while True:
        out = cli("nodes", "--job", "disc1", "--discover", "--json", *ALLOW, env={"DYNPROF_RUN_DIR": str(node_dirs[1])})
        data = json.loads(out.stdout) if out.returncode == 0 else {}
        if len(data.get("ranks", [])) == 2 or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    # THEN both ranks' registrations come back, each with its node's sidecar
    assert out.returncode == 0, out.stderr
    assert data["nodes"] == ["127.0.0.1:9100", "127.0.0.1:9101"]
    assert [(r["rank"], r["host"], r["sidecar"]) for r in data["ranks"]] == [
        (0, "node-0", "127.0.0.1:9100"),
        (1, "node-1", "127.0.0.1:9101"),
    ]
    assert data["world_size"] == 2 and data["missing_ranks"] == []
    assert data["store"].startswith("TCPStore 127.0.0.1:")
    # and the plain output is a host file
    text = cli("nodes", "--job", "disc1", "--discover", *ALLOW, env={"DYNPROF_RUN_DIR": str(node_dirs[0])})
    assert text.returncode == 0, text.stderr
    assert text.stdout.split() == ["127.0.0.1:9100", "127.0.0.1:9101"]
    assert "2 of 2 rank(s) registered" in text.stderr
    # and without allowing those ports (loopback is allowed at the sidecar port only) none is used
    refused = cli("nodes", "--job", "disc1", "--discover", env={"DYNPROF_RUN_DIR": str(node_dirs[0])})
    assert refused.returncode == 1 and "2 registration(s) refused" in refused.stderr, refused.stderr
    assert "--allow-hosts" in refused.stderr and "Traceback" not in refused.stderr


def test_discover_without_a_local_agent_says_what_to_do(node_dirs: list[Path], cli: Any) -> None:
    # GIVEN a node where no agent of the job runs
    # WHEN the job's nodes are asked for from its store
    out = cli("nodes", "--job", "nowhere", "--discover", env={"DYNPROF_RUN_DIR": str(node_dirs[2])})
    # THEN a clear error names the cause and the alternatives (exit 5: no agent)
    assert out.returncode == 5, out.stderr
    assert "no agent of job 'nowhere' on this node" in out.stderr
    assert "--hostfile" in out.stderr and "Traceback" not in out.stderr


def test_discover_in_a_job_without_a_process_group(node_dirs: list[Path], spawn: Any, cli: Any) -> None:
    # GIVEN a single-process job that never calls init_process_group
    target = spawn(
        ["-m", "dynprof", "run", "-q", "--", sys.executable, TRAIN, "--step-sleep", "0.05"],
        under_run=False,
        env={"DYNPROF_JOB_ID": "solo", "DYNPROF_RUN_DIR": str(node_dirs[0])},
    )
    target.ready_pids(timeout=90)
    # WHEN its nodes are asked for from its store
    out = cli("nodes", "--job", "solo", "--discover", env={"DYNPROF_RUN_DIR": str(node_dirs[0])})
    # THEN the agent says why it cannot (exit 7: unsupported in the target), with what to do
    assert out.returncode == 7, out.stderr
    assert "no torch.distributed process group" in out.stderr
    assert "--hosts/--hostfile/--slurm" in out.stderr
    assert not [line for line in target.lines if line.startswith("dynprof")]


def test_a_stopped_rank_does_not_delay_discovery(
    node_dirs: list[Path], spawn: Any, cli: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    import os
    import signal

    # GIVEN a 2-rank job on one node whose store is served by a launcher process (as torchrun's
    # agent serves it), and rank 0 stopped: its agent cannot answer
    port = _free_port()
    store = spawn(
        [
            "-c",
            "import time, torch.distributed as d; "
            f"s = d.TCPStore('127.0.0.1', {port}, is_master=True, wait_for_workers=False); "
            "print('READY 0', flush=True); time.sleep(120)",
        ],
        under_run=False,
    )
    store.ready_pids(timeout=60)
    env = {
        "WORLD_SIZE": "2",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": port,
        "TORCHELASTIC_USE_AGENT_STORE": "True",
        "DYNPROF_JOB_ID": "stopped",
        "DYNPROF_RUN_DIR": str(node_dirs[0]),
    }
    ranks = []
    for rank in (0, 1):
        args = ["-m", "dynprof", "run", "-q", "--", sys.executable, TRAIN, "--dist", "--step-sleep", "0.05"]
        ranks.append(spawn(args, under_run=False, env={**env, "RANK": str(rank)}))
    pids = [t.ready_pids(timeout=90)[0] for t in ranks]
    # both registered (they do so right after init_process_group)
    deadline = time.monotonic() + 60
    while True:
        out = cli("nodes", "--job", "stopped", "--discover", "--json", env={"DYNPROF_RUN_DIR": str(node_dirs[0])})
        if out.returncode == 0 and len(json.loads(out.stdout)["ranks"]) == 2:
            break
        assert time.monotonic() < deadline, f"the ranks did not register: {out.stdout} {out.stderr}"
        time.sleep(0.5)
    monkeypatch.setenv("DYNPROF_RUN_DIR", str(node_dirs[0]))
    os.kill(pids[0], signal.SIGSTOP)
    try:
        # WHEN the job's nodes are asked for, by the CLI and, timed, by the same call in this
        # process with a long wait for each agent (the stopped rank cannot answer within it)
        out = cli("nodes", "--job", "stopped", "--discover", "--json", env={"DYNPROF_RUN_DIR": str(node_dirs[0])})
        t0 = time.monotonic()
        found = discovery.discover_job("stopped", timeout=STOPPED_RANK_WAIT_S)
        elapsed = time.monotonic() - t0
    finally:
        os.kill(pids[0], signal.SIGCONT)
    # THEN rank 1 answers, with both ranks' registrations
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert data["asked_pid"] == pids[1]
    assert [r["rank"] for r in data["ranks"]] == [0, 1]
    assert found.asked_pid == pids[1] and [r["rank"] for r in found.ranks] == [0, 1]
    # AND it did not wait for the stopped rank's answer (at least STOPPED_RANK_WAIT_S s)
    assert elapsed < STOPPED_RANK_WAIT_S, elapsed


def test_a_job_level_command_reaches_every_discovered_node(spawn: Any, cli: Any, tmp_path: Path, parked: Any) -> None:
    # GIVEN two simulated nodes, each a sidecar on a loopback port with its own run directory,
    # and a 2-rank gloo job split over them whose ranks name their node's sidecar
    token = token_file(tmp_path, "discover-test-token-0123456789")
    layout = (("node-0", "127.0.0.1"), ("node-1", "127.0.0.1"))
    with sidecar_nodes(tmp_path, token, layout) as sims:
        addresses = [sim.address for sim in sims]
        hold = ["--hold", "sleep", "--seconds", "90"]
        ranks = split_job(spawn, HANG, sims, "e2e", hold, rank_env=lambda r: {"DYNPROF_SIDECAR": addresses[r]})
        try:
            for target in ranks:
                parked(target.ready_pids(timeout=90)[0])  # rank 0 in its all_reduce, rank 1 in its sleep
            # WHEN, on node 0, the stacks of the whole job are asked for with --discover
            out = cli(
                "stacks",
                "--job",
                "e2e",
                "--discover",
                "--allow-hosts",
                ",".join(addresses),
                "--json",
                "--no-save",
                env={"DYNPROF_RUN_DIR": str(sims[0].run_dir), "DYNPROF_TOKEN_FILE": str(token)},
            )
            # THEN both nodes are reached through their sidecars, and each rank is named where it waits
            assert out.returncode == 0, out.stderr
            data = json.loads(out.stdout)
            # (job-wide, a process's host is the node it was read on, as the node list names it: both
            # sidecars are on this machine, so each is named host:port)
            assert sorted((p["rank"], p["host"]) for p in data["processes"]) == [(0, addresses[0]), (1, addresses[1])]
            headlines = {tuple(g["ranks"]): g["headline"] for g in data["groups"]}
            assert headlines[(0,)].startswith("in all_reduce")
            assert headlines[(1,)].startswith("in wait_for_data")
            assert sorted(n["node"] for n in data["nodes"]) == sorted(addresses)
        finally:
            for target in ranks:
                target.stop()  # before their run directories go
