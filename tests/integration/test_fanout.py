"""Commands over many nodes, simulated on this machine.

Each "node" is a `dynprof serve` subprocess on a loopback port with its own DYNPROF_RUN_DIR,
artifact store and DYNPROF_HOST; the ranks of one gloo job are split across the nodes (each
rank started with its node's directories). The CLI runs from a third place with no agents:
its own empty run directory and store (the autouse fixture's).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from collectors.torch_trace import profiler_steps, read_trace
from tests._ports import free_port

ROOT = Path(__file__).resolve().parents[2]
HANG = "tests/integration/programs/hang_program.py"
STRAGGLER = "tests/integration/programs/straggler_program.py"


def token_file(directory: Path, token: str) -> Path:
    path = directory / "token"
    path.write_text(token + "\n")
    path.chmod(0o600)
    return path


@dataclass
class SimNode:
    name: str  # its DYNPROF_HOST
    address: str  # what --hosts names
    run_dir: Path
    artifacts: Path
    proc: subprocess.Popen[bytes]

    @property
    def env(self) -> dict[str, str]:
        """The environment of a rank that runs on this node."""
        return {
            "DYNPROF_RUN_DIR": str(self.run_dir),
            "DYNPROF_ARTIFACT_DIR": str(self.artifacts),
            "DYNPROF_HOST": self.name,
        }


@pytest.fixture
def nodes(tmp_path: Path) -> Iterator[dict[str, Any]]:
    """Two sidecars, A on 127.0.0.1 and B on localhost (so the output names them apart), one token."""
    token = token_file(tmp_path, "fanout-test-token-0123456789")
    sims: list[SimNode] = []
    try:
        for name, host in (("node-a", "127.0.0.1"), ("node-b", "localhost")):
            run_dir = Path(tempfile.mkdtemp(prefix=f"dp-{name[-1]}-", dir="/tmp"))
            port = free_port()
            sim = SimNode(name, f"{host}:{port}", run_dir, tmp_path / f"store-{name}", None)  # type: ignore[arg-type]
            env = {**os.environ, **sim.env, "PYTHONUNBUFFERED": "1"}
            env.pop("DYNPROF_TOKEN_FILE", None)
            with open(tmp_path / f"serve-{name}.log", "wb") as log:  # the child keeps its own descriptor
                sim.proc = subprocess.Popen(
                    [sys.executable, "-m", "dynprof", "serve", "--port", str(port), "--token-file", str(token)],
                    env=env,
                    cwd=str(ROOT),
                    stdout=subprocess.DEVNULL,
                    stderr=log,
                    start_new_session=True,
                )
            sims.append(sim)
        for sim in sims:
            _wait_listening(int(sim.address.rsplit(":", 1)[1]), sim.proc)
        yield {"a": sims[0], "b": sims[1], "token": token, "hosts": ",".join(s.address for s in sims)}
    finally:
        for sim in sims:
            sim.proc.terminate()
            try:
                sim.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                sim.proc.kill()
                sim.proc.wait(timeout=10)
            import shutil

            shutil.rmtree(sim.run_dir, ignore_errors=True)


def _wait_listening(port: int, proc: subprocess.Popen[bytes], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, "dynprof serve exited"
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                return
        except OSError:
            time.sleep(0.1)
    raise AssertionError(f"dynprof serve is not listening on {port} after {timeout} s")


def dynprof(*args: str, token: Path | None = None, timeout: float = 90) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    if token is not None:
        env["DYNPROF_TOKEN_FILE"] = str(token)
    return subprocess.run(
        [sys.executable, "-m", "dynprof", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        cwd=str(ROOT),
    )


def split_job(
    spawn: Any,
    program: str,
    placement: list[SimNode],
    job: str,
    args: list[str],
    run_args: tuple[str, ...] = (),
    rank_env: Any = None,
) -> list[Any]:
    """A gloo job of len(placement) ranks, rank i started (under `dynprof run RUN_ARGS`) on placement[i]'s node;
    ``rank_env(i)`` adds to rank i's environment."""
    master = str(free_port())
    targets = []
    for rank, sim in enumerate(placement):
        env = {
            **sim.env,
            "RANK": str(rank),
            "WORLD_SIZE": str(len(placement)),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": master,
            "DYNPROF_JOB_ID": job,
            **(rank_env(rank) if rank_env else {}),
        }
        cmd = ["-m", "dynprof", "run", "-q", *run_args, "--", sys.executable, program, *args]
        targets.append(spawn(cmd, under_run=False, env=env))
    return targets


def test_stacks_over_two_nodes_groups_all_ranks_and_names_the_odd_rank_with_its_node(nodes, spawn, tmp_path, parked):
    # GIVEN a 3-rank job: ranks 0 and 1 on node A, rank 2 on node B; rank 0 waits in an
    # all_reduce, ranks 1 and 2 sleep in wait_for_data
    a, b = nodes["a"], nodes["b"]
    targets = split_job(spawn, HANG, [a, a, b], "fan-stacks", ["--hold", "sleep", "--seconds", "90"])
    for t in targets:
        parked(t.ready_pids(timeout=90)[0])  # rank 0 enters the collective right after its READY line

    # WHEN the stacks of the job are asked for from here (no agents), through both sidecars
    fetched = tmp_path / "fetched"
    out = dynprof(
        "stacks", "--job", "fan-stacks", "--hosts", nodes["hosts"], "--json", "--fetch", str(fetched),
        token=nodes["token"],
    )  # fmt: skip

    # THEN every rank of every node is read and grouped by where it waits
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    label_a, label_b = "127.0.0.1", "localhost"
    assert [(p["rank"], p["host"]) for p in doc["processes"]] == [(0, label_a), (1, label_a), (2, label_b)]
    assert [n["ok"] for n in doc["nodes"]] == [True, True]
    big, odd = doc["groups"]
    assert big["ranks"] == [1, 2] and big["label"] == f"rank 1 on {label_a}, rank 2 on {label_b}"
    assert "wait_for_data" in big["headline"]
    assert odd["outlier"] and odd["odd"] == [f"rank 0 on {label_a}"]
    assert "all_reduce" in odd["headline"] or "collective_wait" in odd["headline"]
    assert len(doc["artifacts"]) == 2
    # each node's stacks artifact is copied back, its files checked
    assert [f["error"] for f in doc["fetched"]] == [None, None]
    assert all((Path(f["path"]) / "merged.json").is_file() for f in doc["fetched"])

    # and the human view names the odd rank with its node
    text = dynprof("stacks", "--job", "fan-stacks", "--hosts", nodes["hosts"], "--no-save", token=nodes["token"])
    assert text.returncode == 0, text.stderr
    assert f"rank 0 on {label_a}: in " in text.stdout and "<- outlier" in text.stdout


def test_start_over_two_nodes_traces_both_ranks_from_the_same_step(nodes, spawn, tmp_path):
    # GIVEN a 2-rank training job, rank 0 on node A and rank 1 on node B
    a, b = nodes["a"], nodes["b"]
    targets = split_job(spawn, STRAGGLER, [a, b], "fan-start", ["--base-load-ms", "20", "--max-seconds", "90"])
    for t in targets:
        t.ready_pids(timeout=90)

    # WHEN ps lists the job across the nodes and a third, closed, port
    closed = f"127.0.0.1:{free_port()}"
    ps = dynprof("ps", "--job", "fan-start", "--hosts", f"{nodes['hosts']},{closed}", "--json", token=nodes["token"])

    # THEN both ranks are listed in rank order with their node (named with its port where two
    # nodes share a host), and the closed node is named
    assert ps.returncode == 12, ps.stderr
    doc = json.loads(ps.stdout)
    assert [(r["rank"], r["node"], r["host"]) for r in doc["agents"]] == [
        (0, a.address, "node-a"),
        (1, "localhost", "node-b"),
    ]
    dead = doc["nodes"][2]
    assert dead["node"] == closed and not dead["ok"] and "connection refused" in dead["error"]
    assert f"node {closed}: connection refused" in ps.stderr

    # WHEN a 3-step trace is started on every rank of the job, fetched back here
    fetched = tmp_path / "fetched"
    out = dynprof(
        "start", "--job", "fan-start", "--hosts", nodes["hosts"], "--steps", "3", "--json",
        "--fetch", str(fetched), token=nodes["token"], timeout=120,
    )  # fmt: skip

    # THEN both ranks got the one chosen start step, and their traces begin after it
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    at = doc["at_step"]
    assert at > 0 and doc["missed"] == []
    assert [(r["rank"], r["node"], r["start_step"], r["status"]) for r in doc["results"]] == [
        (0, "127.0.0.1", at, "complete"),
        (1, "localhost", at, "complete"),
    ]
    assert [f["error"] for f in doc["fetched"]] == [None, None]
    firsts = []
    for f in doc["fetched"]:
        manifest = json.loads((Path(f["path"]) / "manifest.json").read_text())
        assert manifest["summary"]["start_step"] == at
        assert Path(f["path"]).relative_to(fetched).parts[:4] == (
            "fan-start",
            manifest["host"],
            f"rank{manifest['rank']}",
            "trace",
        )
        steps = [s["name"] for s in profiler_steps(read_trace(Path(f["path"]) / "trace.json.gz"))]
        assert len(steps) == 3
        firsts.append(steps[0])
    assert firsts[0] == firsts[1]

    # WHEN stop fans out with no trace running
    stop = dynprof("stop", "--job", "fan-start", "--hosts", nodes["hosts"], "--json", token=nodes["token"])

    # THEN each node answers for its rank (nothing to stop: exit 1, the nodes' own code)
    assert stop.returncode == 1, stop.stderr
    doc = json.loads(stop.stdout)
    assert [(r["rank"], r["status"]) for r in doc["results"]] == [(0, "not-running"), (1, "not-running")]
    assert [n["answered"] for n in doc["nodes"]] == [True, True]


def test_nccl_over_two_nodes_analyses_every_rank_s_dump_together(nodes, spawn, parked):
    from collectors.flight_recorder import detect_environment

    if not detect_environment().names & {"TORCH_FR_BUFFER_SIZE"}:
        pytest.skip("this torch has no flight recorder for Gloo (CPU)")
    # GIVEN a 2-rank job with the flight recorder, rank 0 on node A waiting in an all_reduce
    # that rank 1, on node B, never enters
    a, b = nodes["a"], nodes["b"]
    targets = split_job(
        spawn, HANG, [a, b], "fan-nccl", ["--hold", "sleep", "--seconds", "90"], ("--flight-recorder", "64")
    )
    for t in targets:
        parked(t.ready_pids(timeout=90)[0])

    # WHEN the recorders are collected through both sidecars (each rank's dump read back from
    # its node's nccl artifact)
    out = dynprof("nccl", "--job", "fan-nccl", "--hosts", nodes["hosts"], "--json", token=nodes["token"])

    # THEN one analysis over both nodes names the rank that is missing from the collective
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    assert doc["ranks"] == {"0": "127.0.0.1", "1": "localhost"}
    (pg,) = doc["analysis"]["process_groups"]
    assert pg["hung"] and pg["waiting"] == [0] and pg["missing"] == [1]
    assert not [n for n in doc["notes"] if "cannot be read" in n]
    assert len(doc["artifacts"]) == 2


def test_wrong_or_missing_token_is_refused(nodes, tmp_path):
    # GIVEN a token file that is not the sidecars'
    wrong = tmp_path / "wrong"
    wrong.mkdir()
    bad = token_file(wrong, "not-the-sidecar-token-000")

    # WHEN ps fans out with it
    out = dynprof("ps", "--hosts", nodes["hosts"], "--json", "--token-file", str(bad))

    # THEN every node refuses it, and each is named with the reason
    assert out.returncode == 12
    doc = json.loads(out.stdout)
    assert [n["ok"] for n in doc["nodes"]] == [False, False]
    assert all(n["error"].startswith("401: wrong token") for n in doc["nodes"])
    assert "401: wrong token" in out.stderr

    # and the right token, with the nodes from a host file, is taken
    hostfile = tmp_path / "hosts"
    hostfile.write_text("# the job's nodes\n" + "\n".join(f"{n} slots=1" for n in nodes["hosts"].split(",")) + "\n")
    good = dynprof("ps", "--hostfile", str(hostfile), "--json", token=nodes["token"])
    assert good.returncode == 0, good.stderr
    assert [n["ok"] for n in json.loads(good.stdout)["nodes"]] == [True, True]

    # and without any token the command does not even ask
    none = dynprof("ps", "--hosts", nodes["hosts"])
    assert none.returncode == 2 and "access token" in none.stderr

    # and a token file open to others is refused before anything is sent
    bad.chmod(0o644)
    loose = dynprof("ps", "--hosts", nodes["hosts"], "--token-file", str(bad))
    assert loose.returncode == 4 and "chmod 600" in loose.stderr


def test_ls_over_nodes_lists_and_fetches_artifacts_checked_against_the_manifest(nodes, tmp_path):
    # GIVEN one artifact in each node's store
    from dynprof.store import ArtifactStore

    ids = []
    for sim in (nodes["a"], nodes["b"]):
        w = ArtifactStore(sim.artifacts).create("healthcheck", job="fan-ls", host=sim.name)
        w.write_text("notes.txt", f"from {sim.name}\n")
        ids.append(w.finish("complete").id)

    # WHEN they are listed and fetched through the sidecars
    dest = tmp_path / "copy"
    out = dynprof(
        "ls", "--job", "fan-ls", "--hosts", nodes["hosts"], "--json", "--fetch", str(dest), token=nodes["token"]
    )

    # THEN both are listed with their node and copied in the store's layout
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    assert sorted(a["id"] for a in doc["artifacts"]) == sorted(ids)
    assert sorted(f["id"] for f in doc["fetched"] if f["error"] is None) == sorted(ids)
    for sim, art_id in zip((nodes["a"], nodes["b"]), ids):
        assert (dest / art_id / "notes.txt").read_text() == f"from {sim.name}\n"
        assert json.loads((dest / art_id / "manifest.json").read_text())["host"] == sim.name
        assert {oct(f.stat().st_mode & 0o777) for f in (dest / art_id).iterdir()} == {"0o600"}

    # and fetching again copies nothing twice
    again = dynprof(
        "ls", "--job", "fan-ls", "--hosts", nodes["hosts"], "--json", "--fetch", str(dest), token=nodes["token"]
    )
    assert again.returncode == 0, again.stderr
    assert [f.get("already_there") for f in json.loads(again.stdout)["fetched"]] == [True, True]
