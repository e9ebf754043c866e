"""Copying artifacts back from the nodes' sidecars (``--fetch DIR``), and reading one file of an
artifact (the ranks' NCCL dumps).

What a node says about an artifact is untrusted: its id must be ``job/host/rank/kind/name``
exactly, its manifest is checked file by file (a plain name, a size, a sha256; no file larger
than its kind's files are, :func:`file_limit`), an artifact whose manifest claims more than the store's limit
(``DYNPROF_ARTIFACT_MAX_BYTES``, 20 GiB by default) is refused before any file is asked for,
and so is one that would take a fetch past that limit in all; each file is read up to its
claimed size and no further, and kept only when its size and sha256 match. The copy lands in
``DIR/<id>/`` (the store's layout), the manifest last, written as the store writes its own
(:func:`dynprof.store.write_file_atomically`): its presence says the copy is whole.
"""

from __future__ import annotations

import tempfile
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from dynprof import jsontext, store, untrusted
from dynprof.errors import ArtifactError
from dynprof.job.answers import answer_rows, read
from dynprof.job.client import NodeFailure, SidecarClient, check_artifact_id, check_file_name
from dynprof.nodes import Node, NodeAnswer
from dynprof.units import human_bytes

FETCH_TIMEOUT_S = 600.0
LISTING_TIMEOUT_S = 30.0
# The largest file an artifact of a kind holds, as dynprof reads it back: a trace up to the
# analysis's limit (DYNPROF_MAX_TRACE_BYTES' default), a memory snapshot up to the snapshot
# reader's (DYNPROF_MAX_SNAPSHOT_BYTES' default); the other kinds' files (stacks, hang, nccl,
# analysis, host-memory, healthcheck, verdicts) are read up to 64 MiB, so 256 MiB is far above
# any of theirs. A manifest that claims a larger file is refused before any file is asked for.
MAX_FILE_BYTES_OF_KIND = {"trace": untrusted.DEFAULT_MAX_TRACE_BYTES, "memory": 4 << 30}
MAX_FILE_BYTES = 256 << 20


class Budget:
    """Bytes a fetch may still write, shared by the threads that fetch from the nodes."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.left = limit
        self._lock = threading.Lock()

    def take(self, size: int) -> bool:
        with self._lock:
            if size > self.left:
                return False
            self.left -= size
            return True


def file_limit(artifact_id: str) -> int:
    """The largest file fetched for an artifact of this id's kind (``job/host/rank/KIND/name``)."""
    return MAX_FILE_BYTES_OF_KIND.get(artifact_id.split("/")[3], MAX_FILE_BYTES)


def store_limit() -> int:
    """The store's size cap (``DYNPROF_ARTIFACT_MAX_BYTES``): nothing fetched is larger."""
    return store.ArtifactStore().max_bytes


def manifest_files(manifest: Any) -> list[tuple[str, int, str]]:
    """(name, size, sha256) of each file a manifest lists, each checked; NodeFailure otherwise."""
    files = manifest.get("files") if isinstance(manifest, dict) else None
    if not isinstance(files, list) or len(files) > store.MAX_MANIFEST_FILES:
        raise NodeFailure("its manifest has no list of files")
    checked = []
    for f in files:
        if not isinstance(f, dict):
            raise NodeFailure("its manifest lists a file that is not an object")
        name = check_file_name(f.get("name"))
        size, sha = f.get("size"), f.get("sha256")
        if not isinstance(size, int) or isinstance(size, bool) or size < 0 or not isinstance(sha, str):
            raise NodeFailure(f"its manifest gives no size or sha256 for {name}")
        checked.append((name, size, sha.lower()))
    return checked


def fetch(
    client: SidecarClient, dest: Path, wanted: Sequence[tuple[Node, Any]], limit: int | None = None
) -> list[dict[str, Any]]:
    """Copy artifacts to ``dest/<id>/`` (the store's layout), each file checked against the
    manifest; an artifact already there with the same manifest is not copied again. Nodes are
    fetched from in parallel (at most the client's ``max_in_flight``), each node's artifacts one
    after the other; the rows come back in the order asked. ``limit``: the bytes this fetch may
    write in all (default: the store's limit)."""
    budget = Budget(store_limit() if limit is None else limit)
    by_node: dict[Node, list[int]] = {}
    for i, (node, _) in enumerate(wanted):
        by_node.setdefault(node, []).append(i)
    out: list[dict[str, Any]] = [{} for _ in wanted]

    def one_node(node: Node) -> None:
        for i in by_node[node]:
            out[i] = fetch_one(client, dest, node, wanted[i][1], budget)

    if by_node:
        with ThreadPoolExecutor(max_workers=min(client.max_in_flight, len(by_node))) as pool:
            list(pool.map(one_node, by_node))
    return out


def fetch_one(client: SidecarClient, dest: Path, node: Node, artifact_id: Any, budget: Budget) -> dict[str, Any]:
    row: dict[str, Any] = {"node": node.address, "id": artifact_id, "path": None, "files": 0, "error": None}
    try:
        check_artifact_id(artifact_id)
        target = dest / artifact_id
        row["path"] = str(target)
        # The manifest is held (and counted in the command's total of manifests held at once)
        # while this artifact's files are copied.
        with client.manifest(node, artifact_id) as doc:
            _copy(client, node, artifact_id, doc["manifest"], target, dest, budget, row)
    except NodeFailure as exc:
        row["error"] = exc.reason
        if exc.cut:
            row["cut"] = True
    except ArtifactError as exc:
        row["error"] = f"cannot write under {dest}: {exc.message}"
    except OSError as exc:
        row["error"] = f"cannot write under {dest}: {exc.strerror or exc}"
    return row


def _copy(
    client: SidecarClient,
    node: Node,
    artifact_id: str,
    manifest: dict[str, Any],
    target: Path,
    dest: Path,
    budget: Budget,
    row: dict[str, Any],
) -> None:
    checked = manifest_files(manifest)
    existing = target / store.MANIFEST
    if existing.is_file() and same_manifest(existing, manifest):
        row["files"] = len(checked)
        row["already_there"] = True
        return
    cap = file_limit(artifact_id)
    over = next(((name, size) for name, size, _ in checked if size > cap), None)
    if over is not None:
        raise NodeFailure(
            f"its manifest claims {over[0]} is {human_bytes(over[1])}, over the {human_bytes(cap)} a file of "
            f"a {artifact_id.split('/')[3]} artifact holds: not fetched"
        )
    claimed = sum(size for _, size, _ in checked)
    if claimed > budget.limit:
        raise NodeFailure(
            f"its manifest claims {human_bytes(claimed)}, over the store's limit of "
            f"{human_bytes(budget.limit)} (DYNPROF_ARTIFACT_MAX_BYTES): not fetched"
        )
    if not budget.take(claimed):
        raise NodeFailure(
            f"its {human_bytes(claimed)} would take this fetch past the store's limit of "
            f"{human_bytes(budget.limit)} in all (DYNPROF_ARTIFACT_MAX_BYTES): not fetched"
        )
    make_private_dirs(dest, target)
    for name, size, sha in checked:
        client.download(node, artifact_id, name, target / name, size, sha, FETCH_TIMEOUT_S)
        row["files"] += 1
    store.write_file_atomically(target, store.MANIFEST, (jsontext.dumps(manifest, indent=2) + "\n").encode())


def same_manifest(path: Path, manifest: dict[str, Any]) -> bool:
    try:
        return bool(untrusted.loads_json(path.read_bytes()[: untrusted.MANIFEST_MAX_BYTES + 1], str(path)) == manifest)
    except (OSError, ArtifactError):
        return False


def make_private_dirs(root: Path, target: Path) -> None:
    root.mkdir(parents=True, exist_ok=True)
    current = root
    for part in target.relative_to(root).parts:
        current = current / part
        if current.is_symlink():
            raise NodeFailure(f"{current} is a link: not writing through it")
        current.mkdir(mode=0o700, exist_ok=True)


def listed(listing: NodeAnswer) -> list[dict[str, Any]]:
    """The artifacts' rows of a node's ``ls`` answer, read as :meth:`dynprof.job.ls.Listing.from_json`
    reads them (its objects; none when the answer does not read)."""
    return read(listing, lambda doc: answer_rows(doc, "artifacts", "ls")) or []


def fetch_by_path(
    client: SidecarClient,
    dest: Path,
    answers: Sequence[NodeAnswer],
    paths: dict[str, list[str]],
    job: str | None,
) -> list[dict[str, Any]]:
    """Fetch artifacts named by their path on their node (``paths``: node address -> paths):
    each node's own store listing gives their ids."""
    nodes = {a.node.address: a.node for a in answers}
    wanted: list[tuple[Node, Any]] = []
    listings = client.action_all([nodes[n] for n in paths], "ls", {"job": job} if job else {}, LISTING_TIMEOUT_S)
    refused: list[dict[str, Any]] = []
    for listing in listings:
        ids = {r.get("path"): r.get("id") for r in listed(listing)}
        for path in paths[listing.node.address]:
            if path in ids:
                wanted.append((listing.node, ids[path]))
            else:
                why = listing.error or "not in the node's store listing"
                refused.append({"node": listing.node.address, "id": None, "path": None, "files": 0, "error": why})
    return fetch(client, dest, wanted) + refused


def artifact_ids(
    client: SidecarClient, answers: Sequence[NodeAnswer], kind: str, job: str | None
) -> dict[str, str | NodeFailure]:
    """Per node address, the id of the artifact its answer names (``artifact_id``; else its
    ``artifact`` path looked up in the node's store listing), or why there is none."""
    out: dict[str, str | NodeFailure] = {}
    by_path: dict[str, str] = {}
    for a in answers:
        if not a.answered or not isinstance(a.result, dict):
            continue
        given, path = a.result.get("artifact_id"), a.result.get("artifact")
        if given is not None:
            try:
                out[a.node.address] = check_artifact_id(given)
            except NodeFailure as exc:
                out[a.node.address] = exc
        elif isinstance(path, str) and path:
            by_path[a.node.address] = path
    if by_path:
        nodes = [a.node for a in answers if a.node.address in by_path]
        options = {"job": job, "kind": kind} if job else {"kind": kind}
        for listing in client.action_all(nodes, "ls", options, LISTING_TIMEOUT_S):
            found = {r.get("path"): r.get("id") for r in listed(listing)}
            path = by_path[listing.node.address]
            if path in found:
                try:
                    out[listing.node.address] = check_artifact_id(found[path])
                except NodeFailure as exc:
                    out[listing.node.address] = exc
            else:
                out[listing.node.address] = NodeFailure(listing.error or f"{path} is not in the node's store listing")
    return out


def read_json_file(
    client: SidecarClient,
    node: Node,
    artifact_id: str,
    name: str,
    size: int,
    sha256: str,
    max_bytes: int,
    what: str,
) -> Any:
    """One JSON file of an artifact, refused before it is asked for when its manifest claims
    more than ``max_bytes``; it streams to a private temporary file (read up to its claimed
    size, checked against its sha256), and its text is parsed with the untrusted-JSON limits.
    NodeFailure or ArtifactError otherwise."""
    check_artifact_id(artifact_id)
    check_file_name(name)
    if size > max_bytes:
        raise NodeFailure(f"{artifact_id}/{name}: {human_bytes(size)}, over the {human_bytes(max_bytes)} read back")
    with tempfile.TemporaryDirectory(prefix="dynprof-read-") as tmp:
        client.download(node, artifact_id, name, Path(tmp) / "file", size, sha256, FETCH_TIMEOUT_S)
        text = _utf8_text(untrusted.read_bytes_in(tmp, "file", max_bytes), what)
    # Only the text is held while it is parsed (the bytes are gone): the parse is the peak.
    return untrusted.loads_json(text, what)


def _utf8_text(data: bytes, what: str) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ArtifactError(f"{what}: not valid JSON (not UTF-8 at byte {exc.start})") from None
