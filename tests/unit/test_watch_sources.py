"""Where the watch reads (dynprof.watch.sources): the nodes' sidecars, and the merge of one sample."""

from __future__ import annotations

from typing import Any

from collectors.stacks import Frame, ProcessStacks, Source, Stacks, ThreadStack
from dynprof.job.client import NodeFailure
from dynprof.nodes import CommandError, Node, NodeAnswer
from dynprof.watch.model import NodeProgress
from dynprof.watch.sources import SidecarSource, merged_with_native

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
