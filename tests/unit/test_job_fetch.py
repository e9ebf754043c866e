"""dynprof/job/fetch.py: what a node says of an artifact is checked before anything is written
(ids, manifests, sizes against the kind's and the store's limits), the copy lands in the
store's layout with its manifest last, a copy already there is not fetched again, and one JSON
file of an artifact is read back within its bound. The sidecars' client is a fake serving a
real store on this machine."""

from __future__ import annotations

import contextlib
import hashlib
from pathlib import Path
from typing import Any

import pytest

from dynprof import errors
from dynprof.job import fetch as f
from dynprof.job.client import NodeFailure
from dynprof.nodes import Node, NodeAnswer
from dynprof.store import ArtifactStore

NODE = Node("node-a", 8787)


class StoreClient:
    """A node's sidecar as the fetch sees it: its store's manifests and files (``root``)."""

    max_in_flight = 4

    def __init__(self, root: Path, manifests: dict[str, Any] | None = None) -> None:
        self.root = root
        self.manifests = manifests or {}
        self.downloads: list[str] = []

    @contextlib.contextmanager
    def manifest(self, node: Node, artifact_id: str):
        if artifact_id in self.manifests:
            yield {"manifest": self.manifests[artifact_id]}
            return
        store = ArtifactStore(self.root)
        yield {"manifest": store.get(artifact_id).manifest}

    def download(self, node, artifact_id, name, dest, size, sha256, timeout) -> None:
        self.downloads.append(f"{artifact_id}/{name}")
        data = (self.root / artifact_id / name).read_bytes()
        if len(data) != size or hashlib.sha256(data).hexdigest() != sha256:
            raise NodeFailure(f"{artifact_id}/{name}: sha256 differs from the manifest's")
        dest.write_bytes(data)

    def action_all(self, nodes, name, options, timeout=None):
        assert name == "ls"
        store = ArtifactStore(self.root)
        arts, _ = store.scan(job=options.get("job"), kind=options.get("kind"))
        rows = [{"id": a.id, "path": str(a.path)} for a in arts]
        return [NodeAnswer(n, True, host=n.host, exit_code=0, result={"artifacts": rows}) for n in nodes]


@pytest.fixture
def node_store(tmp_path):
    root = tmp_path / "node-store"
    w = ArtifactStore(root).create("nccl", job="j", host="node-a")
    w.write_text("rank0-pid1.json", '{"rank": 0}')
    w.write_text("notes.txt", "hello")
    return root, w.finish("complete")


def test_an_artifact_is_copied_file_by_file_with_its_manifest_last(tmp_path, node_store):
    root, art = node_store
    client = StoreClient(root)
    dest = tmp_path / "fetched"
    [row] = f.fetch(client, dest, [(NODE, art.id)])  # type: ignore[arg-type]
    assert row == {"node": "node-a:8787", "id": art.id, "path": str(dest / art.id), "files": 2, "error": None}
    assert (dest / art.id / "notes.txt").read_text() == "hello"
    assert ArtifactStore(dest).get(art.id).verify() == []
    # a second fetch finds the same manifest there and copies nothing
    again = f.fetch(client, dest, [(NODE, art.id)])  # type: ignore[arg-type]
    assert again[0]["already_there"] is True and len(client.downloads) == 2


def test_a_bad_id_is_refused_before_anything_is_asked(tmp_path, node_store):
    root, _ = node_store
    client = StoreClient(root)
    [row] = f.fetch(client, tmp_path / "d", [(NODE, "../../etc/passwd")])  # type: ignore[arg-type]
    assert "bad artifact id" in row["error"] and row["path"] is None and client.downloads == []


def test_a_manifest_over_the_budget_or_the_kinds_size_is_not_fetched(tmp_path, node_store):
    root, art = node_store
    client = StoreClient(root)
    [row] = f.fetch(client, tmp_path / "d", [(NODE, art.id)], limit=4)  # type: ignore[arg-type]
    assert "over the store's limit" in row["error"] and client.downloads == []
    huge = dict(art.manifest, files=[{"name": "big.json", "size": f.MAX_FILE_BYTES + 1, "sha256": "0" * 64}])
    client = StoreClient(root, {art.id: huge})
    [row] = f.fetch(client, tmp_path / "d", [(NODE, art.id)])  # type: ignore[arg-type]
    assert "a file of a nccl artifact holds: not fetched" in row["error"]


@pytest.mark.parametrize(
    ("manifest", "said"),
    [
        ({}, "no list of files"),
        ({"files": ["x"]}, "not an object"),
        ({"files": [{"name": "../x", "size": 1, "sha256": "a"}]}, "bad file name"),
        ({"files": [{"name": "x", "size": -1, "sha256": "a"}]}, "no size or sha256 for x"),
        ({"files": [{"name": "x", "size": True, "sha256": "a"}]}, "no size or sha256 for x"),
    ],
)
def test_manifest_files_are_each_checked(manifest, said):
    with pytest.raises(NodeFailure, match=said):
        f.manifest_files(manifest)


def test_manifest_files_lowercase_the_digest():
    assert f.manifest_files({"files": [{"name": "a.json", "size": 3, "sha256": "ABC"}]}) == [("a.json", 3, "abc")]


def test_the_budget_is_shared_and_never_overdrawn():
    budget = f.Budget(10)
    assert budget.take(6) and not budget.take(5) and budget.take(4) and budget.left == 0


def test_file_limit_is_the_kinds():
    assert f.file_limit("j/h/rank0/trace/x") == f.MAX_FILE_BYTES_OF_KIND["trace"]
    assert f.file_limit("j/h/node/nccl/x") == f.MAX_FILE_BYTES


def test_artifact_ids_from_the_answers_or_the_nodes_listing(node_store):
    root, art = node_store
    b = Node("node-b", 1)
    answers = [
        NodeAnswer(NODE, True, exit_code=0, result={"artifact": str(art.path)}),
        NodeAnswer(b, True, exit_code=0, result={"artifact_id": "not/an/id"}),
        NodeAnswer(Node("node-c", 1), False, error="down"),
    ]
    ids = f.artifact_ids(StoreClient(root), answers, "nccl", "j")  # type: ignore[arg-type]
    assert ids[NODE.address] == art.id
    assert isinstance(ids[b.address], NodeFailure)
    assert "node-c:1" not in ids


def test_fetch_by_path_names_a_path_not_in_the_listing(tmp_path, node_store):
    root, art = node_store
    answers = [NodeAnswer(NODE, True, exit_code=0, result={})]
    rows = f.fetch_by_path(StoreClient(root), tmp_path / "d", answers, {NODE.address: [str(art.path), "/nope"]}, "j")  # type: ignore[arg-type]
    assert [r["error"] for r in rows] == [None, "not in the node's store listing"]


def test_read_json_file_reads_within_its_bound(node_store):
    root, art = node_store
    client = StoreClient(root)
    files = {name: (size, sha) for name, size, sha in f.manifest_files(art.manifest)}
    size, sha = files["rank0-pid1.json"]
    assert f.read_json_file(client, NODE, art.id, "rank0-pid1.json", size, sha, 1024, "dump") == {"rank": 0}  # type: ignore[arg-type]
    with pytest.raises(NodeFailure, match="over the"):
        f.read_json_file(client, NODE, art.id, "rank0-pid1.json", size, sha, size - 1, "dump")  # type: ignore[arg-type]
    size, sha = files["notes.txt"]
    with pytest.raises(errors.ArtifactError):
        f.read_json_file(client, NODE, art.id, "notes.txt", size, sha, 1024, "notes")  # type: ignore[arg-type]


def test_make_private_dirs_will_not_write_through_a_link(tmp_path):
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "dest").mkdir()
    (tmp_path / "dest" / "j").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(NodeFailure, match="is a link"):
        f.make_private_dirs(tmp_path / "dest", tmp_path / "dest" / "j" / "h")


def test_a_listings_artifacts_are_its_objects_and_none_when_it_does_not_read():
    node = Node("node-a", 8787)
    row = {"id": "a1", "path": "/s/a1"}
    assert f.listed(NodeAnswer(node, True, exit_code=0, result={"root": "/s", "artifacts": [row, 3]})) == [row]
    assert f.listed(NodeAnswer(node, True, exit_code=1, result={"error": {"message": "no store"}})) == []
    assert f.listed(NodeAnswer(node, False, error="refused")) == []
