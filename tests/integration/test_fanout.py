"""Commands over many nodes, simulated on this machine.

Each "node" is a `dynprof serve` subprocess on a loopback port with its own DYNPROF_RUN_DIR,
artifact store and DYNPROF_HOST (tests/support/nodes.py, the ``sim_nodes`` fixture); the
ranks of one gloo job are split across the nodes (each rank started with its node's
directories). The CLI runs from a third place with no agents:
its own empty run directory and store (the autouse fixture's).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from collectors.torch_trace import profiler_steps, read_trace
from tests._ports import free_port
from tests.support.nodes import dynprof, split_job, token_file

HANG = "tests/integration/programs/hang_program.py"
STRAGGLER = "tests/integration/programs/straggler_program.py"


def test_stacks_over_two_nodes_groups_all_ranks_and_names_the_odd_rank_with_its_node(
    sim_nodes, spawn, tmp_path, parked
):
    # GIVEN a 3-rank job: ranks 0 and 1 on node A, rank 2 on node B; rank 0 waits in an
    # all_reduce, ranks 1 and 2 sleep in wait_for_data
    a, b = sim_nodes["a"], sim_nodes["b"]
    targets = split_job(spawn, HANG, [a, a, b], "fan-stacks", ["--hold", "sleep", "--seconds", "90"])
    for t in targets:
        parked(t.ready_pids(timeout=90)[0])  # rank 0 enters the collective right after its READY line

    # WHEN the stacks of the job are asked for from here (no agents), through both sidecars
    fetched = tmp_path / "fetched"
    out = dynprof(
        "stacks", "--job", "fan-stacks", "--hosts", sim_nodes["hosts"], "--json", "--fetch", str(fetched),
        token=sim_nodes["token"],
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
    text = dynprof(
        "stacks", "--job", "fan-stacks", "--hosts", sim_nodes["hosts"], "--no-save", token=sim_nodes["token"]
    )
    assert text.returncode == 0, text.stderr
    assert f"rank 0 on {label_a}: in " in text.stdout and "<- outlier" in text.stdout


def test_start_over_two_nodes_traces_both_ranks_from_the_same_step(sim_nodes, spawn, tmp_path):
    # GIVEN a 2-rank training job, rank 0 on node A and rank 1 on node B
    a, b = sim_nodes["a"], sim_nodes["b"]
    targets = split_job(spawn, STRAGGLER, [a, b], "fan-start", ["--base-load-ms", "20", "--max-seconds", "90"])
    for t in targets:
        t.ready_pids(timeout=90)

    # WHEN ps lists the job across the nodes and a third, closed, port
    closed = f"127.0.0.1:{free_port()}"
    ps = dynprof(
        "ps", "--job", "fan-start", "--hosts", f"{sim_nodes['hosts']},{closed}", "--json", token=sim_nodes["token"]
    )

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
        "start", "--job", "fan-start", "--hosts", sim_nodes["hosts"], "--steps", "3", "--json",
        "--fetch", str(fetched), token=sim_nodes["token"], timeout=120,
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
    stop = dynprof("stop", "--job", "fan-start", "--hosts", sim_nodes["hosts"], "--json", token=sim_nodes["token"])

    # THEN each node answers for its rank (nothing to stop: exit 1, the nodes' own code)
    assert stop.returncode == 1, stop.stderr
    doc = json.loads(stop.stdout)
    assert [(r["rank"], r["status"]) for r in doc["results"]] == [(0, "not-running"), (1, "not-running")]
    assert [n["answered"] for n in doc["nodes"]] == [True, True]


def test_nccl_over_two_nodes_analyses_every_rank_s_dump_together(sim_nodes, spawn, parked):
    from collectors.flight_recorder import detect_environment

    if not detect_environment().names & {"TORCH_FR_BUFFER_SIZE"}:
        pytest.skip("this torch has no flight recorder for Gloo (CPU)")
    # GIVEN a 2-rank job with the flight recorder, rank 0 on node A waiting in an all_reduce
    # that rank 1, on node B, never enters
    a, b = sim_nodes["a"], sim_nodes["b"]
    targets = split_job(
        spawn, HANG, [a, b], "fan-nccl", ["--hold", "sleep", "--seconds", "90"], ("--flight-recorder", "64")
    )
    for t in targets:
        parked(t.ready_pids(timeout=90)[0])

    # WHEN the recorders are collected through both sidecars (each rank's dump read back from
    # its node's nccl artifact)
    out = dynprof("nccl", "--job", "fan-nccl", "--hosts", sim_nodes["hosts"], "--json", token=sim_nodes["token"])

    # THEN one analysis over both nodes names the rank that is missing from the collective
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    assert doc["ranks"] == {"0": "127.0.0.1", "1": "localhost"}
    (pg,) = doc["analysis"]["process_groups"]
    assert pg["hung"] and pg["waiting"] == [0] and pg["missing"] == [1]
    assert not [n for n in doc["notes"] if "cannot be read" in n]
    assert len(doc["artifacts"]) == 2


def test_wrong_or_missing_token_is_refused(sim_nodes, tmp_path):
    # GIVEN a token file that is not the sidecars'
    wrong = tmp_path / "wrong"
    wrong.mkdir()
    bad = token_file(wrong, "not-the-sidecar-token-000")

    # WHEN ps fans out with it
    out = dynprof("ps", "--hosts", sim_nodes["hosts"], "--json", "--token-file", str(bad))

    # THEN every node refuses it, and each is named with the reason
    assert out.returncode == 12
    doc = json.loads(out.stdout)
    assert [n["ok"] for n in doc["nodes"]] == [False, False]
    assert all(n["error"].startswith("401: wrong token") for n in doc["nodes"])
    assert "401: wrong token" in out.stderr

    # and the right token, with the nodes from a host file, is taken
    hostfile = tmp_path / "hosts"
    hostfile.write_text("# the job's nodes\n" + "\n".join(f"{n} slots=1" for n in sim_nodes["hosts"].split(",")) + "\n")
    good = dynprof("ps", "--hostfile", str(hostfile), "--json", token=sim_nodes["token"])
    assert good.returncode == 0, good.stderr
    assert [n["ok"] for n in json.loads(good.stdout)["nodes"]] == [True, True]

    # and without any token the command does not even ask
    none = dynprof("ps", "--hosts", sim_nodes["hosts"])
    assert none.returncode == 2 and "access token" in none.stderr

    # and a token file open to others is refused before anything is sent
    bad.chmod(0o644)
    loose = dynprof("ps", "--hosts", sim_nodes["hosts"], "--token-file", str(bad))
    assert loose.returncode == 4 and "chmod 600" in loose.stderr


def test_ls_over_nodes_lists_and_fetches_artifacts_checked_against_the_manifest(sim_nodes, tmp_path):
    # GIVEN one artifact in each node's store
    from dynprof.store import ArtifactStore

    ids = []
    for sim in (sim_nodes["a"], sim_nodes["b"]):
        w = ArtifactStore(sim.artifacts).create("healthcheck", job="fan-ls", host=sim.name)
        w.write_text("notes.txt", f"from {sim.name}\n")
        ids.append(w.finish("complete").id)

    # WHEN they are listed and fetched through the sidecars
    dest = tmp_path / "copy"
    out = dynprof(
        "ls", "--job", "fan-ls", "--hosts", sim_nodes["hosts"], "--json", "--fetch", str(dest), token=sim_nodes["token"]
    )

    # THEN both are listed with their node and copied in the store's layout
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    assert sorted(a["id"] for a in doc["artifacts"]) == sorted(ids)
    assert sorted(f["id"] for f in doc["fetched"] if f["error"] is None) == sorted(ids)
    for sim, art_id in zip((sim_nodes["a"], sim_nodes["b"]), ids):
        assert (dest / art_id / "notes.txt").read_text() == f"from {sim.name}\n"
        assert json.loads((dest / art_id / "manifest.json").read_text())["host"] == sim.name
        assert {oct(f.stat().st_mode & 0o777) for f in (dest / art_id).iterdir()} == {"0o600"}

    # and fetching again copies nothing twice
    again = dynprof(
        "ls", "--job", "fan-ls", "--hosts", sim_nodes["hosts"], "--json", "--fetch", str(dest), token=sim_nodes["token"]
    )
    assert again.returncode == 0, again.stderr
    assert [f.get("already_there") for f in json.loads(again.stdout)["fetched"]] == [True, True]
