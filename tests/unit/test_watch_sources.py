"""Where the watch reads (dynprof.watch.sources): the nodes' sidecars, this node's agents (each read
through its kind's own entry point, replaced here), and the merge of one sample."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from collectors.stacks import Frame, ProcessStacks, Source, Stacks, ThreadStack
from dynprof import errors
from dynprof.job.client import NodeFailure
from dynprof.nodes import CommandError, Node, NodeAnswer
from dynprof.watch.model import NodeProgress
from dynprof.watch.sources import (
    FLIGHT_RECORDER_OFF,
    FLIGHT_RECORDER_TIMEOUT_S,
    HEALTHCHECK_TIMEOUT_S,
    LocalSource,
    SidecarSource,
    merged_with_native,
)
from dynprof.watch.traces import MAX_TRACE_DURATION_S, local_trace

A, B, C = Node("node-a", 8787), Node("node-b", 8787), Node("node-c", 8787)


def _process(pid: int, rank: int, where: str, native: bool = False) -> ProcessStacks:
    frames = [Frame(where, "/job/train.py" if not native else "libcuda.so", 10, native=native)]
    return ProcessStacks(pid=pid, method="py-spy", rank=rank, threads=[ThreadStack(pid, main=True, frames=frames)])


def test_a_native_read_replaces_the_plain_read_of_the_same_process_on_the_same_node_only():
    # GIVEN pid 7 read plainly on two nodes, and natively on node-a
    plain = [
        Source(Stacks([_process(7, 0, "train_step"), _process(8, 1, "train_step")]), node="node-a"),
        Source(Stacks([_process(7, 2, "train_step")]), node="node-b"),
    ]
    native = [Source(Stacks([_process(7, 0, "cudaStreamSynchronize", native=True)]), node="node-a")]
    # WHEN the sample is merged
    merged = merged_with_native(plain, native)
    # THEN node-a's pid 7 is its native read, the others their plain reads: each process once
    where = {(p.host, p.pid): p.threads[0].frames[0].function for p in merged.processes}
    assert where == {
        ("node-a", 7): "cudaStreamSynchronize",
        ("node-a", 8): "train_step",
        ("node-b", 7): "train_step",
    }


class Nodes:
    """Sidecars: node-a answers, node-b refuses, node-c sends what is not a progress document."""

    max_in_flight = 4

    def __init__(self) -> None:
        self.asked: list[tuple[str, str, dict[str, Any]]] = []

    def progress(self, node: Node, job: str | None = None, fresh: bool = False) -> dict[str, Any]:
        if node is B:
            raise NodeFailure("connection refused")
        if node is C:
            return {"ranks": "many"}
        return NodeProgress(host="node-a", time=5.0, poll_every_s=1.0).to_json()

    def action_all(self, nodes: list[Node], name: str, options: dict[str, Any], timeout: float | None = None):
        self.asked += [(n.host, name, dict(options)) for n in nodes]
        out = []
        for node in nodes:
            if node is A:
                doc = {"verdict": "healthy", "exit_code": 0, "counts": {"pass": 3}, "checks": []}
                out.append(NodeAnswer(node, True, host=node.host, exit_code=0, result=doc))
            elif node is B:
                out.append(NodeAnswer(node, False, error="timed out"))
            else:
                failure = CommandError("Busy", "a healthcheck is already running", "", 6)
                out.append(NodeAnswer(node, True, host=node.host, exit_code=6, result=None, failure=failure))
        return out


def test_the_nodes_that_do_not_answer_with_a_progress_document_are_named_with_why():
    source = SidecarSource(Nodes(), [A, B, C])
    reads = {r.node: r for r in source.progress("j")}
    assert source.nodes() == list(reads) == ["node-a", "node-b", "node-c"]
    assert reads["node-a"].progress is not None and reads["node-a"].error is None
    assert reads["node-b"].progress is None and reads["node-b"].error == "connection refused"
    assert reads["node-c"].progress is None and (reads["node-c"].error or "").startswith("not a progress document")


def test_each_node_s_healthcheck_is_summed_up_or_said_why_there_is_none():
    nodes = Nodes()
    source = SidecarSource(nodes, [A, B, C])
    # WHEN the involved nodes (and one this watch does not read) are checked for job j
    health = source.healthcheck(["node-a", "node-b", "node-c", "elsewhere"], "j")
    # THEN each node read is asked once, for the job, and its answer (or why none) is kept
    assert [(host, name) for host, name, _ in nodes.asked] == [
        ("node-a", "healthcheck"),
        ("node-b", "healthcheck"),
        ("node-c", "healthcheck"),
    ]
    assert all(options == {"level": "quick", "no_save": True, "job": "j"} for _, _, options in nodes.asked)
    assert health["node-a"] == {"verdict": "healthy", "exit_code": 0, "counts": {"pass": 3}, "problems": []}
    assert health["node-b"] == {"verdict": "no answer", "error": "timed out", "problems": []}
    assert health["node-c"] == {"verdict": "could not run", "error": "a healthcheck is already running", "problems": []}
    assert set(health) == {"node-a", "node-b", "node-c"}


def test_a_watch_without_the_flight_recorder_says_so():
    analysis, note = SidecarSource(Nodes(), [A]).flight_recorder("j")
    assert analysis is None and note == "the flight recorder is not read by this watch"


def test_the_nodes_flight_recorder_leaves_out_the_processes_whose_agents_did_not_answer():
    # GIVEN a sidecar watch of two nodes, and pid 12 on node-b and 13 on a node it does not watch
    # whose agents did not answer the look
    asked = []

    def read(job: str, skip: dict[Any, tuple[int, ...]]) -> tuple[dict[str, Any] | None, str | None]:
        asked.append((job, skip))
        return {"pgs": []}, None

    source = SidecarSource(Nodes(), [A, B], flight_recorder=read)
    # WHEN the watch reads the flight recorder
    analysis, note = source.flight_recorder("j", frozenset({("node-b", 12), ("node-b", 11), ("elsewhere", 13)}))
    # THEN node-b's sidecar is told to leave 11 and 12 out (the unknown node is nobody's), and the
    # note says who was not asked
    assert asked == [("j", {B: (11, 12)})]
    assert analysis == {"pgs": []}
    assert note == "not asked: process(es) whose agent did not answer the look (node-b: 11, 12)"
    # AND with every agent answering, every process is asked and nothing is noted
    assert source.flight_recorder("j") == ({"pgs": []}, None) and asked[-1] == ("j", {})


ESC = "\x1b[2J"


# -- this node's source ------------------------------------------------------------------------------
def test_the_local_source_is_this_node():
    source = LocalSource(host="node-x", stacks_timeout=4.0)
    assert source.nodes() == ["node-x"] and source.stacks_timeout == 4.0
    assert LocalSource().host  # detected (or the hostname): never empty


def test_the_local_progress_reads_this_nodes_agents_now():
    [read] = LocalSource(host="node-x").progress("no-such-job")
    assert read.node == "node-x" and read.error is None
    assert read.progress.host == "node-x" and read.progress.ranks == []


def _local_process(pid: int, function: str, native: bool = False) -> ProcessStacks:
    frames = [Frame(function=function, file="/t.py", line=3)]
    return ProcessStacks(
        pid=pid, method="py-spy", native=native, threads=[ThreadStack(tid=pid, main=True, frames=frames)]
    )


def test_the_local_stacks_are_read_plain_then_natively_for_the_asked_pids(monkeypatch):
    requests = []

    def collect(request):
        requests.append(request)
        if request.native:
            return SimpleNamespace(
                stacks=Stacks([_local_process(pid, "cudaSync", native=True) for pid in request.pids])
            )
        return SimpleNamespace(stacks=Stacks([_local_process(10, "step"), _local_process(11, "step")]))

    monkeypatch.setattr("collectors.stacks.collect.collect", collect)
    read = LocalSource(host="h", stacks_timeout=7.0).stacks("j", {"h": [11], "other": [99]})
    plain, native = requests
    assert (plain.job, plain.save, plain.timeout, plain.native) == ("j", False, 7.0, False)
    assert (native.pids, native.native, native.save) == ((11,), True, False)
    by_pid = {p.pid: p for p in read.stacks.processes}
    assert set(by_pid) == {10, 11} and by_pid[11].native and not by_pid[10].native
    assert read.failures == {}


def test_local_stacks_that_fail_are_named_by_node(monkeypatch):
    def collect(request):
        raise errors.NoAgent(f"no agent {ESC}")

    monkeypatch.setattr("collectors.stacks.collect.collect", collect)
    read = LocalSource(host="h").stacks("j", {})
    assert read.stacks.processes == [] and read.failures == {"node h": f"no agent {ESC}"}


@pytest.mark.parametrize(
    ("outcome", "expected"),
    [
        (errors.Unsupported("recorder off"), (None, FLIGHT_RECORDER_OFF)),
        (errors.Timeout("x" * 3000), (None, "x" * 1000)),
        (SimpleNamespace(analysis={"verdict": "rank 3 behind"}), ({"verdict": "rank 3 behind"}, None)),
    ],
)
def test_the_local_flight_recorder(monkeypatch, outcome, expected):
    asked = []

    def collect(request):
        asked.append(request)
        if isinstance(outcome, Exception):
            raise outcome
        return outcome

    monkeypatch.setattr("collectors.flight_recorder.collect.collect", collect)
    assert LocalSource(host="h").flight_recorder("j") == expected
    assert asked[0].job == "j" and asked[0].timeout == FLIGHT_RECORDER_TIMEOUT_S


def test_the_local_flight_recorder_asks_only_the_agents_that_answered_the_look(monkeypatch):
    # GIVEN a job of three ranks on this node, the agent of pid 12 silent in the look's poll
    asked = []
    records = [SimpleNamespace(pid=p, job_id="j") for p in (11, 12, 13)] + [SimpleNamespace(pid=14, job_id="k")]
    monkeypatch.setattr("dynprof.watch.sources.list_records", lambda: records)

    def collect(request):
        asked.append(request)
        return SimpleNamespace(analysis={"verdict": "ok"})

    monkeypatch.setattr("collectors.flight_recorder.collect.collect", collect)
    # WHEN the watch reads the flight recorder
    analysis, note = LocalSource(host="h").flight_recorder("j", frozenset({("h", 12), ("other", 11)}))
    # THEN the two others of the job are asked (not the silent one, whose dump would only time
    # out; not another node's pid), and the note says who was not
    assert asked[0].job == "j" and asked[0].skip == (12,) and asked[0].pids == ()
    assert analysis == {"verdict": "ok"} and note is not None and "12" in note and "did not answer" in note
    # AND with no agent of the job answering, nothing is asked
    asked.clear()
    analysis, note = LocalSource(host="h").flight_recorder("j", frozenset({("h", 11), ("h", 12), ("h", 13)}))
    assert asked == [] and analysis is None and "no rank's agent answered" in str(note)


def _take(answer):
    def take(pid, timeout=60.0):
        if isinstance(answer, Exception):
            raise answer
        return answer

    return take


def test_a_gpu_coredump_names_the_running_kernels(monkeypatch):
    running = [f"k{i}" for i in range(20)]
    got = {"artifact": "/store/gc", "dump_s": 1.5, "dump": {"running": running}}
    monkeypatch.setattr("collectors.gpu_coredump.take", _take(got))
    said = LocalSource(host="h").gpu_coredump("h", 5)
    assert said["kernel"] == "running k0; k1; k2 and 17 more"
    assert said["coredump"] == {"artifact": "/store/gc", "dump_s": 1.5, "running": running[:16]}


def test_a_gpu_coredump_with_nothing_running_says_so(monkeypatch):
    monkeypatch.setattr(
        "collectors.gpu_coredump.take", _take({"artifact": "/a", "dump_s": 1.0, "dump": {"running": []}})
    )
    said = LocalSource(host="h").gpu_coredump("h", 5)
    assert said["kernel"] == "no kernel was running on its GPU when it was dumped" and said["coredump"]["running"] == []


def test_a_gpu_coredump_that_cannot_be_taken_or_read_names_no_kernel(monkeypatch):
    from collectors.gpu_coredump import TriggerError

    monkeypatch.setattr("collectors.gpu_coredump.take", _take(TriggerError("not started with --gpu-coredump")))
    assert LocalSource(host="h").gpu_coredump("h", 5) == {"kernel": "not named: not started with --gpu-coredump"}
    monkeypatch.setattr("collectors.gpu_coredump.take", _take({"artifact": "/a", "dump": None, "error": "truncated"}))
    assert LocalSource(host="h").gpu_coredump("h", 5) == {
        "kernel": "not named: the dump (/a) cannot be read: truncated"
    }


def test_the_local_healthcheck_is_quick_and_its_failure_could_not_run(monkeypatch):
    asked = []

    def collect(request):
        asked.append(request)
        if request.job == "bad":
            raise errors.Unsupported("no NVML " + "y" * 2000)
        return "report"

    monkeypatch.setattr("healthcheck.collect.collect", collect)
    monkeypatch.setattr("dynprof.watch.sources.report_summary", lambda report: {"verdict": "healthy", "of": report})
    source = LocalSource(host="h")
    assert source.healthcheck(["h"], job="") == {"h": {"verdict": "healthy", "of": "report"}}
    assert (asked[0].level, asked[0].job, asked[0].timeout) == ("quick", None, HEALTHCHECK_TIMEOUT_S)
    failed = source.healthcheck(["h"], job="bad")["h"]
    assert failed["verdict"] == "could not run" and failed["problems"] == []
    assert failed["error"].startswith("no NVML") and len(failed["error"]) == 1000


def test_the_local_trace_is_the_trace_kinds_own_start(monkeypatch):
    asked = []
    monkeypatch.setattr(
        "collectors.torch_trace.collect.collect",
        lambda request: asked.append(request) or SimpleNamespace(to_json=lambda: {"ok": 1}),
    )
    source = LocalSource(host="node-x")
    assert source.run_trace is local_trace
    assert local_trace("j", 3, 5.0) == {"ok": 1}
    local_trace("j", 2, 9999.0)
    short, long = asked
    assert (short.job, short.steps, short.with_stack, short.timeout, short.max_duration) == ("j", 3, True, 5.0, 10.0)
    assert long.max_duration == MAX_TRACE_DURATION_S and long.timeout == 9999.0


def test_the_local_sources_trace_names_its_ranks_on_this_node_and_hands_its_traces_to_the_store(monkeypatch):
    # GIVEN a trace whose one rank wrote a trace of the sample's request
    monkeypatch.setattr("dynprof.watch.traces.is_sample_trace", lambda path, group: group == "g")
    doc = {
        "group_id": "g",
        "results": [{"pid": 7, "rank": 0, "start_step": 12, "status": "complete", "artifact": "/s/t"}],
    }
    source = LocalSource(host="node-x", run_trace=lambda job, steps, limit_s: doc)
    added = []
    source.sample_traces = SimpleNamespace(add=lambda paths, named: added.append((paths, named)))
    # WHEN it is taken and judged
    got = source.trace("j", 2, 30.0)
    got.done(True)
    # THEN its trace is named on this node, and handed to the store's keeping with the verdict's say
    assert got.at_step == 12 and got.note == "" and got.traces == ["/s/t"]
    assert got.fetched == [{"path": "/s/t", "node": "node-x", "id": "t"}] and got.label_of == {"node-x": "node-x"}
    assert got.evidence == {"traces": ["/s/t"]}
    assert added == [(["/s/t"], True)]


def test_a_gpu_on_another_node_is_not_dumped_by_the_sidecars_source():
    said = SidecarSource(object(), [A]).gpu_coredump("node-a", 21)
    assert "dumps GPUs on its own node only" in said["kernel"]
    assert "dynprof gpu-coredump --pid 21 --yes" in said["kernel"] and "coredump" not in said
