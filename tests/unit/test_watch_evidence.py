"""The evidence a watch gathers for a hang verdict: the flight recorder of a job without it (said,
nothing written) and the healthcheck of the job's nodes (its own ranks are no other processes)."""

from __future__ import annotations

import argparse
from typing import Any

import pytest

from collectors.flight_recorder import collect as nccl
from dynprof import errors
from dynprof.cli import _watching
from dynprof.nodes import CommandError, Node, NodeAnswer
from dynprof.registry import AgentRecord
from dynprof.store import ArtifactStore
from dynprof.watch import evidence
from dynprof.watch.model import RankProgress
from dynprof.watch.sources import FLIGHT_RECORDER_OFF, LocalSource, SidecarSource
from tests.support.records import agent_record

A, B = Node("node-a", 8787), Node("node-b", 8787)


def _record(pid: int, rank: int) -> AgentRecord:
    return agent_record(pid, rank=rank, world_size=2, job_id="frjob")


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
    analysis, note = LocalSource(host="h").flight_recorder("frjob")
    # THEN its verdict says the recorder is not on, and how to have it
    assert analysis is None and note == FLIGHT_RECORDER_OFF
    assert "dynprof run --flight-recorder" in note


def test_the_nodes_watch_says_the_recorder_is_off_for_the_job_and_checks_health_for_it(monkeypatch):
    # GIVEN two nodes whose ranks all answer that the recorder is off
    nodes = RecorderOffNodes()
    monkeypatch.setattr(_watching, "client_for", lambda args: nodes)
    args = argparse.Namespace(token_file=None, cacert=None, node_timeout=10.0, max_in_flight=4)
    source = _watching.node_source(args, [A, B])
    # WHEN the watch reads the flight recorder, then the nodes' health for the job
    analysis, note = source.flight_recorder("frjob")
    health = source.healthcheck(source.nodes(), "frjob")
    # THEN the recorder is said to be off for the job, and each healthcheck is told the job
    assert analysis is None and note == FLIGHT_RECORDER_OFF
    asked = [options for _, name, options in nodes.calls if name == "healthcheck"]
    assert asked == [{"level": "quick", "no_save": True, "job": "frjob"}] * 2
    assert set(health) == set(source.nodes())


def test_this_node_s_watch_runs_the_healthcheck_for_the_job(monkeypatch):
    # GIVEN the healthcheck kind's requests recorded (each still run, in its child process)
    from healthcheck import collect as hc_collect

    asked: list[hc_collect.HealthcheckRequest] = []
    real = hc_collect.collect

    def recording(request: hc_collect.HealthcheckRequest) -> Any:
        asked.append(request)
        return real(request)

    monkeypatch.setattr(hc_collect, "collect", recording)
    # WHEN the watch checks this node for job frjob
    health = LocalSource(host="h").healthcheck(["h"], "frjob")
    # THEN the quick healthcheck is told the job (its ranks are its own processes), and what it
    # found is kept under this node's name
    assert [(r.level, r.job) for r in asked] == [("quick", "frjob")]
    assert set(health) == {"h"}
    assert health["h"]["verdict"] in ("healthy", "warning", "unhealthy", "could not run")
    assert sum(health["h"]["counts"].values()) >= 1


def test_this_node_s_healthcheck_that_cannot_run_is_said_with_why(monkeypatch):
    # GIVEN a healthcheck that ends without a report
    from healthcheck import collect as hc_collect

    def broken(request: hc_collect.HealthcheckRequest) -> Any:
        raise errors.Timeout(f"the healthcheck ran past {request.timeout:g} s and was killed")

    monkeypatch.setattr(hc_collect, "collect", broken)
    # WHEN the watch checks this node
    health = LocalSource(host="h").healthcheck(["h"], None)
    # THEN the node's evidence says it could not run, and why
    assert health == {
        "h": {"verdict": "could not run", "error": "the healthcheck ran past 120 s and was killed", "problems": []}
    }


def test_with_gpu_coredump_the_culprits_with_unfinished_gpu_work_are_dumped_once_and_named():
    from dynprof.watch.evidence import name_kernels_of

    calls: list[tuple[str, int]] = []

    def take(node: str, pid: int) -> dict:
        calls.append((node, pid))
        return {"kernel": "running spin_kernel(long)<<<(1,1,1),(1,1,1)>>>", "coredump": {"artifact": "/a"}}

    def item(pid: int, done: bool, armed: bool = True) -> dict:
        return {
            "pid": pid,
            "host": "vm",
            "line": f"GPU 0 busy (pid {pid})",
            "kernel": "not named",
            "gpu_step": {"step": 6, "done": done, "coredump_armed": armed},
        }

    dumps: dict = {}
    # GIVEN a culprit behind unfinished GPU work, one whose work finished, one not armed
    items = [item(11, done=False), item(12, done=True), item(13, done=False, armed=False)]
    name_kernels_of(take, dumps, items)
    # THEN only the first is dumped, and its kernel is in its evidence and its line
    assert calls == [("vm", 11)]
    assert items[0]["kernel"] == "running spin_kernel(long)<<<(1,1,1),(1,1,1)>>>"
    assert items[0]["line"].endswith("; its GPU ran spin_kernel(long)<<<(1,1,1),(1,1,1)>>>")
    assert items[0]["coredump"] == {"artifact": "/a"}
    assert items[1]["kernel"] == items[2]["kernel"] == "not named"
    # AND a rank whose marked step finished but that waits for its GPU in a blocking call (its
    # endless kernel queued after the step's marker) is dumped too
    waits = [item(14, done=True)]
    name_kernels_of(take, dumps, waits, {("vm", 14)})
    assert calls == [("vm", 11), ("vm", 14)] and waits[0]["kernel"].startswith("running ")
    calls.remove(("vm", 14))
    # AND a later verdict of the same process says the same without a second dump
    again = [item(11, done=False)]
    name_kernels_of(take, dumps, again)
    assert calls == [("vm", 11)] and again[0]["kernel"] == items[0]["kernel"]
    # AND a watch whose source cannot dump (the sidecars') says where it can be done
    remote = SidecarSource(object(), [Node("vm", 8787)])
    far = [item(21, done=False)]
    name_kernels_of(remote.gpu_coredump, {}, far)
    assert (
        "dumps GPUs on its own node only" in far[0]["kernel"]
        and "dynprof gpu-coredump --pid 21 --yes" in far[0]["kernel"]
    )


def _report(*checks: Any) -> Any:
    from healthcheck.report import Report

    return Report(level="quick", backend="nvml", started_at="2026-01-01T00:00:00Z", duration_s=1.0, checks=list(checks))


def test_a_decoded_report_is_summed_up_as_the_report_s_document_is():
    # GIVEN a node's report with a failing, a warning, an unknown and a passing check
    from healthcheck.fleet import NodeReport
    from healthcheck.result import CheckResult, Status

    report = _report(
        CheckResult("xid_errors", Status.FAIL, "Xid 79 on GPU 3: fallen off the bus", device=3, action="drain"),
        CheckResult("clock_events", Status.WARN, "thermal slowdown", device=1),
        CheckResult("ib_ports", Status.UNKNOWN, "no InfiniBand port readable"),
        CheckResult("disk_free", Status.PASS, "120 GiB free"),
    )
    doc = report.to_json()
    # WHEN it is summed up decoded (this node's, from the kind's entry point) and as a document
    # (a node's sidecar answer)
    decoded = evidence.report_summary(NodeReport.from_json(doc))
    # THEN both say the same: its verdict, its counts and the checks that did not pass
    assert decoded == evidence.healthcheck_summary(doc)
    assert decoded["verdict"] == "unhealthy" and decoded["exit_code"] == 2
    assert decoded["counts"] == {"pass": 1, "warn": 1, "fail": 1, "unknown": 1, "skipped": 0}
    assert [(p["name"], p["device"]) for p in decoded["problems"]] == [
        ("xid_errors", 3),
        ("clock_events", 1),
        ("ib_ports", None),
    ]


def test_what_is_not_a_report_is_unreadable_and_long_text_is_cut():
    # GIVEN a node's answer that is no object, and one with an endless reason
    long = {"verdict": "warning", "checks": [{"name": "x" * 500, "status": "warn", "reason": "r" * 5000}]}
    # WHEN summed up
    # THEN the first is unreadable, the second's text bounded
    assert evidence.healthcheck_summary(["not", "a", "report"]) == {"verdict": "unreadable", "problems": []}
    (problem,) = evidence.healthcheck_summary(long)["problems"]
    assert len(problem["name"]) == 100 and len(problem["reason"]) == 300


def test_the_flight_recorder_s_findings_keep_each_process_group_s_verdict_only():
    analysis = {
        "process_groups": [
            {
                "process_group": "0",
                "collective": "allreduce",
                "missing": [3],
                "verdict": "rank 3 missing",
                "ops": [1] * 9,
            },
            "not a group",
        ]
        * 40
    }
    kept = evidence.fr_summary(analysis)
    assert kept is not None and len(kept) == 40  # the groups that are objects, at most 64
    assert kept[0] == {
        "process_group": "0",
        "collective": "allreduce",
        "waiting": None,
        "missing": [3],
        "hung": None,
        "verdict": "rank 3 missing",
    }
    assert evidence.fr_summary(None) is None


def test_a_rank_s_unread_stacks_are_said_with_its_node_s_or_its_own_failure():
    row = RankProgress(job="j", rank=1, world_size=2, pid=4242, host="n1", step=3)
    assert evidence.failure_of({"node n1": "connection refused"}, "n1", row) == "connection refused"
    assert evidence.failure_of({"pid 4242 on n1": "py-spy: " + "x" * 400}, "n1", row) == ("py-spy: " + "x" * 400)[:300]
    assert evidence.failure_of({"node n2": "down", "pid 4242 on n2": "gone"}, "n1", row) is None


def test_the_stacks_evidence_keeps_the_groups_and_who_is_in_them():
    from collectors.stacks import Frame, ProcessStacks, Source, Stacks, ThreadStack, merge

    def process(pid: int, rank: int, where: str) -> ProcessStacks:
        frames = [Frame(where, "/job/train.py", 10), Frame("main", "/job/train.py", 1)]
        return ProcessStacks(pid=pid, method="py-spy", rank=rank, threads=[ThreadStack(pid, main=True, frames=frames)])

    stacks = merge(
        [Source(Stacks([process(1, 0, "all_reduce"), process(2, 1, "all_reduce"), process(3, 2, "load")]), node="n")],
        by_host=True,
    )
    kept = evidence.stacks_evidence(stacks)
    assert kept["processes"] == 3 and kept["file"] == "stacks.json"
    assert sorted(g["size"] for g in kept["groups"]) == [1, 2]
    assert {m["rank"] for g in kept["groups"] for m in g["members"]} == {0, 1, 2}
    assert evidence.by_process(stacks).keys() == {("n", 1), ("n", 2), ("n", 3)}
