"""Abuse of a real `dynprof serve` and of the CLI readers, loopback only, bounded in count and time.

HTTP probes (traversal, links, Host header, methods, sizes, tokens) against a server
subprocess over a store that holds damaged artifacts, links to a secret outside it and bombs;
another uid (`runuser -u nobody`) where the test runs as root; and the peak RSS of `show`,
`memory-report` and the server on the gzip and pickle bombs (target < 200 MB).

Each test prints its counts (inputs tried, tracebacks, escapes) and figures; run with -s to see them.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import shutil
import socket
import struct
import subprocess
import sys
import tempfile
import time
import zlib
from collections.abc import Iterator
from pathlib import Path

import pytest

from dynprof.store import MANIFEST, ArtifactStore
from tests._ports import free_port
from tests.support.procs import terminate

ROOT = Path(__file__).resolve().parents[2]
SECRET = "dynprof-secret-" + hashlib.sha256(b"outside the store (integration)").hexdigest()[:16]
RSS_TARGET_MB = 200
BOMB_CAP = "64M"  # DYNPROF_MAX_TRACE_BYTES in these tests: the figures do not depend on it, the time does


# -- building a hostile store --------------------------------------------------------------------
def spaces_gzip(prefix: bytes, mib: int, suffix: bytes) -> bytes:
    """prefix + MIB MiB of spaces + suffix, gzipped by repeating one compressed block."""
    co = zlib.compressobj(9, zlib.DEFLATED, -15)
    head = co.compress(prefix) + co.flush(zlib.Z_SYNC_FLUSH)
    bco = zlib.compressobj(9, zlib.DEFLATED, -15)
    block = bco.compress(b" " * (1 << 20)) + bco.flush(zlib.Z_SYNC_FLUSH)
    tco = zlib.compressobj(9, zlib.DEFLATED, -15)
    tail = tco.compress(suffix) + tco.flush()
    crc = zlib.crc32(prefix)
    for _ in range(mib):
        crc = zlib.crc32(b" " * (1 << 20), crc)
    crc = zlib.crc32(suffix, crc)
    size = (len(prefix) + (mib << 20) + len(suffix)) & 0xFFFFFFFF
    return b"\x1f\x8b\x08\x00\x00\x00\x00\x00\x02\xff" + head + block * mib + tail + struct.pack("<II", crc, size)


def events_gzip(mib: int) -> bytes:
    """A trace of real-looking events, MIB MiB uncompressed (the bomb a parser must stream)."""
    event = b'{"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 1, "dur": 2},'
    co = zlib.compressobj(9, zlib.DEFLATED, 31)
    parts = [co.compress(b'{"traceEvents": [')]
    block = event * ((1 << 20) // len(event))
    for _ in range(mib):
        parts.append(co.compress(block))
    parts.append(co.compress(b'{"ph": "i"}]}'))
    parts.append(co.flush())
    return b"".join(parts)


BYTEARRAY_BOMB = (
    b"\x80\x04\x95\x00\x00\x00\x00\x00\x00\x00\x00\x8c\x08builtins\x8c\tbytearray\x93\x8a\x05\x00\x00\x00\x00\x02\x85R."
)
MEMO_BOMB = b"\x80\x04Nr" + struct.pack("<I", 1 << 26) + b"."
DICT_BOMB = b"\x80\x04](" + b"}" * (4 << 20) + b"e."  # 4 MiB, ~300 MB of empty dicts once loaded


def plant(store: ArtifactStore, kind: str, job: str, files: dict[str, bytes]) -> str:
    """An artifact whose manifest honestly lists the given (hostile) files."""
    w = store.create(kind, job=job)
    for name, data in files.items():
        w.write_bytes(name, data)
    return w.finish("complete").id


@pytest.fixture(scope="module")
def hostile() -> Iterator[dict[str, object]]:
    base = Path(tempfile.mkdtemp(prefix="dynprof-abuse-"))
    base.chmod(0o755)  # traversable by others, so only the store's own modes protect it
    outside = base / "outside"
    outside.mkdir()
    (outside / "secret.txt").write_text(SECRET + "\n")
    store = ArtifactStore(base / "store")
    ids: dict[str, str] = {}
    ids["good"] = plant(store, "healthcheck", "good", {"notes.txt": b"hello <world>"})
    ids["trace"] = plant(store, "trace", "t", {"trace.json.gz": gzip.compress(b'{"traceEvents": []}')})
    ids["gzip_bomb"] = plant(store, "trace", "bomb", {"trace.json.gz": spaces_gzip(b'{"traceEvents": [', 4096, b"]}")})
    ids["events_bomb"] = plant(store, "trace", "events", {"trace.json.gz": events_gzip(128)})
    ids["bytearray_bomb"] = plant(store, "memory", "pbomb", {"snapshot.pickle": BYTEARRAY_BOMB})
    ids["memo_bomb"] = plant(store, "memory", "mbomb", {"snapshot.pickle": MEMO_BOMB})
    ids["dict_bomb"] = plant(store, "memory", "dbomb", {"snapshot.pickle": DICT_BOMB})
    # a listed file replaced by a link to the secret, the manifest claiming the secret's checksum
    ids["file_link"] = plant(store, "healthcheck", "link", {"notes.txt": b"x"})
    art = store.root / ids["file_link"]
    (art / "notes.txt").unlink()
    (art / "notes.txt").symlink_to(outside / "secret.txt")
    m = json.loads((art / MANIFEST).read_text())
    data = (outside / "secret.txt").read_bytes()
    m["files"] = [{"name": "notes.txt", "size": len(data), "sha256": hashlib.sha256(data).hexdigest()}]
    (art / MANIFEST).write_text(json.dumps(m))
    # stacks whose merged.json points outside
    ids["stacks_escape"] = plant(
        store,
        "stacks",
        "escape",
        {"merged.json": json.dumps({"processes": [{"file": str(outside / "secret")}]}).encode()},
    )
    (outside / "secret.json").write_text(json.dumps({"pid": 1, "method": "x", "notes": [SECRET]}))
    # an artifact directory that is a link to a directory outside, with a valid-looking manifest
    (outside / MANIFEST).write_text(
        json.dumps(
            {
                "schema": "dynprof.artifact",
                "kind": "healthcheck",
                "status": "complete",
                "created_at": "x",
                "files": [{"name": "secret.txt", "size": len(data), "sha256": hashlib.sha256(data).hexdigest()}],
            }
        )
    )
    kind_dir = store.root / ids["good"].rsplit("/", 1)[0]
    (kind_dir / "outside-link").symlink_to(outside)
    ids["dir_link"] = f"{ids['good'].rsplit('/', 1)[0]}/outside-link"
    # damaged manifests
    for name, content in {
        "array": b"[]",
        "deep": b"[" * 200_000,
        "ill-typed": json.dumps({"schema": "dynprof.artifact", "kind": 1, "files": "x"}).encode(),
    }.items():
        d = kind_dir / name
        d.mkdir()
        (d / MANIFEST).write_bytes(content)
    (kind_dir / "manifest-dir").mkdir()
    (kind_dir / "manifest-dir" / MANIFEST).mkdir()
    token = "tok-" + hashlib.sha256(os.urandom(16)).hexdigest()[:28]
    token_file = base / "token"
    token_file.write_text(token + "\n")
    token_file.chmod(0o600)
    try:
        yield {"base": base, "store": store, "ids": ids, "token": token, "token_file": token_file}
    finally:
        shutil.rmtree(base, ignore_errors=True)


class Server:
    def __init__(self, proc: subprocess.Popen[bytes], port: int, stderr: Path) -> None:
        self.proc, self.port, self.stderr_path = proc, port, stderr

    def stderr(self) -> str:
        return self.stderr_path.read_text(errors="replace")

    def peak_rss_mb(self) -> float:
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
        return -1.0

    def raw(self, request: bytes, timeout: float = 60.0) -> tuple[int, bytes]:
        with socket.create_connection(("127.0.0.1", self.port), timeout=timeout) as s:
            try:
                s.sendall(request)
            except OSError:  # the server answered and closed before reading it all
                pass
            chunks = []
            while True:
                try:
                    b = s.recv(65536)
                except (ConnectionResetError, TimeoutError):
                    break
                if not b:
                    break
                chunks.append(b)
        data = b"".join(chunks)
        try:
            status = int(data.split(b" ", 2)[1])
        except (IndexError, ValueError):
            status = 0
        return status, data

    def get(
        self, path: str, headers: dict[str, str] | None = None, method: str = "GET", body: bytes = b""
    ) -> tuple[int, bytes]:
        hdrs = {"Host": f"127.0.0.1:{self.port}", "Connection": "close", **(headers or {})}
        if body:
            hdrs["Content-Length"] = str(len(body))
        head = f"{method} {path} HTTP/1.1\r\n" + "".join(f"{k}: {v}\r\n" for k, v in hdrs.items()) + "\r\n"
        return self.raw(head.encode("latin-1") + body)


@pytest.fixture(scope="module")
def server(hostile: dict[str, object]) -> Iterator[Server]:
    port = free_port()
    base = hostile["base"]
    assert isinstance(base, Path)
    env = {
        **os.environ,
        "DYNPROF_ARTIFACT_DIR": str(hostile["store"].root),  # type: ignore[attr-defined]
        "DYNPROF_TOKEN_FILE": str(hostile["token_file"]),
        "DYNPROF_MAX_TRACE_BYTES": BOMB_CAP,
        "DYNPROF_RUN_DIR": str(base / "run"),
        "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
    }
    stderr = base / "serve.stderr"
    with open(stderr, "wb") as err:
        proc = subprocess.Popen(
            [sys.executable, "-m", "dynprof", "serve", "--port", str(port)],
            stdout=subprocess.DEVNULL,
            stderr=err,
            env=env,
            cwd=str(ROOT),
        )
    srv = Server(proc, port, stderr)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            if proc.poll() is not None:
                raise AssertionError(f"serve exited: {srv.stderr()}") from None
            time.sleep(0.1)
    # it listens from its bind on, and says where it serves just after: wait for that line too
    while "dynprof: serving on" not in srv.stderr() and time.monotonic() < deadline:
        assert proc.poll() is None, f"serve exited: {srv.stderr()}"
        time.sleep(0.1)
    try:
        yield srv
    finally:
        terminate(proc)


def test_serve_prints_a_url_carrying_the_token(server, hostile):
    assert f"?token={hostile['token']}" in server.stderr()
    assert f"token from {hostile['token_file']}" in server.stderr()


def test_http_probes(server, hostile):
    token = hostile["token"]
    ids = hostile["ids"]
    auth = {"Authorization": f"Bearer {token}"}
    tried = tracebacks = escapes = 0
    failures: list[str] = []

    def probe(
        path: str,
        expect: set[int],
        headers: dict[str, str] | None = None,
        method: str = "GET",
        body: bytes = b"",
        raw: bytes | None = None,
    ) -> None:
        nonlocal tried, tracebacks, escapes
        tried += 1
        status, data = server.raw(raw) if raw is not None else server.get(path, headers, method, body)
        if SECRET.encode() in data:
            escapes += 1
            failures.append(f"ESCAPE {method} {path[:80]} -> {status}")
        if (status >= 500 and status not in expect) or b"Traceback" in data:  # 505 for HTTP/9.9 is an answer
            tracebacks += 1
        if status not in expect:
            failures.append(f"{method} {path[:80]} {headers or ''} -> {status}, expected {sorted(expect)}")

    good, good_file = ids["good"], f"/api/artifacts/{ids['good']}/files/notes.txt"
    pages = ["/", "/api/agents", "/api/artifacts", f"/api/artifacts/{good}", f"/artifact/{good}", good_file]
    # tokens: missing, wrong, wrong length, empty, in every place
    for path in pages:
        probe(path, {401})
        for wrong in ("x", token[:-1] + "x", token + "x", "", "é" * 10, token.upper()):
            probe(path, {401}, {"Authorization": f"Bearer {wrong}"})
            # raw non-ASCII bytes in the request target: the HTTP server refuses the line itself
            probe(path + ("&" if "?" in path else "?") + f"token={wrong}", {401} if wrong.isascii() else {400, 401})
            probe(path, {401}, {"Cookie": f"dynprof_token={wrong}"})
        probe(path, {401}, {"Authorization": f"Basic {token}"})
        probe(path, {200}, auth)
        probe(path + f"?token={token}", {200})
        probe(path, {200}, {"Cookie": f"dynprof_token={token}"})
    # Host header (DNS rebinding) and cross-site requests, with the token
    for host in ("evil.example", f"evil.example:{server.port}", "127.0.0.1.nip.io", "localhost.evil", "", "a" * 300):
        for path in pages:
            probe(path, {400}, {**auth, "Host": host})
    for host in ("localhost", f"localhost:{server.port}", "127.0.0.1", "[::1]"):
        probe("/api/artifacts", {200}, {**auth, "Host": host})
    for origin in ("http://evil.example", "null", f"http://evil.example:{server.port}", "http://127.0.0.1.evil"):
        probe("/api/artifacts", {403}, {**auth, "Origin": origin})
    probe("/api/artifacts", {403}, {**auth, "Sec-Fetch-Site": "cross-site"})
    probe("/api/artifacts", {200}, {**auth, "Origin": f"http://127.0.0.1:{server.port}"})
    # methods: read-only API
    for method in ("POST", "PUT", "DELETE", "PATCH", "TRACE", "PROPFIND", "CONNECT"):
        for path in pages:
            probe(path, {405, 400}, auth, method=method)
            probe(path, {401, 405, 400}, None, method=method)
    probe("/api/artifacts", {200, 204}, auth, method="OPTIONS")
    probe("/api/artifacts", {401}, None, method="OPTIONS")
    # traversal, odd ids and names
    secret_abs = str(Path(str(hostile["base"])) / "outside" / "secret.txt")
    for bad in (
        "/api/artifacts/../../outside/secret.txt",
        "/api/artifacts/..%2f..%2f..%2foutside",
        "/api/artifacts/%2e%2e/%2e%2e/%2e%2e/%2e%2e/outside",
        f"/api/artifacts/{secret_abs}",
        f"/api/artifacts/%2F{secret_abs.lstrip('/')}",
        f"/api/artifacts//{secret_abs.lstrip('/')}",
        f"/api/artifacts/{good}/files/..%2f..%2f..%2f..%2f..%2f..%2foutside%2fsecret.txt",
        f"/api/artifacts/{good}/files/%2e%2e",
        f"/api/artifacts/{good}/files/manifest.json",
        f"/api/artifacts/{good}/files/notes.txt%00",
        f"/api/artifacts/{good}%00/files/notes.txt",
        f"/artifact/{good}/../../../../outside",
        "/api/artifacts/" + "x" * 5000,
        "/api/artifacts/" + "a/" * 2000,
        "/api/artifacts/" + "%ff%fe" * 50,
        f"/api/artifacts/{ids['dir_link']}",
        f"/api/artifacts/{ids['dir_link']}/files/secret.txt",
        f"/artifact/{ids['dir_link']}",
        f"/api/artifacts/{ids['file_link']}/files/notes.txt",
        "/api/artifacts/good\\..\\..\\outside",
        "/static/../../outside/secret.txt",
    ):
        probe(bad, {404, 400, 308, 414}, auth)
    # links and escapes inside pages that do render
    for page in (
        f"/artifact/{ids['file_link']}",
        f"/artifact/{ids['stacks_escape']}",
        f"/api/artifacts/{ids['stacks_escape']}",
    ):
        probe(page, {200}, auth)
    # damaged artifacts: the index still answers, the damaged ones are 404
    for name in ("array", "deep", "ill-typed", "manifest-dir"):
        probe(f"/api/artifacts/{good.rsplit('/', 1)[0]}/{name}", {404}, auth)
    # sizes: long header, long URL, many headers, a body
    probe("/api/artifacts", {400, 431, 413, 200}, {**auth, "X-Pad": "a" * 100_000})
    probe("/api/artifacts?x=" + "a" * 100_000, {414, 400, 200}, auth)
    probe("/api/artifacts", {400, 431, 200}, {**auth, **{f"X-H{i}": "v" for i in range(300)}})
    probe("/api/artifacts", {413, 405, 400}, auth, method="POST", body=b"x" * (256 << 10))
    probe("", {400, 0}, raw=b"GARBAGE\r\n\r\n")
    probe("", {400, 0, 505}, raw=b"GET / HTTP/9.9\r\nHost: 127.0.0.1\r\n\r\n")
    probe("", {400, 0}, raw=b"\x00\xff" * 100 + b"\r\n\r\n")
    # the server still answers afterwards
    probe("/api/artifacts", {200}, auth)
    stderr_tracebacks = server.stderr().count("Traceback")
    print(
        f"\nHTTP probes: {tried} requests, {tracebacks} responses 5xx/traceback, {stderr_tracebacks} tracebacks "
        f"in the server's stderr, {escapes} escapes"
    )
    assert failures == []
    assert tracebacks == 0 and stderr_tracebacks == 0 and escapes == 0
    assert hostile["token"] not in server.stderr().split("serving on", 1)[1].split("\n", 1)[1]  # not in the request log


def test_index_lists_damaged_artifacts_apart(server, hostile):
    status, data = server.get("/api/artifacts", {"Authorization": f"Bearer {hostile['token']}"})
    assert status == 200
    body = json.loads(data.split(b"\r\n\r\n", 1)[1])
    assert {a["id"] for a in body["artifacts"]} >= {hostile["ids"]["good"], hostile["ids"]["trace"]}
    assert {b["id"].rsplit("/", 1)[1] for b in body["bad"]} >= {"array", "deep", "ill-typed", "manifest-dir"}
    assert hostile["ids"]["dir_link"] in {b["id"] for b in body["bad"]}


SYSTEM_PYTHON = "/usr/bin/python3"  # the venv's interpreter may not be executable by nobody


def runuser_works() -> bool:
    if os.geteuid() != 0 or shutil.which("runuser") is None or not os.path.exists(SYSTEM_PYTHON):
        return False
    probe = ["runuser", "-u", "nobody", "--", SYSTEM_PYTHON, "-c", "pass"]
    return subprocess.run(probe, capture_output=True).returncode == 0


def test_another_user_gets_nothing(server, hostile):
    if not runuser_works():
        pytest.skip("needs root, runuser and a system python3 that uid nobody may run")
    # GIVEN another local user, who can reach loopback
    store_root = Path(hostile["store"].root)  # type: ignore[attr-defined]
    art = store_root / hostile["ids"]["good"]
    code = (
        "import sys, urllib.request, urllib.error\n"
        "try:\n"
        "    urllib.request.urlopen(sys.argv[1], timeout=10)\n"
        "    print(200)\n"
        "except urllib.error.HTTPError as e:\n"
        "    print(e.code)\n"
    )
    tried = 0
    for path in ("/", "/api/agents", "/api/artifacts", f"/api/artifacts/{hostile['ids']['good']}/files/notes.txt"):
        # WHEN it asks the sidecar without the token
        r = subprocess.run(
            ["runuser", "-u", "nobody", "--", SYSTEM_PYTHON, "-I", "-c", code, f"http://127.0.0.1:{server.port}{path}"],
            capture_output=True,
            text=True,
            timeout=60,
        )
        tried += 1
        # THEN it is refused
        assert r.stdout.strip() == "401", (path, r.stdout, r.stderr)
    # AND it can read neither the store's files nor the token file
    for target in (art / "notes.txt", art / MANIFEST, hostile["token_file"]):
        r = subprocess.run(["runuser", "-u", "nobody", "--", "cat", str(target)], capture_output=True, timeout=30)
        tried += 1
        assert r.returncode != 0 and b"hello" not in r.stdout, target
    for target in (store_root, art):
        r = subprocess.run(["runuser", "-u", "nobody", "--", "ls", str(target)], capture_output=True, timeout=30)
        tried += 1
        assert r.returncode != 0, target
    print(f"\nother uid (nobody): {tried} attempts, all refused")


# A process's peak RSS counts what it inherited at fork (ru_maxrss survives exec), so the CLI is
# started by a small helper process, not by the (large) test process, and the helper reports it.
_MEASURE = """
import json, os, subprocess, sys
with open(sys.argv[1], "wb") as out:
    proc = subprocess.Popen(sys.argv[2:], stdout=out, stderr=subprocess.STDOUT)
    _, status, usage = os.wait4(proc.pid, 0)
print(json.dumps({"code": os.waitstatus_to_exitcode(status), "maxrss_kib": usage.ru_maxrss}))
"""


def run_measured(args: list[str], env: dict[str, str], timeout: float = 240) -> tuple[int, str, float, float]:
    """Run the CLI; return (exit code, stdout + stderr, peak RSS MB of that process, seconds)."""
    t0 = time.monotonic()
    with tempfile.NamedTemporaryFile() as output:
        helper = subprocess.run(
            [sys.executable, "-I", "-c", _MEASURE, output.name, sys.executable, "-m", "dynprof", *args],
            capture_output=True,
            text=True,
            env=env,
            cwd=str(ROOT),
            timeout=timeout,
        )
        text = Path(output.name).read_text(errors="replace")
    result = json.loads(helper.stdout)
    return int(result["code"]), text, result["maxrss_kib"] / 1024, time.monotonic() - t0


def test_bombs_stay_under_the_memory_target(server, hostile):
    store_root = str(hostile["store"].root)  # type: ignore[attr-defined]
    env = {
        **os.environ,
        "DYNPROF_ARTIFACT_DIR": store_root,
        "DYNPROF_MAX_TRACE_BYTES": BOMB_CAP,
        "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
    }
    ids = hostile["ids"]
    figures = []
    cases = [
        ("show", ids["gzip_bomb"], ["show", ids["gzip_bomb"]], "inflates to more than"),
        ("show", ids["events_bomb"], ["show", ids["events_bomb"]], "inflates to more than"),
        ("show", ids["bytearray_bomb"], ["show", ids["bytearray_bomb"]], "bytearray"),
        ("show", ids["memo_bomb"], ["show", ids["memo_bomb"]], "not a PyTorch memory snapshot"),
        ("memory-report", ids["bytearray_bomb"], ["memory-report", ids["bytearray_bomb"], "--no-html"], "bytearray"),
        (
            "memory-report",
            ids["memo_bomb"],
            ["memory-report", ids["memo_bomb"], "--no-html"],
            "not a PyTorch memory snapshot",
        ),
        ("show", ids["dict_bomb"], ["show", ids["dict_bomb"]], "needs more than"),
        ("memory-report", ids["dict_bomb"], ["memory-report", ids["dict_bomb"], "--no-html"], "needs more than"),
    ]
    for what, art_id, args, message in cases:
        code, out, rss, secs = run_measured(args, env)
        figures.append(f"{what} {art_id.split('/')[0]}: exit {code}, peak RSS {rss:.0f} MB, {secs:.1f} s")
        assert "Traceback" not in out, out
        # show prints the manifest and "cannot summarise: <reason>"; memory-report fails with it
        assert message in out and code == (1 if what == "memory-report" else 0), out[-500:]
        assert rss < RSS_TARGET_MB, figures[-1]
    # the server, one request per bomb
    auth = {"Authorization": f"Bearer {hostile['token']}"}
    before = server.peak_rss_mb()
    for key in ("gzip_bomb", "events_bomb", "bytearray_bomb", "memo_bomb", "dict_bomb"):
        t0 = time.monotonic()
        status, data = server.get(f"/api/artifacts/{ids[key]}", auth)
        assert status == 200, data[:300]
        assert b"cannot summarise" in data or b'"error"' in data
        figures.append(f"serve {key}: {status} in {time.monotonic() - t0:.1f} s")
    after = server.peak_rss_mb()
    figures.append(f"serve peak RSS (VmHWM) before the bombs {before:.0f} MB, after {after:.0f} MB")
    print("\n" + "\n".join(figures))
    assert after < RSS_TARGET_MB
    assert "Traceback" not in server.stderr()
