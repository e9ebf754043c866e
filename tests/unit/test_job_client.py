"""The fan-out client against scripted servers: retries, refusals, garbage, TLS; merged labels."""

from __future__ import annotations

import json
import shutil
import ssl
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from collectors.stacks import Frame, ProcessStacks, ThreadStack, group_processes
from dynprof.job import client as fanout
from dynprof.job.answers import node_labels
from dynprof.job.client import NodeFailure, SidecarClient, check_artifact_id, check_file_name
from dynprof.job.merge import NODES_FAILED_EXIT, exit_code
from dynprof.nodes import Node, NodeAnswer
from tests._ports import free_port

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

    class Server(ThreadingHTTPServer):
        def handle_error(self, request: Any, client_address: Any) -> None:
            # a client under test that hangs up early (a bounded read) is what some tests ask
            if not isinstance(sys.exc_info()[1], ConnectionError):
                super().handle_error(request, client_address)

    httpd = Server(("127.0.0.1", 0), Handler)
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
        ((200, {}, b"[" * 100_000 + b"]" * 100_000), "nested deeper than 64 levels"),
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


def test_an_artifact_manifest_is_asked_for_alone_and_a_huge_answer_to_it_is_refused(server):
    script, node, _ = server
    aid = "j/h/rank0/trace/20260101T000000.000000Z-1"
    # GIVEN a node that answers a manifest request with 3 MiB (a manifest is at most 1 MiB)
    script.replies = [(200, {}, json.dumps({"id": aid, "manifest": {"pad": "x" * (3 << 20)}}).encode())]
    with pytest.raises(NodeFailure) as e:
        SidecarClient(TOKEN, timeout=5).artifact(node, aid)
    # THEN it is refused by its size, and the request asked for the manifest alone
    assert "the answer is over 2.1 MiB" in e.value.reason, e.value.reason
    assert script.seen[0]["path"].endswith("?manifest=1")
    # AND a manifest of the usual size is taken
    script.replies = [(200, {}, json.dumps({"id": aid, "manifest": {"kind": "trace"}}).encode())]
    assert SidecarClient(TOKEN, timeout=5).artifact(node, aid)["manifest"] == {"kind": "trace"}


def test_a_silent_node_times_out_and_a_closed_port_is_refused(server):
    script, node, _ = server
    script.replies = [120.0]  # the node answers only after two minutes
    t0 = time.monotonic()
    answer = SidecarClient(TOKEN, timeout=0.5).action(node, "ps", {})
    assert not answer.answered and (answer.error or "").startswith("timed out after")
    assert time.monotonic() - t0 < 60  # it gave up at its timeout, without waiting for the node
    closed = Node("127.0.0.1", free_port())
    answer = SidecarClient(TOKEN, timeout=2).action(closed, "ps", {})
    assert answer.error == f"connection refused: is `dynprof serve` running on {closed}?"


def test_many_nodes_answer_in_order_and_the_exit_code_says_one_failed(server):
    _, node, _ = server
    closed = Node("127.0.0.1", free_port())
    answers = SidecarClient(TOKEN, timeout=30, max_in_flight=2).action_all([node, closed, node], "ps", {})
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


@pytest.mark.parametrize(
    "bad",
    [
        "../x",
        "/etc/passwd",
        "a//b",
        "a/../b",
        "j/h/r/k/.x",
        "",
        7,
        "a/b\x00",
        "j/h/rank0/stacks/a-1/inner",  # six segments: inside another artifact's directory
        "j/h/rank0/stacks",  # four: a kind's directory
        "j/h/host/stacks/a-1",  # no rank segment
        "j/h/rank\u0661/stacks/a-1",  # a rank in Arabic-Indic digits
    ],
)
def test_artifact_ids_that_could_leave_the_fetch_directory_are_refused(bad):
    with pytest.raises(NodeFailure):
        check_artifact_id(bad)


def test_artifact_ids_and_file_names_of_the_store_pass():
    assert check_artifact_id("job-1/node-5/rank3/trace/20260101T000000.000000Z-4242")
    assert check_artifact_id("nojob/node-5/node/host-memory/20260101T000000.000000Z-4242")
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
    from dynprof.cli.job import client_for

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

    from dynprof.job.fetch import fetch

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
    from dynprof.job.fetch import fetch

    script, node, _ = server
    script.replies = [(200, {}, _manifest(files))]  # type: ignore[arg-type]
    (row,) = fetch(SidecarClient(TOKEN, timeout=5), tmp_path / "dest", [(node, "j/h/rank0/trace/a-1")])
    assert row["error"] and row["files"] == 0
    assert len(script.seen) == 1  # no file asked for
    assert not (tmp_path / "escape").exists()


def test_fetch_of_a_file_longer_than_its_manifest_says_stops_reading(server, tmp_path):
    import hashlib

    from dynprof.job.fetch import fetch

    script, node, _ = server
    data = b"x" * 100_000
    files = [{"name": "f", "size": 10, "sha256": hashlib.sha256(data[:10]).hexdigest()}]
    script.replies = [(200, {}, _manifest(files)), (200, {}, data)]
    (row,) = fetch(SidecarClient(TOKEN, timeout=5), tmp_path / "dest", [(node, "j/h/rank0/trace/a-1")])
    assert "refused" in row["error"] and not list((tmp_path / "dest").rglob("f"))


def test_nccl_dumps_are_read_back_from_each_node_s_artifact_checked(server):
    import hashlib

    from dynprof.job.nccl import read_rank_dumps

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
    dumps = read_rank_dumps(SidecarClient(TOKEN, timeout=5), node, "j/h/node/nccl/a-1", notes, "node-1")
    # THEN the good one is taken, the others named, and no other file is asked for
    assert dumps == [(0, {"dumps": {"nccl": {"entries": []}}})]
    assert len(notes) == 2 and "rank1-pid12.json" in notes[0] and "rank2-pid13.json" in notes[1]
    assert len(script.seen) == 4


def test_fetch_refuses_a_manifest_that_claims_more_than_the_store_holds(server, tmp_path, monkeypatch):
    from dynprof.job.fetch import fetch

    # GIVEN a store limit of 1000 bytes, and a node whose manifest claims 2000 (in two files)
    monkeypatch.setenv("DYNPROF_ARTIFACT_MAX_BYTES", "1000")
    script, node, _ = server
    files = [{"name": n, "size": 1000, "sha256": "0" * 64} for n in ("a.bin", "b.bin")]
    script.replies = [(200, {}, _manifest(files))]
    # WHEN the artifact is fetched
    (row,) = fetch(SidecarClient(TOKEN, timeout=5), tmp_path / "dest", [(node, "j/h/rank0/trace/a-1")])
    # THEN it is refused with the limit named, before any file is asked for, and nothing is written
    assert "over the store's limit" in row["error"] and "DYNPROF_ARTIFACT_MAX_BYTES" in row["error"]
    assert row["files"] == 0 and len(script.seen) == 1
    assert not list((tmp_path / "dest").rglob("*.bin"))


def test_a_fetch_stops_at_the_store_limit_in_all(server, tmp_path, monkeypatch):
    import hashlib

    from dynprof.job.fetch import fetch

    # GIVEN a store limit of 1000 bytes, and two artifacts of 600 bytes each
    monkeypatch.setenv("DYNPROF_ARTIFACT_MAX_BYTES", "1000")
    script, node, _ = server
    data = b"x" * 600
    files = [{"name": "f.bin", "size": len(data), "sha256": hashlib.sha256(data).hexdigest()}]
    script.replies = [(200, {}, _manifest(files)), (200, {}, data), (200, {}, _manifest(files))]
    # WHEN both are fetched
    first, second = fetch(
        SidecarClient(TOKEN, timeout=5),
        tmp_path / "dest",
        [(node, "j/h/rank0/trace/a-1"), (node, "j/h/rank1/trace/a-2")],
    )
    # THEN the first is copied whole, the second refused before its file is asked for
    assert first["error"] is None and first["files"] == 1
    assert (tmp_path / "dest/j/h/rank0/trace/a-1/f.bin").read_bytes() == data
    assert (tmp_path / "dest/j/h/rank0/trace/a-1/manifest.json").is_file()
    assert "past the store's limit" in second["error"] and second["files"] == 0
    assert len(script.seen) == 3


def test_nccl_dumps_over_the_limit_are_refused_per_rank_before_they_are_read(server):
    import hashlib

    from dynprof.job.nccl import MAX_DUMP_BYTES, read_rank_dumps

    # GIVEN a node's nccl artifact whose manifest claims a dump over the limit for rank 0
    script, node, _ = server
    good = json.dumps({"dumps": {"nccl": {"entries": []}}}).encode()
    files = [
        {"name": "rank0-pid11.json", "size": MAX_DUMP_BYTES + 1, "sha256": "0" * 64},
        {"name": "rank1-pid12.json", "size": len(good), "sha256": hashlib.sha256(good).hexdigest()},
    ]
    script.replies = [(200, {}, _manifest(files)), (200, {}, good)]
    notes: list[str] = []
    # WHEN its dumps are read back
    dumps = read_rank_dumps(SidecarClient(TOKEN, timeout=5), node, "j/h/node/nccl/a-1", notes, "node-1")
    # THEN rank 0's is a note naming its size and the limit, never asked for; rank 1's is read
    assert dumps == [(1, {"dumps": {"nccl": {"entries": []}}})]
    assert len(notes) == 1 and "rank0-pid11.json" in notes[0] and "over the 64.0 MiB" in notes[0], notes
    assert [r["path"] for r in script.seen][1:] == ["/api/v1/artifacts/j/h/node/nccl/a-1/files/rank1-pid12.json"]


def test_nccl_dumps_past_the_total_are_named_and_not_read(server):
    import hashlib

    from dynprof.job.fetch import Budget
    from dynprof.job.nccl import read_rank_dumps

    # GIVEN two ranks' dumps, and room for one of them in all
    script, node, _ = server
    good = json.dumps({"dumps": {"nccl": {"entries": []}}}).encode()
    files = [
        {"name": f"rank{r}-pid1{r}.json", "size": len(good), "sha256": hashlib.sha256(good).hexdigest()} for r in (0, 1)
    ]
    script.replies = [(200, {}, _manifest(files)), (200, {}, good)]
    notes: list[str] = []
    # WHEN they are read back
    dumps = read_rank_dumps(
        SidecarClient(TOKEN, timeout=5), node, "j/h/node/nccl/a-1", notes, "node-1", Budget(len(good))
    )
    # THEN the first is read, the second named as past the total
    assert [rank for rank, _ in dumps] == [0]
    assert len(notes) == 1 and "rank 1" in notes[0] and "in all" in notes[0]
    assert len(script.seen) == 2


def test_a_local_dump_over_the_limit_is_that_rank_s_failure(tmp_path, monkeypatch):
    from collectors.flight_recorder import collect as nccl
    from dynprof import errors

    # GIVEN a rank's dump, as its agent wrote it, one byte over the limit
    monkeypatch.setattr(nccl, "MAX_DUMP_BYTES", 100)
    (tmp_path / "rank0-pid7.json").write_text(json.dumps({"entries": ["x" * 100]}))
    (tmp_path / "rank1-pid8.json").write_text("not json")
    # WHEN it is read
    # THEN it is refused with its size and what to do, as is one that is not JSON
    with pytest.raises(errors.DynprofError, match=r"pid 7: its dump cannot be read: .*over the 100-byte limit") as exc:
        nccl._read_dump(tmp_path, "rank0-pid7.json", 7)
    assert "--no-stack-traces" in (exc.value.help or "")
    with pytest.raises(errors.DynprofError, match=r"pid 8: its dump cannot be read: .*not valid JSON"):
        nccl._read_dump(tmp_path, "rank1-pid8.json", 8)


# -- a hostile node ----------------------------------------------------------------------------
def test_a_dripping_node_is_cut_off_at_the_whole_answer_deadline(server):
    _, node, _ = server
    # GIVEN a node that sends its headers, then its body one byte every 0.2 s for up to 30 s
    head = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 100000\r\n\r\n"

    def dripping(handler: Any) -> None:
        handler.wfile.write(head)
        end = time.monotonic() + 30
        while time.monotonic() < end:
            handler.wfile.write(b" ")
            handler.wfile.flush()
            time.sleep(0.2)

    httpd = server[2]
    httpd.RequestHandlerClass.do_POST = lambda self: dripping(self)  # type: ignore[method-assign]
    # WHEN an action with a 1 s deadline is asked for, in a thread (a far bound: the hang detector)
    box: list[Any] = []
    thread = threading.Thread(target=lambda: box.append(SidecarClient(TOKEN, timeout=1.0).action(node, "ps", {})))
    thread.start()
    thread.join(25)
    # THEN it gave up at its deadline, long before the node stopped dripping, and says so
    assert not thread.is_alive() and box, "the client waited for the dripping node"
    answer = box[0]
    assert not answer.answered and (answer.error or "").startswith("timed out after")
    assert "reading the answer of" in (answer.error or "")


def test_headers_dripped_forever_are_cut_off_too(server):
    _, node, httpd = server

    # GIVEN a node that never finishes its status line's headers
    def dripping(handler: Any) -> None:
        handler.wfile.write(b"HTTP/1.1 200 OK\r\n")
        end = time.monotonic() + 30
        while time.monotonic() < end:
            handler.wfile.write(b"X")
            handler.wfile.flush()
            time.sleep(0.2)

    httpd.RequestHandlerClass.do_POST = lambda self: dripping(self)  # type: ignore[method-assign]
    # WHEN it is asked, with a 1 s deadline
    box: list[Any] = []
    thread = threading.Thread(target=lambda: box.append(SidecarClient(TOKEN, timeout=1.0).action(node, "ps", {})))
    thread.start()
    thread.join(25)
    # THEN the deadline holds
    assert not thread.is_alive() and box and (box[0].error or "").startswith("timed out after")


def test_an_answer_of_too_many_json_values_is_refused_before_it_is_decoded(server, monkeypatch):
    script, node, _ = server
    # GIVEN an answer whose result is a long list of empty objects (3 bytes each, ~70 decoded)
    monkeypatch.setattr(fanout, "MAX_ANSWER_VALUES", 10_000)
    rows = b"[" + b",".join([b"{}"] * 20_000) + b"]"
    body = json.dumps({**GOOD, "result": {"agents": "ROWS"}}).encode().replace(b'"ROWS"', rows)
    script.replies = [(200, {}, body)]
    # WHEN it is read
    answer = SidecarClient(TOKEN, timeout=5).action(node, "ps", {})
    # THEN that node failed, with the reason; nothing was decoded into the answer
    assert not answer.answered and answer.result is None
    assert "holds over 10000 JSON values: refused" in (answer.error or "")


@pytest.mark.parametrize("host", ["127.0.0.1\x01", "a\x7fb", "a b"])
def test_a_node_name_http_refuses_is_a_failure_of_that_node(host):
    # GIVEN a node whose name no HTTP request can carry (made without parse_node)
    node = Node(host, 8787)
    # WHEN it is asked
    answer = SidecarClient(TOKEN, timeout=2).action(node, "ps", {})
    # THEN that node failed cleanly: no exception out of the client
    assert not answer.answered and answer.error


def test_messages_that_are_not_text_are_not_expanded(server):
    script, node, _ = server
    # GIVEN an answer whose messages are big nested values, not lines of text
    script.replies = [(200, {}, json.dumps({**GOOD, "messages": [[list(range(10_000))], "plain"]}).encode())]
    # WHEN it is read
    answer = SidecarClient(TOKEN, timeout=5).action(node, "ps", {})
    # THEN the text is kept, the rest named by its type only
    assert answer.answered and answer.messages == ["(list)", "plain"]


def test_a_refusal_with_a_huge_body_is_read_for_its_reason_only(server, tmp_path):
    script, node, _ = server
    # GIVEN a node that refuses a file with a 20 MiB body
    script.replies = [(404, {}, b"x" * (20 << 20))]
    import tracemalloc

    # WHEN the file is downloaded (its manifest says 30 MiB)
    tracemalloc.start()
    try:
        with pytest.raises(NodeFailure) as info:
            SidecarClient(TOKEN, timeout=10).download(
                node, "j/h/rank0/stacks/a", "f.json", tmp_path / "f.json", 30 << 20, "0" * 64, 10
            )
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    # THEN the refusal is the reason, its body was not kept, and nothing is left behind
    assert "404" in info.value.reason and not list(tmp_path.iterdir())
    assert peak < 8 << 20, peak


def test_a_listing_answer_is_bounded_below_the_largest_answer(server):
    # GIVEN a node whose `ps` answer is 20 MiB of plausible rows: far more than a node's
    # agents ever say, though under the 80 MiB any action's answer may take
    script, node, _ = server
    row = {"pid": 1, "rank": 0, "cmdline": ["x" * 2000]}
    rows = [row] * (20 * 1024 * 1024 // len(json.dumps(row)))
    script.replies = [(200, {}, json.dumps({**GOOD, "result": {"agents": rows}}).encode())]
    # WHEN the client asks it
    answer = SidecarClient(TOKEN, timeout=30).action(node, "ps", {})
    # THEN the answer is refused for its size, as the node's failure
    assert not answer.answered and "over 16.0 MiB: refused" in (answer.error or ""), answer.error


def test_a_six_segment_id_is_not_fetched_into_another_artifact_s_directory(server, tmp_path):
    from dynprof.job.fetch import fetch

    script, node, _ = server
    # GIVEN a node that names an artifact inside another one's directory
    (row,) = fetch(SidecarClient(TOKEN, timeout=5), tmp_path / "dest", [(node, "j/h/rank0/trace/a-1/x")])
    # THEN it is refused with the reason, before anything is asked or written
    assert "bad artifact id" in row["error"] and row["files"] == 0
    assert script.seen == [] and not (tmp_path / "dest").exists()


def test_a_file_larger_than_its_kind_holds_is_not_fetched(server, tmp_path):
    from dynprof.job import fetch as job_fetch

    script, node, _ = server
    # GIVEN a stacks artifact whose manifest claims a 301 MB file (the store's limit is 20 GiB)
    files = [{"name": "stacks.json", "size": 301_000_000, "sha256": "0" * 64}]
    doc = {"id": "j/h/rank0/stacks/a-1", "manifest": {"kind": "stacks", "files": files}}
    script.replies = [(200, {}, json.dumps(doc).encode())]
    # WHEN it is fetched
    (row,) = job_fetch.fetch(SidecarClient(TOKEN, timeout=5), tmp_path / "dest", [(node, "j/h/rank0/stacks/a-1")])
    # THEN it is refused before the file is asked for, with the kind's limit
    assert "over the 256.0 MiB a file of a stacks artifact holds" in row["error"], row["error"]
    assert len(script.seen) == 1 and not list((tmp_path / "dest").rglob("stacks.json"))
    # and the kinds whose files are large keep the limits dynprof reads them up to
    from collectors.memory.reader import MAX_SNAPSHOT_BYTES
    from dynprof.untrusted import DEFAULT_MAX_TRACE_BYTES

    assert job_fetch.file_limit("j/h/rank0/trace/a-1") == DEFAULT_MAX_TRACE_BYTES > 301_000_000
    assert job_fetch.file_limit("j/h/rank0/memory/a-1") == MAX_SNAPSHOT_BYTES
