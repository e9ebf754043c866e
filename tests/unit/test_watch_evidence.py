"""The evidence a watch gathers for a hang verdict: the flight recorder of a job without it (said,
nothing written) and the healthcheck of the job's nodes (its own ranks are no other processes)."""

from __future__ import annotations

import argparse
import os
from typing import Any

import pytest

from collectors.flight_recorder import collect as nccl
from dynprof import errors
from dynprof.cli import job as job_cli
from dynprof.cli import watch as watch_cli
from dynprof.nodes import CommandError, Node, NodeAnswer
from dynprof.registry import AgentRecord
from dynprof.store import ArtifactStore
from dynprof.watch.engine import FLIGHT_RECORDER_OFF

A, B = Node("node-a", 8787), Node("node-b", 8787)


def _record(pid: int, rank: int) -> AgentRecord:
    return AgentRecord(
        pid=pid, ppid=1, host="h", rank=rank, local_rank=rank, world_size=2, job_id="frjob", cmdline=["python"],
        python_version="3", torch_version=None, dynprof_version="0", started_at=0.0, start_ticks=None,
        socket="/x", log="", activation="run",
    )  # fmt: skip


def _off(pid: int) -> errors.Unsupported:
    return errors.Unsupported(f"pid {pid}: the flight recorder is off in this process", help="dynprof run ...")


class RecorderOffNodes:
    """Sidecars whose ranks all answer that the flight recorder is off; healthchecks answered."""

    max_in_flight = 4

    def __init__(self) -> None:
        self.calls: list[tuple[str, str, dict[str, Any]]] = []

    def action_all(self, nodes: list[Node], name: str, options: dict[str, Any], timeout: float | None = None):
        out = []
        for node in nodes:
            self.calls.append((node.address, name, dict(options)))
            if name == "nccl":
                off = _off(100)
                failure = CommandError("Unsupported", off.message, off.help, off.exit_code)
                out.append(NodeAnswer(node, True, host=node.host, exit_code=7, result={}, failure=failure))
            else:
                out.append(NodeAnswer(node, True, host=node.host, exit_code=0, result={"verdict": "healthy"}))
        return out


def test_a_job_without_the_recorder_leaves_no_nccl_artifact(monkeypatch):
    # GIVEN two ranks of a job whose agents both answer that the flight recorder is off
    monkeypatch.setattr(nccl, "_targets", lambda request: [(101, _record(101, 0)), (102, _record(102, 1))])

    def refuse(pid: int, record: Any, writer: Any, request: Any) -> Any:
        raise _off(pid)

    monkeypatch.setattr(nccl, "_dump", refuse)

    # WHEN their dumps are asked for (as the watch does at every hang verdict)
    with pytest.raises(errors.Unsupported) as raised:
        nccl.collect(nccl.NcclRequest(job="frjob"))

    # THEN the user is told why, and nothing is left in the store: no empty `failed` artifact
    assert "flight recorder is off" in raised.value.message
    assert ArtifactStore().list(kind="nccl") == []
    kind_dirs = [p for p in ArtifactStore().root.rglob("nccl") if p.is_dir()]
    assert [list(d.iterdir()) for d in kind_dirs] in ([], [[]])  # not even a temporary one


def test_a_rank_failing_otherwise_still_leaves_its_failed_artifact(monkeypatch):
    # GIVEN one rank whose dump fails for another reason than the recorder being off
    monkeypatch.setattr(nccl, "_targets", lambda request: [(101, _record(101, 0))])

    def broken(pid: int, record: Any, writer: Any, request: Any) -> Any:
        raise errors.DynprofError(f"pid {pid}: its dump cannot be read")

    monkeypatch.setattr(nccl, "_dump", broken)
    # WHEN
    with pytest.raises(errors.DynprofError):
        nccl.collect(nccl.NcclRequest(job="frjob"))
    # THEN the attempt is recorded, with its error
    (art,) = ArtifactStore().list(kind="nccl")
    assert art.manifest["status"] == "failed" and "cannot be read" in art.manifest["error"]


def test_this_node_s_watch_says_the_recorder_is_off_for_the_job(monkeypatch):
    # GIVEN this node's ranks all answering that the recorder is off
    def refuse(request: Any) -> Any:
        raise _off(101)

    monkeypatch.setattr(nccl, "collect", refuse)
    # WHEN the watch reads the flight recorder
    analysis, note = watch_cli.LocalSource(host="h").flight_recorder("frjob")
    # THEN its verdict says the recorder is not on, and how to have it
    assert analysis is None and note == FLIGHT_RECORDER_OFF
    assert "dynprof run --flight-recorder" in note


def test_the_nodes_watch_says_the_recorder_is_off_for_the_job_and_checks_health_for_it(monkeypatch):
    # GIVEN two nodes whose ranks all answer that the recorder is off
    nodes = RecorderOffNodes()
    monkeypatch.setattr(job_cli, "client_for", lambda args: nodes)
    args = argparse.Namespace(token_file=None, cacert=None, node_timeout=10.0, max_in_flight=4)
    source = watch_cli.node_source(args, [A, B])
    # WHEN the watch reads the flight recorder, then the nodes' health for the job
    analysis, note = source.flight_recorder("frjob")
    health = source.healthcheck(source.nodes(), "frjob")
    # THEN the recorder is said to be off for the job, and each healthcheck is told the job
    assert analysis is None and note == FLIGHT_RECORDER_OFF
    asked = [options for _, name, options in nodes.calls if name == "healthcheck"]
    assert asked == [{"level": "quick", "no_save": True, "job": "frjob"}] * 2
    assert set(health) == set(source.nodes())


def test_this_node_s_watch_runs_the_healthcheck_for_the_job(monkeypatch):
    # GIVEN the healthcheck child's command line recorded
    ran: list[list[str]] = []

    class Done:
        returncode, stdout, stderr = 0, '{"verdict": "healthy", "checks": []}', ""

    def run(cmd: list[str], **kwargs: Any) -> Done:
        ran.append(cmd)
        assert "DYNPROF" not in kwargs["env"]
        return Done()

    monkeypatch.setattr("subprocess.run", run)
    # WHEN the watch checks this node for job frjob
    health = watch_cli.LocalSource(host="h").healthcheck(["h"], "frjob")
    # THEN the healthcheck is told the job (its ranks are its own processes)
    (cmd,) = ran
    assert cmd[cmd.index("--job") + 1] == "frjob"
    assert set(health) == {"h"}
    assert os.environ.get("DYNPROF_ARTIFACT_DIR")  # the isolated store of the tests
