"""dynprof/job/ls.py: this node's artifacts as ``ls`` answers (newest first, filtered, limited;
those being written with ``all``; damaged entries named only where asked), and the nodes'
listings merged newest first with the limit applied to all of them."""

from __future__ import annotations

import json
from typing import Any

import pytest

from dynprof import errors
from dynprof.job import ls
from dynprof.job.merge import Reach
from dynprof.node_requests import LsRequest
from dynprof.nodes import Node, NodeAnswer
from dynprof.store import ArtifactStore


def _finished(kind: str, job_id: str, rank: int = 0):
    w = ArtifactStore().create(kind, job=job_id, rank=rank)
    w.write_text("x.txt", "data")
    return w.finish("complete")


def test_this_nodes_listing_is_newest_first_filtered_and_limited(dynprof_dirs):
    first = _finished("trace", "j1")
    second = _finished("stacks", "j2", rank=1)
    got = ls.collect(LsRequest())
    assert got.exit_code == 0 and got.messages == []
    assert got.root == str(dynprof_dirs["artifacts"])
    assert [a["id"] for a in got.artifacts] == [second.id, first.id]
    assert [a["id"] for a in ls.collect(LsRequest(job="j1")).artifacts] == [first.id]
    assert [a["kind"] for a in ls.collect(LsRequest(kind="stacks")).artifacts] == ["stacks"]
    assert [a["id"] for a in ls.collect(LsRequest(limit=1)).artifacts] == [second.id]


def test_an_artifact_being_written_is_listed_with_all_only(dynprof_dirs):
    writer = ArtifactStore().create("trace", job="j", rank=0)
    try:
        assert ls.collect(LsRequest()).writing == []
        got = ls.collect(LsRequest(all=True))
        assert len(got.writing) == 1 and got.temporaries[0][2] == "writing"
    finally:
        writer.finish("complete")


class FakeClient:
    def __init__(self, answers: list[NodeAnswer]) -> None:
        self.answers = answers
        self.asked: list[tuple[str, dict[str, Any], float | None]] = []

    def action_all(self, nodes, name, options, timeout=None):
        self.asked.append((name, dict(options), timeout))
        return self.answers


def test_the_nodes_listings_merge_newest_first_and_the_limit_applies_to_all():
    a, b = Node("node-a", 8787), Node("node-b", 8787)
    fake = FakeClient(
        [
            NodeAnswer(a, True, host="node-a", exit_code=0, result={"artifacts": [{"id": "old", "created_at": "1"}]}),
            NodeAnswer(b, True, host="node-b", exit_code=0, result={"artifacts": [{"id": "new", "created_at": "2"}]}),
        ]
    )
    got = ls.collect_job({"kind": "trace", "limit": 1}, [a, b], Reach(fake))  # type: ignore[arg-type]
    assert fake.asked == [("ls", {"kind": "trace", "limit": 1}, ls.LS_TIMEOUT_S)]
    assert [(r["id"], r["node"]) for r in got.doc["artifacts"]] == [("new", "node-b")]
    assert got.exit_code == 0 and "fetched" not in got.doc
    assert got.doc["per_node"] == {"node-a:8787": {}, "node-b:8787": {}}


ART = {"id": "a1", "path": "/s/a1", "kind": "trace", "status": "complete", "job": "j", "host": "h", "rank": 0}


def test_a_listing_reads_back_what_it_wrote():
    listing = ls.Listing(
        root="/s", artifacts=[ART], writing=["/s/.w"], stale=["/s/.x"], bad=[{"path": "/s/b", "reason": "no manifest"}]
    )
    doc = json.loads(json.dumps(listing.to_json()))
    assert list(doc) == ["root", "artifacts", "writing", "stale", "bad"]
    assert ls.Listing.from_json(doc).to_json() == doc


@pytest.mark.parametrize("doc", [None, "x", {"root": "/s"}, {"root": "/s", "artifacts": {"id": "a1"}}])
def test_a_listing_without_its_list_of_artifacts_is_refused(doc):
    with pytest.raises(errors.ArtifactError, match="ls answer"):
        ls.Listing.from_json(doc)


def test_a_listings_other_fields_of_another_type_are_left_empty():
    doc = {"root": 7, "artifacts": [ART, 3], "writing": ["/w", 5], "stale": "x", "bad": [{"path": "/b"}, "x"]}
    got = ls.Listing.from_json(doc)
    assert (got.root, got.artifacts, got.writing, got.stale, got.bad) == ("", [ART], ["/w"], [], [{"path": "/b"}])
