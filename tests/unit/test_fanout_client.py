"""The fan-out client against scripted servers: retries, refusals, garbage, TLS; merged labels."""

from __future__ import annotations

import json
import shutil
import socket
import ssl
import subprocess
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from collectors.stacks import Frame, ProcessStacks, ThreadStack, group_processes
from dynprof.cli._many_nodes import NODES_FAILED_EXIT, exit_code, node_labels
from dynprof.job import client as fanout
from dynprof.job.client import NodeAnswer, NodeFailure, SidecarClient, check_artifact_id, check_file_name
from dynprof.job.discovery import Node

TOKEN = "unit-test-token-0123456789"
GOOD = {
    "api": 1,
    "action": "ps",
    "host": "node-1",
    "dynprof_version": "0.1.0",
    "exit_code": 0,
    "result": {"agents": []},
    "messages": [],
    "elapsed_s": 0.01,
}


class Script:
    """What the server answers, one entry per request: (status, headers, body bytes) or a delay."""

    def __init__(self) -> None:
        self.replies: list[Any] = []
        self.seen: list[dict[str, Any]] = []


@pytest.fixture
def server() -> Iterator[tuple[Script, Node, ThreadingHTTPServer]]:
    script = Script()

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: Any) -> None:
            pass

        def _reply(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            body = self.rfile.read(length) if length else b""
            script.seen.append({"path": self.path, "auth": self.headers.get("Authorization"), "body": body})
            reply = script.replies.pop(0) if script.replies else (200, {}, json.dumps(GOOD).encode())
            if isinstance(reply, float):
                time.sleep(reply)
                return
            if isinstance(reply, bytes):  # a whole answer, as the wire carries it
                self.wfile.write(reply)
                self.close_connection = True
                return
            status, headers, data = reply
            self.send_response(status)
            for k, v in headers.items():
                self.send_header(k, v)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        do_GET = _reply
        do_POST = _reply

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    httpd.daemon_threads = True
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield script, Node("127.0.0.1", httpd.server_address[1]), httpd
    finally:
        httpd.shutdown()
        httpd.server_close()


def test_an_answer_is_read_with_the_bearer_token(server):
    script, node, _ = server
    # WHEN an action is asked for
    answer = SidecarClient(TOKEN, timeout=5).action(node, "ps", {"job": "j"}, timeout=2)
    # THEN the token and the options went along, and the answer is taken
    assert answer.ok and answer.host == "node-1" and answer.result == {"agents": []}
    (req,) = script.seen
    assert req["auth"] == f"Bearer {TOKEN}" and req["path"] == "/api/v1/actions/ps"
    assert json.loads(req["body"]) == {"options": {"job": "j"}, "timeout": 2}


def test_busy_is_retried_once_after_retry_after(server):
    script, node, _ = server
    script.replies = [(429, {"Retry-After": "0"}, b"{}")]
    answer = SidecarClient(TOKEN, timeout=5).action(node, "ps", {})
    assert answer.ok and len(script.seen) == 2


def test_busy_twice_or_past_the_deadline_is_a_failure(server):
    script, node, _ = server
    script.replies = [(429, {"Retry-After": "0"}, b"{}"), (429, {"Retry-After": "0"}, b"{}")]
    answer = SidecarClient(TOKEN, timeout=5).action(node, "ps", {})
    assert not answer.answered and answer.error is not None and answer.error.startswith("429:")
    # a Retry-After beyond the deadline: no wait, at once (not the Retry-After, nor until the
    # deadline: well under half of it, however slow the machine)
    script.replies, script.seen = [(429, {"Retry-After": "600"}, b"{}")], []
    t0 = time.monotonic()
    answer = SidecarClient(TOKEN, timeout=20).action(node, "ps", {})
    assert not answer.answered and time.monotonic() - t0 < 10 and len(script.seen) == 1


@pytest.mark.parametrize(
    ("reply", "reason"),
    [
        ((401, {}, b'{"error": "Unauthorized", "code": 401}'), "401: wrong token"),
        ((404, {}, b"<html>nope</html>"), "not a dynprof sidecar"),
        ((200, {}, b"<html>hello</html>"), "not a dynprof sidecar"),
        ((200, {}, b"[1, 2]"), "not a dynprof sidecar"),
        ((200, {}, json.dumps({**GOOD, "api": 2}).encode()), "api version 2"),
        ((200, {}, json.dumps({**GOOD, "exit_code": "zero"}).encode()), "has no exit code"),
        ((200, {}, json.dumps({**GOOD, "messages": "x"}).encode()), "not a list"),
        ((500, {}, b'{"error": "internal error"}'), "500: the sidecar on"),
        ((413, {}, b""), "413"),
        ((200, {}, b"[" * 100_000 + b"]" * 100_000), "nested too deeply"),
        ((200, {}, json.dumps({**GOOD, "result": json.loads("[" * 200 + "]" * 200)}).encode()), "nested deeper"),
        ((200, {}, b"\xff\xfe not utf-8"), "not valid JSON"),
        ((401, {}, b"[" * 100_000), "401: wrong token"),
        (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\nxx\r\n", "a malformed HTTP answer"),
        (b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n{}", "was cut off (98 bytes missing)"),
        (b"SSH-2.0-OpenSSH_9.6\r\n", "no HTTP answer"),
        (b"HTTP/1.1 200 OK\r\n" + b"X-Long: " + b"a" * 70_000 + b"\r\n\r\n", "a malformed HTTP answer"),
    ],
)
def test_refusals_and_garbage_become_reasons(server, reply, reason):
    script, node, _ = server
    script.replies = [reply]
    answer = SidecarClient(TOKEN, timeout=5).action(node, "ps", {})
    assert not answer.answered and answer.error is not None and reason in answer.error, answer.error


def test_an_oversized_answer_is_refused(server, monkeypatch):
    script, node, _ = server
    monkeypatch.setattr(fanout, "MAX_ANSWER_BYTES", 1000)
    script.replies = [(200, {}, json.dumps({**GOOD, "result": "x" * 5000}).encode())]
    answer = SidecarClient(TOKEN, timeout=5).action(node, "ps", {})
    assert not answer.answered and "refused" in (answer.error or "")


def test_a_silent_node_times_out_and_a_closed_port_is_refused(server):
    script, node, _ = server
    script.replies = [120.0]  # the node answers only after two minutes
    t0 = time.monotonic()
    answer = SidecarClient(TOKEN, timeout=0.5).action(node, "ps", {})
    assert not answer.answered and (answer.error or "").startswith("timed out after")
    assert time.monotonic() - t0 < 60  # it gave up at its timeout, without waiting for the node
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed = Node("127.0.0.1", s.getsockname()[1])
    answer = SidecarClient(TOKEN, timeout=2).action(closed, "ps", {})
    assert answer.error == f"connection refused: is `dynprof serve` running on {closed}?"


def test_many_nodes_answer_in_order_and_the_exit_code_says_one_failed(server):
    _, node, _ = server
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed = Node("127.0.0.1", s.getsockname()[1])
    answers = SidecarClient(TOKEN, timeout=2, max_in_flight=2).action_all([node, closed, node], "ps", {})
    assert [a.answered for a in answers] == [True, False, True]
    assert exit_code(answers) == NODES_FAILED_EXIT == 12
    assert exit_code([answers[0], NodeAnswer(node, True, exit_code=8)]) == 8


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command to make a certificate")
def test_https_is_verified_against_the_given_ca(server, tmp_path):
    # GIVEN the server behind TLS with a self-signed certificate for 127.0.0.1
    _, node, httpd = server
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=127.0.0.1",
         "-addext", "subjectAltName=IP:127.0.0.1", "-keyout", str(key), "-out", str(cert)],
        check=True, capture_output=True,
    )  # fmt: skip
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(cert, key)
    httpd.socket = ctx.wrap_socket(httpd.socket, server_side=True)

    # THEN with its certificate as the CA the answer is read
    assert SidecarClient(TOKEN, tls=fanout.tls_context(str(cert)), timeout=5).action(node, "ps", {}).ok
    # and with the system's CAs it is not trusted
    answer = SidecarClient(TOKEN, tls=ssl.create_default_context(), timeout=5).action(node, "ps", {})
    assert "not trusted" in (answer.error or "") and "--cacert" in (answer.error or "")
    # and a name the certificate does not hold is named as such
    answer = SidecarClient(TOKEN, tls=fanout.tls_context(str(cert)), timeout=5).action(
        Node("localhost", node.port), "ps", {}
    )
    assert "does not name localhost" in (answer.error or ""), answer.error
    # and plain http to it is not mistaken for an answer
    answer = SidecarClient(TOKEN, timeout=5).action(node, "ps", {})
    assert not answer.answered and "--cacert" in (answer.error or ""), answer.error


@pytest.mark.parametrize("bad", ["../x", "/etc/passwd", "a//b", "a/../b", "j/h/r/k/.x", "", 7, "a/b\x00"])
def test_artifact_ids_that_could_leave_the_fetch_directory_are_refused(bad):
    with pytest.raises(NodeFailure):
        check_artifact_id(bad)


def test_artifact_ids_and_file_names_of_the_store_pass():
    assert check_artifact_id("job-1/node-5/rank3/trace/20260101T000000.000000Z-4242")
    assert check_file_name("trace.json.gz")
    for bad in ("../x", ".hidden", "a/b", None):
        with pytest.raises(NodeFailure):
            check_file_name(bad)


def test_groups_over_nodes_name_each_rank_with_its_node():
    # GIVEN ranks 0-6 on two nodes waiting in all_reduce and rank 7 on node-2 in the data loader
    wait = [Frame("all_reduce", "/c10d.py", 10), Frame("main", "/train.py", 5)]
    load = [Frame("__next__", "/dataloader.py", 3), Frame("main", "/train.py", 4)]

    def proc(rank: int, host: str, frames: list[Frame]) -> ProcessStacks:
        return ProcessStacks(
            pid=100 + rank,
            method="py-spy",
            rank=rank,
            host=host,
            threads=[ThreadStack(100 + rank, main=True, frames=frames)],
        )

    procs = [proc(r, "node-1" if r < 4 else "node-2", wait) for r in range(7)] + [proc(7, "node-2", load)]
    # WHEN grouped by host
    big, odd = group_processes(procs, by_host=True)
    # THEN the labels name the nodes
    assert big.labels == "ranks 0-3 on node-1, ranks 4-6 on node-2"
    assert odd.outlier and odd.labels == "rank 7 on node-2"
    assert [m["host"] for m in odd.to_json()["members"]] == ["node-2"]
    # and past a few nodes they are counted
    many = [proc(r, f"node-{r}", wait) for r in range(8)]
    (g,) = group_processes(many, by_host=True)
    assert g.labels == "ranks 0-7 on 8 nodes"


def test_nodes_sharing_a_host_are_named_with_their_port():
    nodes = [Node("a", 1), Node("a", 2), Node("b", 8787)]
    assert node_labels(nodes) == {nodes[0]: "a:1", nodes[1]: "a:2", nodes[2]: "b"}


def test_the_client_needs_a_private_token_file(tmp_path: Path):
    from argparse import Namespace

    from dynprof import errors
    from dynprof.cli import main
    from dynprof.cli._many_nodes import client_for

    # GIVEN a token file other users can read
    loose = tmp_path / "tok"
    loose.write_text(TOKEN)
    loose.chmod(0o644)
    # THEN no client is made with it
    with pytest.raises(errors.PermissionDenied):
        client_for(Namespace(token_file=str(loose), cacert=None, node_timeout=1.0, max_in_flight=4))
    # and pids, which are one node's, do not go with --hosts
    with pytest.raises(SystemExit):
        main(["ps", "--hosts", "127.0.0.1:1", "--pid", "1"])  # ps has no --pid at all
    assert main(["stacks", "--hosts", "127.0.0.1:1", "--pid", "1"]) == 2


def _manifest(files: list[dict[str, Any]]) -> bytes:
    return json.dumps({"id": "j/h/rank0/trace/a-1", "manifest": {"kind": "trace", "files": files}}).encode()


def test_fetch_keeps_only_files_that_match_the_manifest(server, tmp_path):
    import hashlib

    from dynprof.cli._many_nodes import fetch

    script, node, _ = server
    good, bad = b"trace bytes", b"tampered!!!"
    files = [
        {"name": "trace.json.gz", "size": len(good), "sha256": hashlib.sha256(good).hexdigest()},
        {"name": "other.txt", "size": len(bad), "sha256": hashlib.sha256(b"the original").hexdigest()},
    ]
    # GIVEN a node whose second file is not the one its manifest describes
    script.replies = [(200, {}, _manifest(files)), (200, {}, good), (200, {}, bad)]
    client = SidecarClient(TOKEN, timeout=5)
    # WHEN the artifact is fetched
    (row,) = fetch(client, tmp_path / "dest", [(node, "j/h/rank0/trace/a-1")])
    # THEN the good file is kept, the tampered one is not, and the artifact is reported
    target = tmp_path / "dest" / "j/h/rank0/trace/a-1"
    assert "sha256 differs" in row["error"] and row["files"] == 1
    assert (target / "trace.json.gz").read_bytes() == good
    assert not (target / "other.txt").exists() and not (target / "manifest.json").exists()
    assert [r["path"] for r in script.seen][1:] == [
        "/api/v1/artifacts/j/h/rank0/trace/a-1/files/trace.json.gz",
        "/api/v1/artifacts/j/h/rank0/trace/a-1/files/other.txt",
    ]


@pytest.mark.parametrize(
    "files",
    [
        [{"name": "../../escape", "size": 1, "sha256": "0" * 64}],
        [{"name": "x", "size": -1, "sha256": "0" * 64}],
        [{"name": "x", "size": 1}],
        "not a list",
    ],
)
def test_fetch_refuses_manifests_that_name_files_badly(server, tmp_path, files):
    from dynprof.cli._many_nodes import fetch

    script, node, _ = server
    script.replies = [(200, {}, _manifest(files))]  # type: ignore[arg-type]
    (row,) = fetch(SidecarClient(TOKEN, timeout=5), tmp_path / "dest", [(node, "j/h/rank0/trace/a-1")])
    assert row["error"] and row["files"] == 0
    assert len(script.seen) == 1  # no file asked for
    assert not (tmp_path / "escape").exists()


def test_fetch_of_a_file_longer_than_its_manifest_says_stops_reading(server, tmp_path):
    import hashlib

    from dynprof.cli._many_nodes import fetch

    script, node, _ = server
    data = b"x" * 100_000
    files = [{"name": "f", "size": 10, "sha256": hashlib.sha256(data[:10]).hexdigest()}]
    script.replies = [(200, {}, _manifest(files)), (200, {}, data)]
    (row,) = fetch(SidecarClient(TOKEN, timeout=5), tmp_path / "dest", [(node, "j/h/rank0/trace/a-1")])
    assert "refused" in row["error"] and not list((tmp_path / "dest").rglob("f"))


def test_nccl_dumps_are_read_back_from_each_node_s_artifact_checked(server):
    import hashlib

    from dynprof.cli._many_nodes import _dumps_of

    # GIVEN a node's nccl artifact with one good dump, one that is not JSON, one nested too deep
    script, node, _ = server
    good = json.dumps({"dumps": {"nccl": {"entries": []}}}).encode()
    junk = b"not json"
    deep = b"[" * 1000 + b"]" * 1000
    files = [
        {"name": n, "size": len(d), "sha256": hashlib.sha256(d).hexdigest()}
        for n, d in (("rank0-pid11.json", good), ("rank1-pid12.json", junk), ("rank2-pid13.json", deep))
    ] + [{"name": "analysis.txt", "size": 1, "sha256": "0" * 64}]
    script.replies = [(200, {}, _manifest(files)), (200, {}, good), (200, {}, junk), (200, {}, deep)]
    notes: list[str] = []
    # WHEN its dumps are read back
    dumps = _dumps_of(SidecarClient(TOKEN, timeout=5), node, "j/h/node/nccl/a-1", notes, "node-1")
    # THEN the good one is taken, the others named, and no other file is asked for
    assert dumps == [(0, {"dumps": {"nccl": {"entries": []}}})]
    assert len(notes) == 2 and "rank1-pid12.json" in notes[0] and "rank2-pid13.json" in notes[1]
    assert len(script.seen) == 4
