"""Attack a real `dynprof serve` as a hostile client would, on loopback, and print a table.

    python scripts/hostile_sidecar.py [--threads 8] [--drip 5] [--probe-timeout 30]

Starts `dynprof serve` (the dynprof that PYTHONPATH names, so the same script measures an older
checkout: PYTHONPATH=/path/to/other/checkout python scripts/hostile_sidecar.py) on a free
loopback port with a private token file, private run and artifact directories, then for each
attack: starts it, asks `GET /healthz` (no token) and `GET /api/v1/info` (token) while it runs,
and reports whether they answered and after how long (up to --probe-timeout seconds). At the
end: tracebacks in the server's stderr (target 0) and the server's peak RSS (psutil, sampled
every 50 ms; target < 200 MB). Figures are one run's, on a loaded machine they vary.

Attacks (none carries the token unless said):
  slowloris         --threads connections, each sending its request head one byte every --drip s
  slowloris x4      four times as many
  idle              4 x --threads connections that send nothing
  drip body         --threads POSTs with a whole head, then a body one byte every --drip s
  bad length        Content-Length values that are not a length (each on its own connection)
  slow reader       (token) --threads downloads of a 16 MiB artifact file, read 1 KiB every 2 s
"""

from __future__ import annotations

import argparse
import hashlib
import http.client
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
TOKEN = "hostile-sidecar-token-" + hashlib.sha256(b"hostile").hexdigest()[:16]
BAD_LENGTHS = ("abc", "-1", "-99999", "99999999999999999999999999", "1, 2", "+5", "0x10", "5 5", "١٢")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Server:
    """A `dynprof serve` subprocess on loopback with a private token file and directories."""

    def __init__(self, threads: int = 8, args: tuple[str, ...] = (), env: dict[str, str] | None = None) -> None:
        self.base = Path(tempfile.mkdtemp(prefix="dynprof-hostile-"))
        self.token_file = self.base / "token"
        self.token_file.write_text(TOKEN + "\n")
        self.token_file.chmod(0o600)
        self.stderr_path = self.base / "serve.stderr"
        self.port = free_port()
        self.threads = threads
        self.env = {
            **os.environ,
            "DYNPROF_RUN_DIR": str(self.base / "run"),
            "DYNPROF_ARTIFACT_DIR": str(self.base / "artifacts"),
            **(env or {}),
        }
        self.env.pop("DYNPROF_TOKEN_FILE", None)
        self.args = args
        self.proc: subprocess.Popen[bytes] | None = None
        self.peak_rss = 0
        self._sampling = threading.Event()

    def start(self, timeout: float = 60) -> Server:
        (self.base / "run").mkdir(mode=0o700)
        with open(self.stderr_path, "wb") as err:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "dynprof", "serve", "--port", str(self.port), "--token-file",
                 str(self.token_file), "--threads", str(self.threads), *self.args],
                stdout=subprocess.DEVNULL, stderr=err, env=self.env,
            )  # fmt: skip
        deadline = time.monotonic() + timeout
        while healthz(self.port, 2) is None:
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"dynprof serve did not answer: {self.stderr()}")
            time.sleep(0.1)
        threading.Thread(target=self._sample_rss, daemon=True).start()
        return self

    def _sample_rss(self) -> None:
        import psutil

        assert self.proc is not None
        p = psutil.Process(self.proc.pid)
        while not self._sampling.is_set():
            try:
                self.peak_rss = max(self.peak_rss, p.memory_info().rss)
            except psutil.Error:
                return
            time.sleep(0.05)

    def stderr(self) -> str:
        return self.stderr_path.read_text(errors="replace")

    def tracebacks(self) -> int:
        return self.stderr().count("Traceback (most recent call last)")

    def stop(self) -> None:
        self._sampling.set()
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)

    def __enter__(self) -> Server:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def request(
    port: int, method: str, path: str, body: bytes | None = None, headers: dict[str, str] | None = None,
    token: bool = True, timeout: float = 30,
) -> tuple[int, dict[str, str], bytes]:  # fmt: skip
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    hdrs = dict(headers or {})
    if token:
        hdrs.setdefault("Authorization", f"Bearer {TOKEN}")
    try:
        conn.request(method, path, body=body, headers=hdrs)
        resp = conn.getresponse()
        return resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read()
    finally:
        conn.close()


def healthz(port: int, timeout: float) -> float | None:
    """Seconds until `GET /healthz` answered "ok", None when it did not within ``timeout``."""
    t0 = time.monotonic()
    try:
        status, _, body = request(port, "GET", "/healthz", token=False, timeout=timeout)
    except OSError:
        return None
    return time.monotonic() - t0 if status == 200 and body == b"ok\n" else None


def info(port: int, timeout: float) -> float | None:
    """Seconds until `GET /api/v1/info` (with the token) answered 200, None otherwise."""
    t0 = time.monotonic()
    try:
        status = request(port, "GET", "/api/v1/info", timeout=timeout)[0]
    except OSError:
        return None
    return time.monotonic() - t0 if status == 200 else None


def raw(port: int, data: bytes, timeout: float = 30) -> bytes:
    """Send ``data`` on a fresh connection and read the answer until the server closes (or
    ``timeout``)."""
    got = b""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(data)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                chunk = s.recv(65536)
            except (TimeoutError, ConnectionError):
                break
            if not chunk:
                break
            got += chunk
            if b"\r\n\r\n" in got and b"Content-Length: " in got:
                head, _, rest = got.partition(b"\r\n\r\n")
                length = int(head.split(b"Content-Length: ", 1)[1].split(b"\r\n", 1)[0])
                if len(rest) >= length:
                    break
    return got


@contextmanager
def dripping(port: int, n: int, first: bytes, drip: float, keep: bytes = b"X") -> Iterator[dict[str, int]]:
    """``n`` connections, each sending ``first`` then one byte of ``keep`` every ``drip`` s,
    reconnecting when the server closes them, until the block ends."""
    stop = threading.Event()
    counts = {"connections": 0, "closed_by_server": 0}
    lock = threading.Lock()

    def one() -> None:
        while not stop.is_set():
            try:
                s = socket.create_connection(("127.0.0.1", port), timeout=5)
            except OSError:
                stop.wait(0.2)
                continue
            with lock:
                counts["connections"] += 1
            try:
                if first:
                    s.sendall(first)
                while not stop.wait(drip):
                    s.sendall(keep)
                    s.settimeout(0.01)
                    try:
                        if s.recv(65536) == b"":
                            raise ConnectionResetError
                    except TimeoutError:
                        pass
                    s.settimeout(5)
            except OSError:
                with lock:
                    counts["closed_by_server"] += 1
            finally:
                s.close()

    workers = [threading.Thread(target=one, daemon=True) for _ in range(n)]
    for w in workers:
        w.start()
    try:
        yield counts
    finally:
        stop.set()
        for w in workers:
            w.join(drip + 10)


@contextmanager
def idle(port: int, n: int) -> Iterator[dict[str, int]]:
    socks = []
    try:
        for _ in range(n):
            socks.append(socket.create_connection(("127.0.0.1", port), timeout=5))
        yield {"connections": len(socks)}
    finally:
        for s in socks:
            s.close()


@contextmanager
def slow_readers(port: int, n: int, path: str, every: float = 2.0) -> Iterator[dict[str, int]]:
    """``n`` token holders asking for a large file and reading 1 KiB of it every ``every`` s:
    never idle long enough for a send timeout, so each holds its server thread for as long as
    it likes."""
    socks: list[socket.socket] = []
    stop = threading.Event()

    def read_a_little() -> None:
        while not stop.wait(every):
            for s in socks:
                try:
                    s.recv(1024, socket.MSG_DONTWAIT)
                except OSError:
                    pass

    reader = threading.Thread(target=read_a_little, daemon=True)
    try:
        for _ in range(n):
            s = socket.socket()
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            s.settimeout(5)
            s.connect(("127.0.0.1", port))
            s.sendall(
                f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nAuthorization: Bearer {TOKEN}\r\n\r\n".encode()
            )
            socks.append(s)
        reader.start()
        yield {"connections": len(socks)}
    finally:
        stop.set()
        if reader.is_alive():
            reader.join(every + 5)
        for s in socks:
            s.close()


def probe(port: int, timeout: float) -> dict[str, tuple[int | None, float]]:
    """/healthz and /api/v1/info (with the token) asked at the same time, each given up to
    ``timeout`` s: name -> (HTTP status, None when no answer came; seconds)."""
    out: dict[str, tuple[int | None, float]] = {}

    def ask(name: str, path: str, token: bool) -> None:
        t0 = time.monotonic()
        try:
            status: int | None = request(port, "GET", path, token=token, timeout=timeout)[0]
        except OSError:
            status = None
        out[name] = (status, time.monotonic() - t0)

    ts = [
        threading.Thread(target=ask, args=("healthz", "/healthz", False)),
        threading.Thread(target=ask, args=("info", "/api/v1/info", True)),
    ]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    return out


def answered(got: tuple[int | None, float]) -> str:
    status, seconds = got
    if status is None:
        return "no"
    return f"yes {seconds * 1000:.0f} ms" if status == 200 else f"yes ({status}) {seconds * 1000:.0f} ms"


def bad_lengths(port: int) -> dict[str, str]:
    """The status line the server answers to each malformed Content-Length (or why none)."""
    out = {}
    for value in BAD_LENGTHS:
        data = (
            f"POST /api/v1/actions/ps HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nAuthorization: Bearer {TOKEN}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {value}\r\n\r\n{{}}"
        ).encode()
        try:
            answer = raw(port, data, timeout=40)
            out[value] = answer.split(b"\r\n", 1)[0].decode(errors="replace") or "(closed, no answer)"
        except OSError as exc:
            out[value] = f"({type(exc).__name__})"
    return out


def plant_big_file(server: Server, mib: int = 16) -> str:
    """A complete artifact holding a MIB MiB file in the server's store; its download path."""
    from dynprof.store import ArtifactStore

    store = ArtifactStore(Path(server.env["DYNPROF_ARTIFACT_DIR"]))
    w = store.create("healthcheck", job="big")
    w.write_bytes("big.bin", os.urandom(1 << 20) * mib)
    art_id = w.finish("complete").id
    return f"/api/v1/artifacts/{art_id}/files/big.bin"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=8)
    p.add_argument("--drip", type=float, default=5.0, help="seconds between two bytes of a dripping client")
    p.add_argument("--probe-timeout", type=float, default=30.0)
    p.add_argument("--settle", type=float, default=1.0, help="seconds an attack runs before the probes")
    args = p.parse_args(argv)
    rows: list[tuple[str, str, str, str]] = []

    with Server(args.threads) as server:
        head = f"GET / HTTP/1.1\r\nHost: 127.0.0.1:{server.port}\r\n".encode()
        body_head = (
            f"POST /api/v1/actions/ps HTTP/1.1\r\nHost: 127.0.0.1:{server.port}\r\n"
            f"Content-Type: application/json\r\nContent-Length: 4096\r\n\r\n"
        ).encode()
        big = plant_big_file(server)
        attacks: list[tuple[str, Callable[[], Any]]] = [
            (f"slowloris ({args.threads} conns)", lambda: dripping(server.port, args.threads, head, args.drip)),
            (f"slowloris ({4 * args.threads} conns)", lambda: dripping(server.port, 4 * args.threads, head, args.drip)),
            (f"idle ({4 * args.threads} conns)", lambda: idle(server.port, 4 * args.threads)),
            (f"drip body ({args.threads} conns)", lambda: dripping(server.port, args.threads, body_head, args.drip)),
            (f"slow reader, token ({args.threads} conns)", lambda: slow_readers(server.port, args.threads, big)),
        ]
        for name, attack in attacks:
            before = server.tracebacks()
            with attack():
                time.sleep(args.settle)
                got = probe(server.port, args.probe_timeout)
            rows.append((name, answered(got["healthz"]), answered(got["info"]), str(server.tracebacks() - before)))
            healthz(server.port, 60)  # let the server drain before the next attack
        before = server.tracebacks()
        answers = bad_lengths(server.port)
        got = probe(server.port, args.probe_timeout)
        rows.append((f"bad Content-Length ({len(answers)} values)", answered(got["healthz"]), answered(got["info"]),
                     str(server.tracebacks() - before)))  # fmt: skip
        time.sleep(0.2)
        tracebacks = server.tracebacks()
        peak = server.peak_rss
    widths = [max(len(r[i]) for r in [("attack", "/healthz", "/api/v1/info", "tracebacks"), *rows]) for i in range(4)]
    for r in [("attack", "/healthz", "/api/v1/info", "tracebacks"), *rows]:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)))
    print()
    for value, status in answers.items():
        print(f"Content-Length: {value!r:32} -> {status}")
    print()
    print(f"tracebacks in the server's stderr: {tracebacks} (target 0)")
    print(f"peak RSS of the server: {peak / 1e6:.1f} MB (target < 200 MB)")
    print(json.dumps({"tracebacks": tracebacks, "peak_rss_mb": round(peak / 1e6, 1), "rows": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
