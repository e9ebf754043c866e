"""A job-wide command keeps a bounded total of all its nodes' answers, whatever each node
answers within its own bound: fake sidecars on loopback (one server, many 127.0.0.x
addresses) each answer at the per-node bound; the nodes past the total are cut and named."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from dynprof.cli import main
from dynprof.job import budget as answer_budget
from dynprof.job import client as fanout
from dynprof.job.client import SidecarClient
from dynprof.nodes import Node
from dynprof.untrusted import count_json_values

TOKEN = "unit-test-token-0123456789"
NODES = 64


def _envelope(result: Any) -> bytes:
    doc = {"api": 1, "action": "ps", "host": "n", "dynprof_version": "0.1.0", "exit_code": 0, "messages": []}
    return json.dumps({**doc, "result": result}).encode()


def wide_answer(size: int) -> bytes:
    """A ps answer of about ``size`` bytes: agents with long command lines (few JSON values)."""
    row = {"pid": 1, "rank": 0, "job": "j", "role": "trainer", "state": "up", "age_s": 1.0, "cmdline": ["x" * 4000]}
    one = len(json.dumps(row)) + 2
    return _envelope({"agents": [dict(row, pid=i + 1) for i in range(max(1, size // one))]})


def many_values_answer(values: int) -> bytes:
    """A ps answer of ``values`` tiny JSON values (``{}``), a few bytes each."""
    rows = b"[" + b",".join([b"{}"] * values) + b"]"
    return _envelope({"agents": "ROWS"}).replace(b'"ROWS"', rows)


@pytest.fixture
def sidecars() -> Iterator[tuple[list[Node], dict[str, bytes]]]:
    """NODES fake sidecars (one server listening on all of loopback); each answers ``body``."""
    answer = {"body": _envelope({"agents": []})}

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: Any) -> None:
            pass

        def do_POST(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            if length:
                self.rfile.read(length)
            data = answer["body"]
            self.send_response(200)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    httpd.server_close()
    port = httpd.server_address[1]

    class Server(ThreadingHTTPServer):
        request_queue_size = 128  # a node per connection at once
        daemon_threads = True

        def handle_error(self, request: Any, client_address: Any) -> None:
            pass  # a cut node's client closes its connection mid-answer

    httpd = Server(("0.0.0.0", port), Handler)  # every 127.0.0.x reaches it
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield [Node(f"127.0.0.{i + 1}", port) for i in range(NODES)], answer
    finally:
        httpd.shutdown()
        httpd.server_close()


def test_answers_at_the_per_node_bound_are_held_to_the_total_and_the_cut_nodes_named(sidecars, monkeypatch):
    nodes, answer = sidecars
    # GIVEN 64 nodes that each answer ps at the per-node bound (scaled: 1 MiB a node), and a
    # total of 8 MiB for the command
    per_node = 1 << 20
    monkeypatch.setitem(fanout.LISTING_ANSWER_BYTES, "ps", per_node)
    answer["body"] = wide_answer(per_node - 4096)
    assert per_node - 64 * 1024 < len(answer["body"]) <= per_node
    client = SidecarClient(TOKEN, timeout=60, max_in_flight=16, total_bytes=8 << 20)
    # WHEN ps asks them all
    answers = client.action_all(nodes, "ps", {})
    # THEN what is kept stays within the total, counted in the bytes of the kept answers
    kept = [a for a in answers if a.answered]
    cut = [a for a in answers if a.cut]
    assert client.last_budget is not None
    assert client.last_budget.held_bytes == len(kept) * len(answer["body"]) <= 8 << 20
    # and the nodes past it are cut, each with the reason; every other node's answer is whole
    # (each node is sure of total / 128; past that, the answers drew on the other half, whole)
    floor = (8 << 20) // (2 * NODES)
    assert len(kept) == ((8 << 20) - floor * NODES) // (len(answer["body"]) - floor) >= 1
    assert len(cut) == NODES - len(kept), [a.error for a in answers if not a.answered and not a.cut]
    assert all(not a.answered and a.result is None for a in cut)
    assert all((a.error or "").startswith("cut: the answers of the 64 node(s)") for a in cut)
    assert all(a.ok and len(a.result["agents"]) > 100 for a in kept)
    assert all(a.summary("x")["cut"] for a in cut) and not any(a.summary("x")["cut"] for a in kept)


def test_answers_of_many_json_values_share_the_total_of_values_too(sidecars, monkeypatch):
    nodes, answer = sidecars
    # GIVEN nodes whose answers are small in bytes but each holds 20 000 JSON values, under a
    # total of 200 000 values for the command
    answer["body"] = many_values_answer(20_000)
    client = SidecarClient(TOKEN, timeout=60, max_in_flight=16, total_values=200_000)
    # WHEN they are all asked
    answers = client.action_all(nodes, "ps", {})
    # THEN the values decoded stay within the total, and the rest are cut with the reason
    kept = [a for a in answers if a.answered]
    assert client.last_budget is not None and client.last_budget.held_values <= 200_000
    # (counted as the decoder will make them, before decoding: each "{}," as two; each node
    # is sure of total / 128, and the answers past that drew on the other half, whole)
    values, floor = count_json_values(answer["body"]), 200_000 // (2 * NODES)
    assert len(kept) == (200_000 - floor * NODES) // (values - floor) >= 1
    assert all("200000 JSON values together" in (a.error or "") for a in answers if a.cut)
    assert sum(a.cut for a in answers) == NODES - len(kept)


def test_small_answers_are_never_cut(sidecars):
    nodes, answer = sidecars
    # GIVEN 64 nodes with honest, small answers
    answer["body"] = wide_answer(40_000)
    # WHEN they are asked with the default total
    answers = SidecarClient(TOKEN, timeout=60, max_in_flight=16).action_all(nodes, "ps", {})
    # THEN all of them are kept
    assert all(a.ok for a in answers) and not any(a.cut for a in answers)


def test_a_caller_holding_two_answers_per_node_counts_its_nodes_once():
    # GIVEN the watch's client over 64 nodes: it holds each node's progress and stacks at once
    client = SidecarClient(TOKEN)
    client.shared_by, client.answers_per_node = 64, 2
    # WHEN one node's answer draws on its share
    share = client._alone()
    # THEN the total is shared among 128 answers, and a cut names the 64 nodes, not 128
    assert share.budget.floor_bytes == client.total_bytes // 128
    assert share.budget.floor_values == client.total_values // 128
    reason = share.budget.reason("bytes", Node("n1", 8787))
    assert "the answers of the 64 node(s) (2 each) of this command" in reason and "128" not in reason


def test_the_cli_names_the_cut_nodes_in_text_and_json(sidecars, monkeypatch, capsys, tmp_path: Path):
    nodes, answer = sidecars
    # GIVEN 64 nodes answering at a (scaled) per-node bound and a total that holds a few
    per_node = 256 * 1024
    monkeypatch.setitem(fanout.LISTING_ANSWER_BYTES, "ps", per_node)
    monkeypatch.setattr(fanout, "TOTAL_ANSWER_BYTES", 2 << 20)
    answer["body"] = wide_answer(per_node - 4096)
    token = tmp_path / "token"
    token.write_text(TOKEN)
    token.chmod(0o600)
    spec = ",".join(n.address for n in nodes)
    base = ["ps", "--hosts", spec, "--token-file", str(token), "--node-timeout", "60", "--max-in-flight", "16"]
    # WHEN ps runs job-wide, with --json and without
    main([*base, "--json"])
    doc = json.loads(capsys.readouterr().out)
    main(base)
    text = capsys.readouterr().out
    # THEN --json marks each cut node, with the reason, and the text names them
    cut = [n for n in doc["nodes"] if n["cut"]]
    assert cut and len(cut) < NODES and all(n["error"].startswith("cut: ") for n in cut)
    # (the same number each time: the answers are of one size; which nodes, the order of arrival)
    assert f"{len(cut)} of {NODES} node(s) cut" in text
    listed = text.split("node(s) cut")[1].splitlines()[1 : 1 + len(cut)]
    assert sorted(listed) == sorted(f"  {n.address}" for n in nodes if f"  {n.address}" in listed)
    assert len(set(listed)) == len(cut)


ARTIFACT_ID = "j/h/rank0/stacks/20260101T000000.000000Z-1"


def artifact_of(node: Node) -> str:
    """Each node's artifact has an id of its own (its host segment), as on real nodes."""
    return ARTIFACT_ID.replace("/h/", f"/h{node.host.replace('.', '-')}/")


FILE = b'{"threads": []}\n'


def manifest_answer(values: int, pad_bytes: int = 0) -> bytes:
    """An artifact's manifest answer listing FILE, with ``values`` more JSON values (a trace's
    spans, say) and ``pad_bytes`` of text."""
    import hashlib

    files = [{"name": "stacks.json", "size": len(FILE), "sha256": hashlib.sha256(FILE).hexdigest()}]
    manifest = {"kind": "stacks", "files": files, "spans": [1] * values, "text": "x" * pad_bytes}
    return json.dumps({"id": ARTIFACT_ID, "manifest": manifest}).encode()


@pytest.fixture
def artifact_nodes() -> Iterator[tuple[list[Node], dict[str, Any]]]:
    """NODES fake sidecars (one server on all of loopback) that each hold ARTIFACT_ID: its
    manifest is ``state["manifest"]``; its file is served once every node has asked for its
    manifest (so that a fetch holds all the manifests it kept at once)."""
    state: dict[str, Any] = {"manifest": manifest_answer(0), "asked": 0, "all_asked": threading.Event()}
    lock = threading.Lock()

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: Any) -> None:
            pass

        def do_GET(self) -> None:
            if "manifest=1" in self.path:
                with lock:
                    state["asked"] += 1
                    if state["asked"] >= NODES:
                        state["all_asked"].set()
                data = state["manifest"]
            else:
                state["all_asked"].wait(60)
                data = FILE
            self.send_response(200)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

    class Server(ThreadingHTTPServer):
        request_queue_size = 128
        daemon_threads = True

        def handle_error(self, request: Any, client_address: Any) -> None:
            pass

    probe = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    port = probe.server_address[1]
    probe.server_close()
    httpd = Server(("0.0.0.0", port), Handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield [Node(f"127.0.0.{i + 1}", port) for i in range(NODES)], state
    finally:
        httpd.shutdown()
        httpd.server_close()


def test_a_fetch_holds_its_manifests_to_a_total_and_names_the_nodes_cut(artifact_nodes, monkeypatch, tmp_path):
    from dynprof.job.fetch import fetch

    nodes, state = artifact_nodes
    # GIVEN 64 nodes whose manifests are 1 MiB each, and a total of 8 MiB of manifests held at once
    monkeypatch.setattr(answer_budget, "TOTAL_MANIFEST_BYTES", 8 << 20)
    state["manifest"] = manifest_answer(0, pad_bytes=(1 << 20) - 1024)
    client = SidecarClient(TOKEN, timeout=60, max_in_flight=NODES)
    # WHEN their artifacts are fetched, all the manifests held while the files are copied
    rows = fetch(client, tmp_path / "fetched", [(n, artifact_of(n)) for n in nodes])
    # THEN the manifests held at once stayed within the total: the nodes past it are cut and
    # named, each with the reason; every other node's artifact is copied whole
    cut = [r for r in rows if r.get("cut")]
    whole = [r for r in rows if not r["error"]]
    assert cut and whole and len(cut) + len(whole) == NODES, [r["error"] for r in rows if not r.get("cut")]
    assert len(whole) * len(state["manifest"]) <= 8 << 20
    assert all(r["error"].startswith("cut: the artifact manifests this command holds at once") for r in cut)
    assert {r["node"] for r in cut} | {r["node"] for r in whole} == {n.address for n in nodes}
    assert all(r["files"] == 1 for r in whole)
    # AND once the fetch is over, nothing is counted as held any more
    assert (client.manifests.held_bytes, client.manifests.held_values) == (0, 0)


def test_honest_manifests_of_many_nodes_are_never_cut(artifact_nodes, tmp_path):
    from dynprof.job.fetch import fetch

    nodes, state = artifact_nodes
    # GIVEN 64 nodes whose manifests are a trace's: 10 000 spans described
    state["manifest"] = manifest_answer(10_000)
    # WHEN their artifacts are fetched with the default totals
    rows = fetch(SidecarClient(TOKEN, timeout=60), tmp_path / "fetched", [(n, artifact_of(n)) for n in nodes])
    # THEN every one is copied
    assert [r["error"] for r in rows] == [None] * NODES
