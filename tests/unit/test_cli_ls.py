"""`dynprof ls`: the store's artifacts newest first (filtered by job and kind, limited), those
still being written with --all, damaged entries on stderr, and the nodes' listings merged."""

from __future__ import annotations

import json

from dynprof.cli import job, main
from dynprof.store import ArtifactStore
from tests.support.job_client import FakeJobClient, answered


def _finished(kind: str, job_id: str, rank: int = 0):
    w = ArtifactStore().create(kind, job=job_id, rank=rank)
    w.write_text("x.txt", "data")
    return w.finish("complete")


def test_empty_store_says_so(capsys, dynprof_dirs):
    assert main(["ls"]) == 0
    assert capsys.readouterr().out.strip() == f"no artifacts in {dynprof_dirs['artifacts']}"


def test_artifacts_are_listed_newest_first_and_filtered(capsys):
    first = _finished("trace", "j1")
    second = _finished("stacks", "j2", rank=1)
    assert main(["ls", "--json"]) == 0
    ids = [a["id"] for a in json.loads(capsys.readouterr().out)["artifacts"]]
    assert ids == [second.id, first.id]
    assert main(["ls", "--job", "j1", "--json"]) == 0
    assert [a["id"] for a in json.loads(capsys.readouterr().out)["artifacts"]] == [first.id]
    assert main(["ls", "--kind", "stacks", "--json"]) == 0
    assert [a["kind"] for a in json.loads(capsys.readouterr().out)["artifacts"]] == ["stacks"]
    assert main(["ls", "--limit", "1", "--json"]) == 0
    assert [a["id"] for a in json.loads(capsys.readouterr().out)["artifacts"]] == [second.id]


def test_text_is_a_table_with_a_count(capsys, dynprof_dirs):
    art = _finished("trace", "j1", rank=4)
    assert main(["ls"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["ID", "KIND", "STATUS", "RANK", "CREATED", "SIZE"]
    assert lines[1].split()[:4] == [art.id, "trace", "complete", "4"]
    assert lines[-1] == f"1 artifact(s) in {dynprof_dirs['artifacts']}"


def test_an_artifact_being_written_is_listed_with_all_only(capsys):
    writer = ArtifactStore().create("trace", job="j", rank=0)
    try:
        assert main(["ls", "--json"]) == 0
        doc = json.loads(capsys.readouterr().out)
        assert doc["artifacts"] == [] and doc["writing"] == []
        assert main(["ls", "--all", "--json"]) == 0
        assert len(json.loads(capsys.readouterr().out)["writing"]) == 1
        assert main(["ls", "--all"]) == 0
        assert "writing" in capsys.readouterr().out
    finally:
        writer.finish("complete")


def test_a_damaged_manifest_is_skipped_and_named_on_stderr(capsys):
    art = _finished("trace", "j")
    (art.path / "manifest.json").write_text("{not json")
    assert main(["ls"]) == 0
    captured = capsys.readouterr()
    assert "skipped" in captured.err and art.id not in captured.out
    assert main(["ls", "--json"]) == 0
    captured = capsys.readouterr()
    assert len(json.loads(captured.out)["bad"]) == 1 and captured.err == ""


def test_nodes_listings_merge_newest_first_and_limit_applies_to_all(monkeypatch, capsys):
    fake = FakeJobClient(
        "ls",
        [
            answered("node-a", {"artifacts": [{"id": "old", "created_at": "2026-01-01", "bytes": 1}]}),
            answered("node-b", {"artifacts": [{"id": "new", "created_at": "2026-02-01", "bytes": 2}]}),
        ],
    )
    monkeypatch.setattr(job, "client_for", lambda args: fake)
    assert main(["ls", "--hosts", "node-a,node-b", "--kind", "trace", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert [(r["id"], r["node"]) for r in doc["artifacts"]] == [("new", "node-b"), ("old", "node-a")]
    assert fake.options == {"kind": "trace", "limit": 0}  # the node lists all it has, then the limit applies to all
    assert main(["ls", "--hosts", "node-a,node-b", "--limit", "1"]) == 0
    out = capsys.readouterr().out
    assert "new" in out and "old" not in out and out.rstrip().endswith("1 artifact(s) on 2 node(s)")
