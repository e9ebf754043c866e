"""The job-wide CLI against a hostile network, node and store, on loopback only.

Every case runs the real CLI (``python -m dynprof ...``) in a subprocess against fake
sidecars (small threaded HTTP servers here) or a real ``torch.distributed.TCPStore`` holding
forged registrations, and prints one table row:

- tracebacks in the CLI's output (target 0);
- the CLI's peak RSS (its ``VmHWM``, written at exit by the same ``sitecustomize`` and
  sampled while it runs: ``ru_maxrss`` of a child starts at its parent's size; target < 200 MB);
- elapsed time against the deadline the command was given;
- connection attempts and DNS look-ups outside the allow-list, logged by an audit hook
  (``sys.addaudithook`` on ``socket.connect`` and ``socket.getaddrinfo``) that a
  ``sitecustomize`` installs in the CLI (target 0);
- tokens that reached an address the operator did not allow (the fake sidecars record every
  ``Authorization`` header; target 0).

    python scripts/hostile_network.py                 # this checkout
    python scripts/hostile_network.py --root OTHER    # another checkout, for a before/after table
    python scripts/hostile_network.py --only drip,forged

Loopback only; each CLI run is killed after ``--limit`` seconds (default 60).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

TOKEN = "hostile-network-token-0123456789"
JOB = "hostile"

# -- the audit hook the CLI runs under ----------------------------------------------------------
SITECUSTOMIZE = r"""
import os, sys
_log = os.environ.get("HOSTILE_AUDIT_LOG")
if _log:
    _fh = open(_log, "a", buffering=1)
    def _hook(event, args):
        try:
            if event == "socket.connect":
                addr = args[1]
                if isinstance(addr, tuple):
                    _fh.write("connect %s %s\n" % (addr[0], addr[1]))
            elif event == "socket.getaddrinfo":
                _fh.write("getaddrinfo %s %s\n" % (args[0], args[1]))
        except Exception:
            pass
    sys.addaudithook(_hook)
    def _peak():
        try:
            with open("/proc/self/status") as f:
                for line in f:
                    if line.startswith("VmHWM:"):
                        _fh.write("hwm %s\n" % line.split()[1])
        except Exception:
            pass
    import atexit
    atexit.register(_peak)
"""


# -- fake sidecars --------------------------------------------------------------------------------
Behaviour = Callable[[BaseHTTPRequestHandler], None]


class FakeSidecar:
    """A threaded HTTP server on 127.0.0.1 that answers every request with ``behaviour`` and
    records the Authorization header of each."""

    def __init__(self, behaviour: Behaviour) -> None:
        self.auth: list[str] = []
        self.paths: list[str] = []
        owner = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:
                pass

            def _any(self) -> None:
                owner.auth.append(self.headers.get("Authorization", ""))
                owner.paths.append(self.path)
                length = int(self.headers.get("Content-Length") or 0)
                if length:
                    self.rfile.read(min(length, 1 << 20))
                try:
                    behaviour(self)
                except OSError:
                    pass  # the client went away: what a deadline does

            do_GET = do_POST = _any

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        self.address = f"127.0.0.1:{self.port}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def _json_reply(body: bytes, status: int = 200, headers: dict[str, str] | None = None) -> Behaviour:
    def reply(h: BaseHTTPRequestHandler) -> None:
        h.send_response(status)
        h.send_header("Content-Type", "application/json")
        h.send_header("Content-Length", str(len(body)))
        for k, v in (headers or {}).items():
            h.send_header(k, v)
        h.end_headers()
        h.wfile.write(body)

    return reply


def envelope(result: Any, **extra: Any) -> bytes:
    doc = {"api": 1, "action": "ps", "host": "fake", "dynprof_version": "0", "exit_code": 0}
    doc.update(result=result, messages=[], elapsed_s=0.01)
    doc.update(extra)
    return json.dumps(doc).encode()


def item_bomb(key: str, size: int) -> bytes:
    head = b'{"api": 1, "action": "x", "host": "fake", "exit_code": 0, "messages": [], "result": {"' + key.encode()
    head += b'": ['
    n = max(1, (size - len(head) - 4) // 3)
    return head + b"{}," * (n - 1) + b"{}]}}"


def wide_rows(key: str, size: int) -> bytes:
    """Rows of a plausible shape, each with one long text field: few values, many bytes."""
    row = {"pid": 1, "rank": 0, "job_id": "j", "cmdline": "x" * 1500}
    n = size // (len(json.dumps(row)) + 2)
    return envelope({key: [row] * n})


def drip_body(h: BaseHTTPRequestHandler) -> None:
    h.send_response(200)
    h.send_header("Content-Type", "application/json")
    h.send_header("Content-Length", "100000")
    h.end_headers()
    end = time.monotonic() + 300
    while time.monotonic() < end:
        h.wfile.write(b" ")
        h.wfile.flush()
        time.sleep(0.5)


def drip_headers(h: BaseHTTPRequestHandler) -> None:
    h.wfile.write(b"HTTP/1.1 200 OK\r\n")
    end = time.monotonic() + 300
    while time.monotonic() < end:
        h.wfile.write(b"X")
        h.wfile.flush()
        time.sleep(0.5)


def byte_bomb(h: BaseHTTPRequestHandler) -> None:
    h.send_response(200)
    h.send_header("Content-Type", "application/json")
    h.send_header("Transfer-Encoding", "chunked")
    h.end_headers()
    chunk = b" " * 65536
    line = f"{len(chunk):x}\r\n".encode() + chunk + b"\r\n"
    for _ in range(40_000):  # at most 2.6 GB, until the client goes
        h.wfile.write(line)


def silent(h: BaseHTTPRequestHandler) -> None:
    time.sleep(120)


def _hwm_kb(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    except (OSError, ValueError):
        pass
    return 0


@dataclass
class Run:
    exit_code: int | None
    stdout: str
    stderr: str
    elapsed_s: float
    peak_rss_mb: float
    connects: list[tuple[str, str]]
    lookups: list[str]
    killed: bool


MAX_AS_MB = 4096  # the CLI's address space is capped here, so a bomb cannot take the machine


def _cap_memory() -> None:
    import resource

    resource.setrlimit(resource.RLIMIT_AS, (MAX_AS_MB << 20, MAX_AS_MB << 20))


def run_cli(root: Path, args: list[str], env: dict[str, str], limit: float, workdir: Path) -> Run:
    """``python -m dynprof ARGS`` of ``root`` under the audit hook (and an address-space cap of
    ``MAX_AS_MB``); its own peak RSS."""
    site = workdir / "site"
    site.mkdir(exist_ok=True)
    (site / "sitecustomize.py").write_text(SITECUSTOMIZE)
    log = workdir / f"audit-{time.monotonic_ns()}.log"
    full = dict(os.environ)
    full.update(env)
    full["PYTHONPATH"] = f"{site}{os.pathsep}{root}"
    full["HOSTILE_AUDIT_LOG"] = str(log)
    out, err = workdir / "out", workdir / "err"
    started = time.monotonic()
    with open(out, "wb") as o, open(err, "wb") as e:
        proc = subprocess.Popen(
            [sys.executable, "-m", "dynprof", *args],
            stdout=o,
            stderr=e,
            stdin=subprocess.DEVNULL,
            env=full,
            cwd=str(root),
            start_new_session=True,
            preexec_fn=_cap_memory,
        )
        killed = False
        hwm_kb = 0
        while True:
            pid, status, _ = os.wait4(proc.pid, os.WNOHANG)
            if pid:
                break
            hwm_kb = max(hwm_kb, _hwm_kb(proc.pid))
            if time.monotonic() - started > limit:
                os.killpg(proc.pid, signal.SIGKILL)
                killed = True
                pid, status, _ = os.wait4(proc.pid, 0)
                break
            time.sleep(0.02)
        proc.returncode = os.waitstatus_to_exitcode(status)
    elapsed = time.monotonic() - started
    connects: list[tuple[str, str]] = []
    lookups: list[str] = []
    if log.exists():
        for line in log.read_text(errors="replace").splitlines():
            parts = line.split(" ")
            if parts[0] == "connect" and len(parts) >= 3:
                connects.append((parts[1], parts[2]))
            elif parts[0] == "getaddrinfo" and len(parts) >= 2:
                lookups.append(parts[1])
            elif parts[0] == "hwm" and len(parts) >= 2:
                hwm_kb = max(hwm_kb, int(parts[1]))
        log.unlink()
    return Run(
        None if killed else proc.returncode,
        out.read_text(errors="replace"),
        err.read_text(errors="replace"),
        elapsed,
        hwm_kb / 1024,
        connects,
        lookups,
        killed,
    )


# -- the cases --------------------------------------------------------------------------------
@dataclass
class Case:
    name: str
    inputs: int = 1
    runs: list[Run] = field(default_factory=list)
    deadline_s: float | None = None
    allowed: set[tuple[str, str]] = field(default_factory=set)
    allowed_names: set[str] = field(default_factory=set)
    tokens_unverified: int = 0
    agent_growth_mb: float = 0.0  # what reading the store cost the rank's agent (peak RSS)
    note: str = ""

    @property
    def tracebacks(self) -> int:
        return sum("Traceback" in r.stderr or "Traceback" in r.stdout for r in self.runs)

    @property
    def peak_rss_mb(self) -> float:
        return max((r.peak_rss_mb for r in self.runs), default=0.0)

    @property
    def elapsed_s(self) -> float:
        return max((r.elapsed_s for r in self.runs), default=0.0)

    @property
    def outside(self) -> int:
        n = 0
        for r in self.runs:
            n += sum(1 for c in r.connects if c not in self.allowed)
            n += sum(1 for h in r.lookups if h not in self.allowed_names and h not in {a for a, _ in self.allowed})
        return n


class Harness:
    def __init__(self, root: Path, limit: float) -> None:
        self.root = root
        self.limit = limit
        self.work = Path(tempfile.mkdtemp(prefix="hostile-"))
        self.token_file = self.work / "token"
        self.token_file.write_text(TOKEN + "\n")
        self.token_file.chmod(0o600)
        self.run_dir = Path(tempfile.mkdtemp(prefix="hn-", dir="/tmp"))
        self.env = {
            "DYNPROF_TOKEN_FILE": str(self.token_file),
            "DYNPROF_RUN_DIR": str(self.run_dir),
            "DYNPROF_ARTIFACT_DIR": str(self.work / "store"),
        }
        self.servers: list[FakeSidecar] = []

    def fake(self, behaviour: Behaviour) -> FakeSidecar:
        s = FakeSidecar(behaviour)
        self.servers.append(s)
        return s

    def cli(self, args: list[str], env: dict[str, str] | None = None) -> Run:
        return run_cli(self.root, args, {**self.env, **(env or {})}, self.limit, self.work)

    def discover(self, args: list[str], real: FakeSidecar) -> tuple[Run, str]:
        """``args --allow-hosts REAL``; a CLI without that option runs ``args`` alone."""
        run = self.cli([*args, "--allow-hosts", real.address])
        if "unrecognized arguments: --allow-hosts" in run.stderr:
            return self.cli(args), "(no --allow-hosts) "
        return run, ""

    def close(self) -> None:
        for s in self.servers:
            s.close()
        import shutil

        shutil.rmtree(self.work, ignore_errors=True)
        shutil.rmtree(self.run_dir, ignore_errors=True)


def _allowed(*servers: FakeSidecar) -> set[tuple[str, str]]:
    return {("127.0.0.1", str(s.port)) for s in servers}


def case_fake(h: Harness, name: str, behaviour: Behaviour, command: str = "ps", timeout: float = 3.0) -> Case:
    s = h.fake(behaviour)
    case = Case(name, deadline_s=timeout, allowed=_allowed(s))
    run = h.cli([command, "--job", JOB, "--hosts", s.address, "--json", "--node-timeout", str(timeout)])
    case.runs.append(run)
    case.note = _note(run)
    return case


def case_redirect(h: Harness) -> Case:
    target = h.fake(_json_reply(envelope({"agents": []})))
    where = f"http://{target.address}/api/v1/actions/ps"
    s = h.fake(_json_reply(b"{}", 307, {"Location": where}))
    case = Case("redirect (307 to another port)", allowed=_allowed(s))
    run = h.cli(["ps", "--job", JOB, "--hosts", s.address, "--json", "--node-timeout", "3"])
    case.runs.append(run)
    case.tokens_unverified = len(target.auth)
    case.note = _note(run)
    return case


def case_names(h: Harness) -> Case:
    """Node names and ports that crashed or misled the CLI: --hosts, --hostfile."""
    s = h.fake(_json_reply(envelope({"agents": []})))
    bad = [
        "127.0.0.1\x01:80",
        "a\x7fb",
        "127.0.0.1:²",
        "127.0.0.1:\uff18\uff10",
        "127.0.0.1:\u0668\u0660",
        "[evil.example]:80",
        "a:b:c",
    ]
    case = Case("node names: control chars, non-ASCII ports", inputs=len(bad) * 2, allowed=_allowed(s))
    for text in bad:
        case.runs.append(h.cli(["ps", "--job", JOB, "--hosts", text, "--json", "--node-timeout", "2"]))
        hostfile = h.work / "hosts"
        hostfile.write_text(text + "\n")
        case.runs.append(h.cli(["ps", "--job", JOB, "--hostfile", str(hostfile), "--json", "--node-timeout", "2"]))
    codes = sorted({str(r.exit_code) for r in case.runs})
    case.note = f"exit codes {','.join(codes)}; " + _note(case.runs[0])
    return case


def _note(run: Run) -> str:
    if run.killed:
        return "killed at the time limit"
    if "MemoryError" in run.stderr:
        return f"exit {run.exit_code}: MemoryError at the {MAX_AS_MB} MiB address-space cap"
    lines = [ln for ln in run.stderr.splitlines() if ln.strip()]
    if any("Traceback" in ln for ln in lines):
        last = lines[-1] if lines else ""
        return f"exit {run.exit_code}: traceback: {last[:90]}"
    return f"exit {run.exit_code}: " + (lines[0][:110] if lines else "")


# -- forged registrations in a real TCPStore ------------------------------------------------------
class OneRankJob:
    """A 1-rank gloo job with the dynprof agent, whose TCPStore this harness writes into. The
    store is served by a process of its own, as torchrun's agent serves it, so that the rank's
    memory shows what reading the store costs its agent (the store's server copies a value
    into its answer)."""

    def __init__(self, h: Harness, sidecar: str) -> None:
        self.h = h
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.master_port = s.getsockname()[1]
        code = (
            "import time, torch.distributed as d; "
            f"s = d.TCPStore('127.0.0.1', {self.master_port}, is_master=True, wait_for_workers=False); "
            "print('READY', flush=True); time.sleep(3600)"
        )
        self.server = subprocess.Popen(
            [sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, start_new_session=True
        )
        assert self.server.stdout is not None
        self.server.stdout.readline()
        env = dict(os.environ)
        env.update(h.env)
        env.update(
            RANK="0",
            WORLD_SIZE="1",
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(self.master_port),
            TORCHELASTIC_USE_AGENT_STORE="True",
            DYNPROF_JOB_ID=JOB,
            DYNPROF_SIDECAR=sidecar,
            PYTHONPATH=str(h.root),
            PYTHONUNBUFFERED="1",
        )
        train = h.root / "tests/integration/programs/train_program.py"
        cmd = [sys.executable, "-m", "dynprof", "run", "-q", "--", sys.executable, str(train), "--dist"]
        cmd += ["--step-sleep", "0.05"]
        self.log = h.work / "job.log"
        self.proc = subprocess.Popen(
            cmd,
            env=env,
            cwd=str(h.root),
            stdout=open(self.log, "wb"),
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        from datetime import timedelta

        import torch.distributed as dist

        deadline = time.monotonic() + 120
        while True:
            try:
                self.store = dist.TCPStore("127.0.0.1", self.master_port, is_master=False, timeout=timedelta(seconds=5))
                prefix = dist.PrefixStore("dynprof", self.store)
                if prefix.check(["ranks"]):
                    break
            except Exception:
                pass
            if time.monotonic() > deadline or self.proc.poll() is not None:
                raise RuntimeError("the 1-rank job did not register: " + self.log.read_text()[-2000:])
            time.sleep(0.3)
        self.prefix = prefix
        self.pid = self._rank_pid()

    def _rank_pid(self) -> int:
        out = run_cli(self.h.root, ["ps", "--job", JOB, "--json"], self.h.env, 60, self.h.work)
        agents = json.loads(out.stdout or "{}").get("agents", [])
        return int(agents[0]["pid"]) if agents else 0

    def hwm_kb(self) -> int:
        return _hwm_kb(self.pid)

    def forge(self, lines: list[bytes], replace: bool = False) -> None:
        """Append (or, with ``replace``, set) the ranks key, in pieces under the 8 MiB a
        message of the store's libuv server may carry."""
        data = b"".join(line + b"\n" for line in lines)
        if replace:
            self.prefix.delete_key("ranks")
        for at in range(0, len(data), 4 << 20):
            self.prefix.append("ranks", data[at : at + (4 << 20)])

    def stop(self) -> None:
        for proc in (self.proc, self.server):
            try:
                os.killpg(proc.pid, signal.SIGTERM)
                proc.wait(timeout=20)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                proc.wait(timeout=20)


def _line(rank: int, sidecar: str, at: float = 4e9, host: str = "forged") -> bytes:
    return json.dumps({"rank": rank, "host": host, "sidecar": sidecar, "pid": 1, "registered_at": at}).encode()


def forged_lines(fake_port: int) -> list[bytes]:
    """Lines anyone who reaches the store's port can append: other addresses for rank 0 (the
    last, latest one a fake sidecar on loopback), and 10 000 ranks past the world size."""
    out = [
        _line(0, "10.255.255.1:8787"),
        _line(0, "169.254.169.254:80"),
        _line(0, "8.8.8.8:8787"),
        _line(0, "[2001:db8::1]:8787"),
        _line(0, "evil.example:8787"),
        _line(0, f"127.0.0.1:{fake_port}", at=5e9),  # the latest: it replaced the real rank 0
    ]
    out += [_line(1 + i, f"10.{i // 65536 % 256}.{i // 256 % 256}.{i % 256}:8787") for i in range(10_000)]
    return out


def case_forged(h: Harness) -> list[Case]:
    real = h.fake(_json_reply(envelope({"agents": []})))
    fake = h.fake(_json_reply(envelope({"agents": []})))
    job = OneRankJob(h, real.address)
    cases: list[Case] = []
    try:
        base = dict(allowed=_allowed(real))
        # 1: forged lines added to the key
        job.forge([_line(0, real.address, at=1.0), *forged_lines(fake.port)], replace=True)
        c = Case("store: forged registrations (10 009 lines)", inputs=10_009, **base)  # type: ignore[arg-type]
        run, note = h.discover(["ps", "--job", JOB, "--discover", "--json", "--node-timeout", "2"], real)
        c.runs.append(run)
        c.tokens_unverified = len(fake.auth)
        c.note = note + _note(run) + f"; real sidecar asked {len(real.auth)}x, fake {len(fake.auth)}x"
        cases.append(c)
        # 2: the nodes command itself (no token; a host file for the next command)
        c = Case("store: `nodes --discover` with forged lines", **base)  # type: ignore[arg-type]
        run, note = h.discover(["nodes", "--job", JOB, "--discover"], real)
        c.runs.append(run)
        listed = [ln for ln in run.stdout.splitlines() if ln.strip()]
        c.note = note + f"exit {run.exit_code}: {len(listed)} node(s) listed: {', '.join(listed[:3])[:80]}"
        cases.append(c)
        # 2b: one line with a lone surrogate, one with a control character
        for what, line in (
            ("a lone surrogate", b'{"rank": 0, "host": "\\udc80", "sidecar": "\\udc80:1", "registered_at": 1}'),
            ("a control character", _line(0, "x\x01y:8787", at=6e9)),
        ):
            job.forge([_line(0, real.address, at=1.0), line], replace=True)
            auth = len(real.auth)
            c = Case(f"store: one line with {what}", **base)  # type: ignore[arg-type]
            run, note = h.discover(["ps", "--job", JOB, "--discover", "--json", "--node-timeout", "2"], real)
            c.runs.append(run)
            c.note = note + _note(run) + f"; real sidecar asked {len(real.auth) - auth}x"
            cases.append(c)
        # 3: one huge key: the agent's cost
        job.forge([b"x" * (1 << 20)] * 60, replace=True)
        before = job.hwm_kb()
        c = Case("store: a 60 MB ranks key", **base)  # type: ignore[arg-type]
        run, note = h.discover(["nodes", "--job", JOB, "--discover"], real)
        c.runs.append(run)
        grown = (job.hwm_kb() - before) / 1024
        c.agent_growth_mb = grown
        c.note = note + f"reading it: rank's peak RSS +{grown:.0f} MB; " + _note(run)
        cases.append(c)
        # 4: a 26 MB reply (many ranks with long fields)
        field_ = "h" * 500
        rows = [
            json.dumps(
                {"rank": r, "host": field_, "sidecar": real.address, "job_id": field_ * 2, "registered_at": 1}
            ).encode()
            for r in range(17_000)
        ]
        job.forge(rows, replace=True)
        c = Case("store: 26 MB of registrations", **base)  # type: ignore[arg-type]
        run, note = h.discover(["nodes", "--job", JOB, "--discover"], real)
        c.runs.append(run)
        c.note = note + _note(run)
        cases.append(c)
    finally:
        job.stop()
    return cases


FETCH_NODES = 64
FETCH_ID = "hostile/node/rank0/stacks/20260101T000000.000000Z-1"


def manifest_at_the_bound(values: int, size: int) -> bytes:
    """An artifact's manifest answer (``?manifest=1``) within ``size`` bytes and ``values`` JSON
    values that costs the most to decode: one object of distinct keys (keys are not counted as
    values) with short distinct strings (about 14 MiB decoded for 2 MiB and 99 000 values). It
    lists one file, so that a fetch asks for it (and holds the manifest meanwhile)."""
    files = [{"name": "stacks.json", "size": 1000, "sha256": "0" * 64}]
    head = json.dumps({"id": FETCH_ID, "manifest": {"kind": "stacks", "files": files, "pad": "PAD"}}).encode()
    pairs = []
    room = size - len(head) - 2
    for i in range(values - 20):
        pair = f'"{i:06x}":"{i:08x}"'.encode()
        room -= len(pair) + 1
        if room < 0:
            break
        pairs.append(pair)
    return head.replace(b'"PAD"', b"{" + b",".join(pairs) + b"}")


def fetch_node(manifest: bytes, listing: bytes, hold_s: float) -> Behaviour:
    """A node that lists one artifact (``listing``), answers its manifest with ``manifest`` and
    drips its file for ``hold_s`` seconds before it hangs up: a fetch holds the manifest of
    every node at once meanwhile."""

    def reply(h: BaseHTTPRequestHandler) -> None:
        if "/files/" in h.path:
            h.send_response(200)
            h.send_header("Content-Type", "application/octet-stream")
            h.send_header("Content-Length", "1000")
            h.end_headers()
            end = time.monotonic() + hold_s
            while time.monotonic() < end:
                h.wfile.write(b"x")
                h.wfile.flush()
                time.sleep(0.5)
            h.close_connection = True
            return
        body = manifest if "manifest=1" in h.path else listing
        _json_reply(body)(h)

    return reply


def case_fetch(h: Harness, name: str, listing_bytes: int = 0) -> Case:
    """``ls --fetch`` across FETCH_NODES nodes, each answering its artifact's manifest at the
    per-manifest bound (about 2 MiB and 100 000 JSON values); with ``listing_bytes``, each
    node's ls answer is that large too (long rows around the one artifact)."""
    from dynprof.job.client import MAX_MANIFEST_ANSWER_BYTES, MAX_MANIFEST_ANSWER_VALUES

    row: dict[str, Any] = {"id": FETCH_ID, "path": "/x/" + FETCH_ID, "kind": "stacks", "status": "complete"}
    listing = envelope({"artifacts": [{**row, "pad": "PAD"}]}, action="ls")
    if listing_bytes:  # the listing at its bound too: the same costliest shape, in its one row
        from dynprof.job.client import MAX_ANSWER_VALUES

        pad = manifest_at_the_bound(MAX_ANSWER_VALUES - 1000, listing_bytes)
        listing = listing.replace(b'"PAD"', pad[pad.index(b'"pad": ') + 7 : -2])
    else:
        listing = listing.replace(b'"PAD"', b"null")
    manifest = manifest_at_the_bound(MAX_MANIFEST_ANSWER_VALUES - 1000, MAX_MANIFEST_ANSWER_BYTES - 4096)
    behaviour = fetch_node(manifest, listing, hold_s=6.0)
    servers = [h.fake(behaviour) for _ in range(FETCH_NODES)]
    c = Case(name, inputs=FETCH_NODES, allowed=_allowed(*servers))
    dest = h.work / f"fetched-{time.monotonic_ns()}"
    hosts = ",".join(s.address for s in servers)
    run = h.cli(["ls", "--hosts", hosts, "--fetch", str(dest), "--json", "--node-timeout", "30"])
    c.runs.append(run)
    try:
        doc = json.loads(run.stdout)
        fetched = doc.get("fetched") or []
        errors_ = [str(f.get("error") or "") for f in fetched]
        cut = sum(e.startswith("cut: ") for e in errors_)
        c.note = f"exit {run.exit_code}: {len(fetched)} fetch row(s), {cut} node(s) cut"
        first_cut = next((e for e in errors_ if e.startswith("cut: ")), "")
        c.note += f" ({first_cut[:70]}...)" if first_cut else ""
    except (ValueError, AttributeError):
        c.note = _note(run)
    for s in servers:
        s.close()
    h.servers = [s for s in h.servers if s not in servers]
    return c


CASES: dict[str, Callable[[Harness], list[Case]]] = {
    "drip": lambda h: [case_fake(h, "drip: 1 byte / 0.5 s of body", drip_body)],
    "drip-headers": lambda h: [case_fake(h, "drip: 1 byte / 0.5 s of headers", drip_headers)],
    "silent": lambda h: [case_fake(h, "silent after accept", silent)],
    "byte-bomb": lambda h: [case_fake(h, "byte bomb: endless chunked body", byte_bomb, timeout=20)],
    "item-bomb-ps": lambda h: [
        case_fake(h, "item bomb: 3 MB of {} rows (ps)", _json_reply(item_bomb("agents", 3 << 20)), timeout=30)
    ],
    "item-bomb-ps-cap": lambda h: [
        case_fake(
            h, "item bomb: 240 000 {} rows (ps, under the cap)", _json_reply(item_bomb("agents", 720_000)), timeout=30
        )
    ],
    "item-bomb-ps-78": lambda h: [
        case_fake(h, "item bomb: 78 MB of {} rows (ps)", _json_reply(item_bomb("agents", 78 << 20)), timeout=60)
    ],
    "wide-rows-ps-78": lambda h: [
        case_fake(h, "78 MB of rows with long text (ps)", _json_reply(wide_rows("agents", 78 << 20)), timeout=60)
    ],
    "wide-rows-ls-15": lambda h: [
        case_fake(
            h,
            "15 MB of rows with long text (ls, under its cap)",
            _json_reply(wide_rows("artifacts", 15 << 20)),
            "ls",
            60,
        )
    ],
    "item-bomb-ls-78": lambda h: [
        case_fake(h, "item bomb: 78 MB of {} rows (ls)", _json_reply(item_bomb("artifacts", 78 << 20)), "ls", 60)
    ],
    "deep": lambda h: [case_fake(h, "deep: [ x 100 000", _json_reply(b"[" * 100_000))],
    "shapes": lambda h: [
        case_fake(h, name, _json_reply(body))
        for name, body in [
            ("shape: result a list", envelope([1, 2, 3])),
            ("shape: exit_code a string", envelope({}, exit_code="0")),
            ("shape: messages a dict", envelope({}, messages={"a": 1})),
            ("shape: agents of strings", envelope({"agents": ["x", 1, None]})),
            ("shape: not JSON", b"\xff\xfe garbage"),
        ]
    ],
    "escapes": lambda h: [
        case_fake(
            h,
            "escapes: ANSI/OSC in host, rows, messages",
            _json_reply(
                envelope(
                    {"agents": [{"pid": 1, "rank": 0, "job_id": "\x1b]0;pwned\x07", "host": "\x1b[2J"}]},
                    host="\x1b[31mred",
                    messages=["\x1b[2Jwiped", "\u202eevil"],
                )
            ),
        )
    ],
    "redirect": lambda h: [case_redirect(h)],
    "names": lambda h: [case_names(h)],
    "forged": case_forged,
    "fetch-manifests": lambda h: [case_fetch(h, f"fetch: {FETCH_NODES} manifests at the bound (ls --fetch)")],
    "fetch-manifests-listings": lambda h: [
        case_fetch(h, f"fetch: {FETCH_NODES} manifests and listings at the bound", listing_bytes=15 << 20)
    ],
}


def print_table(cases: list[Case], root: Path) -> None:
    print(f"hostile network, CLI of {root}")
    print()
    head = (
        "| case | inputs | tracebacks | CLI peak RSS | elapsed / --node-timeout | connects outside allow-list "
        "| tokens to unverified | what it said |"
    )
    print(head)
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |")
    for c in cases:
        deadline = f"{c.elapsed_s:.1f} s / {c.deadline_s:g} s" if c.deadline_s else f"{c.elapsed_s:.1f} s"
        note = c.note.replace("|", "\\|").replace("\n", " ")
        note = note.encode("ascii", "backslashreplace").decode()
        print(
            f"| {c.name} | {c.inputs} | {c.tracebacks} | {c.peak_rss_mb:.0f} MB | {deadline} | {c.outside} "
            f"| {c.tokens_unverified} | {note} |"
        )
    print()
    print(
        f"totals: {sum(c.inputs for c in cases)} inputs, {sum(c.tracebacks for c in cases)} traceback(s), "
        f"peak RSS {max((c.peak_rss_mb for c in cases), default=0):.0f} MB, "
        f"{sum(c.outside for c in cases)} connection(s)/look-up(s) outside the allow-list, "
        f"{sum(c.tokens_unverified for c in cases)} token(s) sent to unverified addresses"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--root", type=Path, default=Path(__file__).resolve().parents[1])
    parser.add_argument("--only", help="comma-separated case names: " + ",".join(CASES))
    parser.add_argument("--limit", type=float, default=60.0, help="seconds each CLI run may take (default 60)")
    parser.add_argument("--max-as-mb", type=int, default=MAX_AS_MB, help="address-space cap of the CLI (MiB)")
    args = parser.parse_args(argv)
    globals()["MAX_AS_MB"] = args.max_as_mb
    names = args.only.split(",") if args.only else list(CASES)
    h = Harness(args.root.resolve(), args.limit)
    cases: list[Case] = []
    try:
        for name in names:
            cases += CASES[name](h)
    finally:
        h.close()
    print_table(cases, args.root)
    return 0


if __name__ == "__main__":
    sys.exit(main())
