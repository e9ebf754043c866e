"""dynprof.job.nccl: a job's flight recorders read back from every node's nccl artifact and
analysed together. The nodes are simulated in-process (their answers, manifests and files):
what is merged (first node of a rank wins), what is a note (a node's own notes, unreadable
artifacts, manifests and dumps, a dump past the per-rank limit or the total), when the job runs
without a recorder, and what the nodes are asked. The same reading over a real HTTP client is in
test_job_client.py."""

from __future__ import annotations

import contextlib
import hashlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from collectors import flight_recorder as fr
from collectors.flight_recorder.collect import MAX_DUMP_BYTES, NcclRequest
from dynprof import errors
from dynprof.job import nccl as job_nccl
from dynprof.job.client import NodeFailure
from dynprof.job.fetch import Budget
from dynprof.job.nccl import ACTION_MARGIN_S, NodesCollected, collect_nodes, read_rank_dumps
from dynprof.nodes import CommandError, Node, NodeAnswer

DATA = Path(__file__).parent / "data"
A, B = Node("node-a", 8787), Node("node-b", 8787)
ID_A, ID_B = "j/node-a/node/nccl/20260101T000000.000000Z-1", "j/node-b/node/nccl/20260101T000000.000000Z-2"


def dump(rank: int) -> dict[str, Any]:
    """A real gloo rank's flight recorder dump (rank 0 waits in a collective rank 1 never joined)."""
    return json.loads((DATA / f"fr_gloo_rank{rank}.json").read_text())


def as_bytes(doc: Any) -> bytes:
    return json.dumps(doc).encode()


class FakeNodes:
    """Sidecars as the client sees them: each node's answer to ``nccl`` (and ``ls``), each
    artifact's manifest, and its files' bytes. Records what is asked."""

    max_in_flight = 4

    def __init__(self) -> None:
        self.answers: dict[Node, NodeAnswer] = {}
        self.listings: dict[Node, NodeAnswer] = {}
        self.manifests: dict[str, Any] = {}  # artifact id -> manifest, or a NodeFailure to raise
        self.files: dict[tuple[str, str], bytes | NodeFailure] = {}
        self.calls: list[tuple[str, list[Node], dict[str, Any], float | None]] = []
        self.downloaded: list[tuple[str, str]] = []
        self.per_node: list[dict[Node, dict[str, Any]]] = []

    def node(self, node: Node, result: Any, code: int = 0, failure: CommandError | None = None) -> None:
        self.answers[node] = NodeAnswer(node, True, host=node.host, exit_code=code, result=result, failure=failure)

    def artifact(self, artifact_id: str, files: dict[str, bytes]) -> None:
        """An artifact whose manifest lists ``files`` truthfully."""
        self.manifests[artifact_id] = {
            "kind": "nccl",
            "files": [{"name": n, "size": len(d), "sha256": hashlib.sha256(d).hexdigest()} for n, d in files.items()],
        }
        for name, data in files.items():
            self.files[(artifact_id, name)] = data

    def action_all(self, nodes: list[Node], name: str, options: Any, timeout: float | None = None):
        if callable(options):  # each node's own options
            self.per_node.append({n: options(n) for n in nodes})
            options = options(nodes[0]) if nodes else {}
        self.calls.append((name, list(nodes), dict(options), timeout))
        table = self.answers if name == "nccl" else self.listings
        return [table[n] for n in nodes]

    @contextlib.contextmanager
    def manifest(self, node: Node, artifact_id: str) -> Iterator[dict[str, Any]]:
        found = self.manifests[artifact_id]
        if isinstance(found, NodeFailure):
            raise found
        yield {"id": artifact_id, "manifest": found}

    def download(self, node: Node, artifact_id: str, name: str, dest: Path, size: int, sha256: str, timeout: float):
        self.downloaded.append((artifact_id, name))
        data = self.files[(artifact_id, name)]
        if isinstance(data, NodeFailure):
            raise data
        dest.write_bytes(data)


def two_nodes() -> FakeNodes:
    nodes = FakeNodes()
    nodes.node(A, {"artifact_id": ID_A, "notes": ["pid 7: no dump"]})
    nodes.node(B, {"artifact_id": ID_B})
    nodes.artifact(ID_A, {"rank0-pid11.json": as_bytes(dump(0)), "summary.txt": b"not a dump"})
    nodes.artifact(ID_B, {"rank1-pid21.json": as_bytes(dump(1))})
    return nodes


# -- collect_nodes: the job's dumps, merged ----------------------------------------------------
def test_every_node_is_asked_for_the_request_and_the_dumps_are_analysed_together():
    # GIVEN two nodes, each with one rank's dump in its nccl artifact (and a file that is no dump)
    nodes = two_nodes()
    request = NcclRequest(job="j", only_active=True, timeout=7.0)
    # WHEN the job's recorders are collected
    got = collect_nodes(nodes, [A, B], request)  # type: ignore[arg-type]
    # THEN both nodes were asked for the request's own options, with the margin past its timeout
    assert nodes.calls == [("nccl", [A, B], request.options(), 7.0 + ACTION_MARGIN_S)]
    # AND the two ranks' dumps are analysed as one job, each rank named with its node
    assert isinstance(got, NodesCollected)
    assert got.analysis == fr.analyze({0: dump(0), 1: dump(1)})
    assert got.where == {0: "node-a", 1: "node-b"}
    assert got.labels == {A: "node-a", B: "node-b"} and [a.node for a in got.answers] == [A, B]
    # AND a node's own notes carry its name; the file that is no dump was never asked for
    assert got.notes == ["node-a: pid 7: no dump"]
    assert sorted(nodes.downloaded) == [(ID_A, "rank0-pid11.json"), (ID_B, "rank1-pid21.json")]
    assert got.recorder_off is False


def test_each_node_is_told_which_of_its_processes_to_leave_out():
    # GIVEN two nodes, and the watch's rank on node-b whose agent did not answer its look
    nodes = two_nodes()
    request = NcclRequest(job="j", timeout=3.0)
    # WHEN the job's recorders are collected, that process left out
    got = collect_nodes(nodes, [A, B], request, skip={B: (22, 21, 22)})  # type: ignore[arg-type]
    # THEN node-a is asked for the job as it is, node-b for the job less that process
    (asked,) = nodes.per_node
    assert asked[A] == request.options()
    assert asked[B] == {**request.options(), "skip_pid": [21, 22]}
    assert NcclRequest.from_json(asked[B]) == NcclRequest(job="j", timeout=3.0, skip=(21, 22))
    assert got.analysis == fr.analyze({0: dump(0), 1: dump(1)})


def test_a_rank_dumped_on_two_nodes_keeps_the_first_node_s_dump_and_says_so():
    # GIVEN rank 0's dump on node A, and another "rank 0" on node B (a relaunch, or a forged one)
    nodes = two_nodes()
    forged = dump(1)
    nodes.artifact(ID_B, {"rank0-pid21.json": as_bytes(forged)})
    # WHEN collected
    got = collect_nodes(nodes, [A, B], NcclRequest(job="j"))  # type: ignore[arg-type]
    # THEN node A's (the first node's) is the one analysed, and a note names both nodes
    assert got.where == {0: "node-a"}
    assert got.analysis == fr.analyze({0: dump(0)})
    assert "rank 0 dumped on node-a and on node-b: the one of node-a kept" in got.notes


def test_nodes_of_one_host_are_named_with_their_port():
    a1, a2 = Node("node-a", 8787), Node("node-a", 8788)
    nodes = FakeNodes()
    nodes.node(a1, {"artifact_id": ID_A})
    nodes.node(a2, {"artifact_id": ID_B, "notes": ["hello"]})
    nodes.artifact(ID_A, {"rank0-pid11.json": as_bytes(dump(0))})
    nodes.artifact(ID_B, {"rank1-pid21.json": as_bytes(dump(1))})
    got = collect_nodes(nodes, [a1, a2], NcclRequest(job="j"))  # type: ignore[arg-type]
    assert got.where == {0: "node-a:8787", 1: "node-a:8788"}
    assert got.notes == ["node-a:8788: hello"]


@pytest.mark.parametrize(
    "result",
    [None, "text", 7, [], {"notes": "not a list"}, {"notes": None}, {"notes": {"a": 1}}],
    ids=["none", "text", "int", "list", "notes-text", "notes-none", "notes-object"],
)
def test_an_answer_of_the_wrong_shape_adds_no_note_and_no_dump(result):
    # GIVEN node B answering with something that is not a result (or notes that are not a list)
    nodes = two_nodes()
    nodes.node(B, result)
    # WHEN collected THEN node A's dump is still analysed, node B adds nothing
    got = collect_nodes(nodes, [A, B], NcclRequest(job="j"))  # type: ignore[arg-type]
    assert got.where == {0: "node-a"}
    assert got.notes == ["node-a: pid 7: no dump"]
    assert all(aid == ID_A for aid, _ in nodes.downloaded)


def test_a_node_s_notes_are_cut_to_2000_characters_each():
    nodes = two_nodes()
    nodes.node(B, {"artifact_id": ID_B, "notes": ["x" * 5000, 42]})
    got = collect_nodes(nodes, [A, B], NcclRequest(job="j"))  # type: ignore[arg-type]
    long, number = got.notes[1:3]
    assert long == "node-b: " + "x" * 2000
    assert number == "node-b: 42"


@pytest.mark.parametrize("bad_id", ["../../etc/passwd", "j/h/node/nccl", 5, "j/h/node/nccl/a/b"])
def test_an_artifact_id_that_could_leave_the_store_is_a_note_and_never_read(bad_id):
    # GIVEN node B naming an artifact id that is not job/host/rank/kind/name
    nodes = two_nodes()
    nodes.node(B, {"artifact_id": bad_id})
    # WHEN collected
    got = collect_nodes(nodes, [A, B], NcclRequest(job="j"))  # type: ignore[arg-type]
    # THEN node B's dumps are named unreadable, nothing of it is asked for, node A's are analysed
    (note,) = [n for n in got.notes if n.startswith("node-b:")]
    assert note.startswith("node-b: its dumps cannot be read: ")
    assert all(aid == ID_A for aid, _ in nodes.downloaded)
    assert got.where == {0: "node-a"}


def test_an_artifact_named_by_its_path_is_found_in_the_node_s_listing():
    # GIVEN node B naming its artifact by path only (as an older sidecar answers)
    nodes = two_nodes()
    nodes.node(B, {"artifact": "/store/j/node-b/node/nccl/x"})
    listing = {"artifacts": [{"path": "/store/j/node-b/node/nccl/x", "id": ID_B}, {"path": "/other", "id": "x"}]}
    nodes.listings[B] = NodeAnswer(B, True, host="node-b", exit_code=0, result=listing)
    # WHEN collected
    got = collect_nodes(nodes, [A, B], NcclRequest(job="j"))  # type: ignore[arg-type]
    # THEN only node B's store is listed (for the job's nccl artifacts), and its dump is read
    (ls,) = [c for c in nodes.calls if c[0] == "ls"]
    assert ls[1] == [B] and ls[2] == {"job": "j", "kind": "nccl"}
    assert got.where == {0: "node-a", 1: "node-b"}


def test_a_path_not_in_the_node_s_listing_is_a_note():
    nodes = two_nodes()
    nodes.node(B, {"artifact": "/store/j/node-b/node/nccl/x"})
    nodes.listings[B] = NodeAnswer(B, True, host="node-b", exit_code=0, result={"artifacts": []})
    got = collect_nodes(nodes, [A, B], NcclRequest(job="j"))  # type: ignore[arg-type]
    assert "node-b: its dumps cannot be read: /store/j/node-b/node/nccl/x is not in the node's store listing" in (
        got.notes
    )
    assert got.where == {0: "node-a"}


def test_dumps_that_cannot_be_analysed_together_are_a_note_not_a_crash():
    # GIVEN a node whose dump is JSON of the wrong shape (its recorders' families not objects)
    nodes = two_nodes()
    nodes.artifact(ID_B, {"rank1-pid21.json": as_bytes({"dumps": {"nccl": "not an object"}})})
    # WHEN collected
    got = collect_nodes(nodes, [A, B], NcclRequest(job="j"))  # type: ignore[arg-type]
    # THEN there is no analysis, a note says why, and where each rank was dumped is still known
    assert got.analysis is None
    assert any(n.startswith("the dumps could not be analysed together: AttributeError: ") for n in got.notes)
    assert got.where == {0: "node-a", 1: "node-b"}


def test_no_dump_anywhere_is_no_analysis():
    nodes = FakeNodes()
    nodes.node(A, {"notes": ["no rank of job 'j' records"]})
    got = collect_nodes(nodes, [A], NcclRequest(job="j"))  # type: ignore[arg-type]
    assert got.analysis is None and got.where == {} and got.recorder_off is False
    assert got.notes == ["node-a: no rank of job 'j' records"]


def test_the_dumps_of_all_nodes_share_one_total(monkeypatch):
    # GIVEN room in all for one rank's dump only
    nodes = two_nodes()
    size = len(as_bytes(dump(0)))
    assert len(as_bytes(dump(1))) <= size
    monkeypatch.setattr(job_nccl, "MAX_DUMPS_TOTAL_BYTES", size)
    # WHEN collected
    got = collect_nodes(nodes, [A, B], NcclRequest(job="j"))  # type: ignore[arg-type]
    # THEN one rank is read and the other named as past the total, never asked for
    assert len(got.where) == 1 and len(nodes.downloaded) == 1
    (past,) = [n for n in got.notes if "of dumps read back in all" in n]
    assert "not read, past the" in past


# -- recorder_off: the job runs without a flight recorder ---------------------------------------
def unsupported(message: str = "the flight recorder is off") -> CommandError:
    return CommandError(errors.Unsupported.__name__, message, "", 4)


def test_every_node_refusing_for_want_of_a_recorder_is_recorder_off():
    nodes = FakeNodes()
    nodes.node(A, {"error": {"message": "off"}}, code=4, failure=unsupported())
    nodes.node(B, {"error": {"message": "off"}}, code=4, failure=unsupported())
    got = collect_nodes(nodes, [A, B], NcclRequest(job="j"))  # type: ignore[arg-type]
    assert got.recorder_off is True and got.analysis is None


@pytest.mark.parametrize("other", ["another-error", "silent", "ok"])
def test_recorder_off_needs_every_node_to_say_so(other):
    # GIVEN node A says its ranks do not record, and node B fails otherwise, is silent, or answers
    nodes = FakeNodes()
    nodes.node(A, {}, code=4, failure=unsupported())
    if other == "another-error":
        nodes.node(B, {}, code=5, failure=CommandError("NoAgent", "no agent", "", 5))
    elif other == "silent":
        nodes.answers[B] = NodeAnswer(B, False, error="connection refused")
    else:
        nodes.node(B, {})
    # WHEN collected THEN it is not said that the job runs without a recorder
    got = collect_nodes(nodes, [A, B], NcclRequest(job="j"))  # type: ignore[arg-type]
    assert got.recorder_off is False


def test_a_dump_read_back_is_never_recorder_off():
    nodes = two_nodes()
    nodes.node(B, {}, code=4, failure=unsupported())
    nodes.node(A, {"artifact_id": ID_A}, code=4, failure=unsupported())
    got = collect_nodes(nodes, [A, B], NcclRequest(job="j"))  # type: ignore[arg-type]
    assert got.where == {0: "node-a"} and got.recorder_off is False


# -- read_rank_dumps: one node's artifact ----------------------------------------------------
def read(nodes: FakeNodes, budget: Any = None) -> tuple[list[tuple[int, dict[str, Any]]], list[str]]:
    notes: list[str] = []
    return read_rank_dumps(nodes, A, ID_A, notes, "node-a", budget), notes  # type: ignore[arg-type]


def test_only_files_named_as_a_rank_s_dump_are_read():
    # GIVEN an artifact with dumps and files that only look like them
    nodes = FakeNodes()
    good = as_bytes({"dumps": {}})
    nodes.artifact(
        ID_A,
        {
            "rank3-pid30.json": good,
            "rank4-pid40.json.bak": good,
            "xrank5-pid50.json": good,
            "rank1234567890-pid1.json": good,  # a rank of ten digits
            "rank6-pid.json": good,
            "analysis.txt": b"text",
        },
    )
    # WHEN its dumps are read THEN only the real dump's name is asked for, its rank from the name
    dumps, notes = read(nodes)
    assert dumps == [(3, {"dumps": {}})] and notes == []
    assert nodes.downloaded == [(ID_A, "rank3-pid30.json")]


def test_a_manifest_that_cannot_be_had_is_a_note_and_no_dump():
    nodes = FakeNodes()
    nodes.manifests[ID_A] = NodeFailure("HTTP 404: no such artifact", status=404)
    dumps, notes = read(nodes)
    assert dumps == [] and notes == ["node-a: its dumps cannot be read: HTTP 404: no such artifact"]


@pytest.mark.parametrize(
    "manifest",
    [
        {"files": "not a list"},
        {"files": [{"name": "../rank0-pid1.json", "size": 1, "sha256": "0" * 64}]},
        {"files": [{"name": "rank0-pid1.json", "size": -1, "sha256": "0" * 64}]},
        {"files": [{"name": "rank0-pid1.json", "size": True, "sha256": "0" * 64}]},
        {"files": ["rank0-pid1.json"]},
        "not an object",
    ],
    ids=["files-text", "escape", "negative", "bool-size", "name-only", "text"],
)
def test_a_manifest_that_does_not_check_out_is_a_note_and_nothing_is_asked_for(manifest):
    nodes = FakeNodes()
    nodes.manifests[ID_A] = manifest
    dumps, notes = read(nodes)
    assert dumps == [] and nodes.downloaded == []
    (note,) = notes
    assert note.startswith("node-a: its dumps cannot be read: ")


def test_a_dump_that_is_not_json_or_not_utf8_is_named_and_the_others_read():
    # GIVEN three dumps: not UTF-8, not JSON, and a good one
    nodes = FakeNodes()
    nodes.artifact(
        ID_A,
        {"rank0-pid1.json": b"\xff\xfe{}", "rank1-pid2.json": b"{not json", "rank2-pid3.json": as_bytes({"dumps": {}})},
    )
    # WHEN read THEN each bad one is a note naming its file and node, the good one is kept
    dumps, notes = read(nodes)
    assert dumps == [(2, {"dumps": {}})]
    assert len(notes) == 2
    assert notes[0].startswith("node-a: rank0-pid1.json of node-a: not valid JSON (not UTF-8 at byte 0)")
    assert notes[1].startswith("node-a: rank1-pid2.json of node-a") and "JSON" in notes[1]


def test_a_dump_the_node_fails_to_send_is_a_note():
    nodes = FakeNodes()
    nodes.artifact(ID_A, {"rank0-pid1.json": b"{}", "rank1-pid2.json": b"{}"})
    nodes.files[(ID_A, "rank0-pid1.json")] = NodeFailure("sha256 differs from the manifest's")
    dumps, notes = read(nodes)
    assert dumps == [(1, {})]
    assert notes == ["node-a: sha256 differs from the manifest's"]


@pytest.mark.parametrize("doc", [[1, 2], "text", 5, None], ids=["list", "text", "int", "null"])
def test_a_dump_that_is_json_but_no_object_is_left_out(doc):
    nodes = FakeNodes()
    nodes.artifact(ID_A, {"rank0-pid1.json": as_bytes(doc), "rank1-pid2.json": b"{}"})
    dumps, notes = read(nodes)
    assert dumps == [(1, {})] and notes == []


def test_a_dump_over_the_limit_is_not_counted_against_the_total():
    # GIVEN a manifest that claims a dump over the per-rank limit, then a good one, and room in
    # all for the good one only
    nodes = FakeNodes()
    good = as_bytes({"dumps": {}})
    nodes.artifact(ID_A, {"rank1-pid2.json": good})
    nodes.manifests[ID_A]["files"].insert(
        0, {"name": "rank0-pid1.json", "size": MAX_DUMP_BYTES + 1, "sha256": "0" * 64}
    )
    budget = Budget(len(good))
    # WHEN read
    dumps, notes = read(nodes, budget)
    # THEN the oversized one is named over the limit (never asked for) and took nothing of the
    # total: the good one is read
    assert dumps == [(1, {"dumps": {}})]
    assert len(notes) == 1 and "rank0-pid1.json" in notes[0] and "over the" in notes[0]
    assert nodes.downloaded == [(ID_A, "rank1-pid2.json")]
    assert budget.left == 0


def test_without_a_budget_every_dump_under_the_limit_is_read():
    nodes = FakeNodes()
    nodes.artifact(ID_A, {f"rank{r}-pid{r + 1}.json": b"{}" for r in range(5)})
    dumps, notes = read(nodes)
    assert [rank for rank, _ in dumps] == [0, 1, 2, 3, 4] and notes == []


def test_past_the_total_names_the_rank_the_file_and_the_total():
    nodes = FakeNodes()
    nodes.artifact(ID_A, {"rank0-pid1.json": b"{}", "rank1-pid2.json": b"{}"})
    dumps, notes = read(nodes, Budget(2))
    assert [rank for rank, _ in dumps] == [0]
    assert notes == [f"node-a: rank 1: {ID_A}/rank1-pid2.json: not read, past the 2 B of dumps read back in all"]
