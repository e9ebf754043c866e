"""The sidecar acting over HTTP: a real `dynprof serve` on a loopback port, with its own run
directory and artifact store, in front of a real training loop under `dynprof run`.

Checked: the actions answer with the CLI's own `--json` (and a structured error); a trace started over HTTP is fetched
back over /api/v1; tokens, CSRF, read-only, body limits, strict JSON, traversal, the action
slots (429) and TLS; the refusals are logged without the token. The page's buttons are driven
in a real headless Chromium (over the DevTools protocol on a pipe: no extra package).
"""

from __future__ import annotations

import ast
import fcntl
import http.client
import json
import os
import re
import select
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import quote

import pytest

from dynprof.safetext import one_line
from dynprof.sidecar.guard import REFUSAL_LOG_BURST, REFUSAL_LOG_WINDOW_S
from tests._ports import free_port
from tests.support.chromium import chromium

ROOT = Path(__file__).resolve().parents[2]
PROGRAM = "tests/integration/programs/train_program.py"
TOKEN = "sidecar-actions-test-token-0123456789"
JOB = "httpjob"


class Sidecar:
    """A `dynprof serve` subprocess and a small HTTP client for it."""

    def __init__(self, proc: subprocess.Popen[bytes], port: int, stderr: Path, tls: ssl.SSLContext | None) -> None:
        self.proc, self.port, self.stderr_path, self.tls = proc, port, stderr, tls

    def stderr(self) -> str:
        return self.stderr_path.read_text(errors="replace")

    def request(
        self,
        method: str,
        path: str,
        body: bytes | dict[str, Any] | None = None,
        headers: dict[str, str] | None = None,
        auth: bool = True,
        timeout: float = 120,
    ) -> tuple[int, dict[str, str], bytes]:
        if self.tls is not None:
            conn: http.client.HTTPConnection = http.client.HTTPSConnection(
                "127.0.0.1", self.port, timeout=timeout, context=self.tls
            )
        else:
            conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        hdrs = dict(headers or {})
        if auth:
            hdrs.setdefault("Authorization", f"Bearer {TOKEN}")
        data = json.dumps(body).encode() if isinstance(body, dict) else body
        if data is not None:
            hdrs.setdefault("Content-Type", "application/json")
        try:
            conn.request(method, path, body=data, headers=hdrs)
            resp = conn.getresponse()
            return resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read()
        finally:
            conn.close()

    def action(self, name: str, options: dict[str, Any] | None = None, **extra: Any) -> tuple[int, Any]:
        status, _, data = self.request("POST", f"/api/v1/actions/{name}", {"options": options or {}, **extra})
        return status, json.loads(data)


@pytest.fixture
def sidecar(dynprof_dirs, tmp_path) -> Iterator[Callable[..., Sidecar]]:
    """``sidecar(*serve_args, tls=None, env=None)`` starts `dynprof serve` over this test's run
    dir and store (or those ``env`` names); it is stopped (SIGTERM) at the end."""
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    token_file.chmod(0o600)
    started: list[Sidecar] = []

    def start(*args: str, tls: ssl.SSLContext | None = None, env: dict[str, str] | None = None) -> Sidecar:
        port = free_port()
        stderr = tmp_path / f"serve-{port}.stderr"
        env = {
            **os.environ,
            **(env or {}),
            "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
        }
        with open(stderr, "wb") as err:
            proc = subprocess.Popen(
                [sys.executable, "-m", "dynprof", "serve", "--port", str(port), "--token-file", str(token_file), *args],
                stdout=subprocess.DEVNULL,
                stderr=err,
                env=env,
                cwd=str(ROOT),
            )
        side = Sidecar(proc, port, stderr, tls)
        started.append(side)
        deadline = time.monotonic() + 30
        while True:
            try:
                if side.request("GET", "/healthz", auth=False, timeout=2)[0] == 200:
                    return side
            except OSError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"dynprof serve did not answer: {side.stderr()}")
            time.sleep(0.1)

    try:
        yield start
    finally:
        for side in started:
            if side.proc.poll() is None:
                side.proc.terminate()
                try:
                    side.proc.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    side.proc.kill()
                    side.proc.wait(timeout=10)


@pytest.fixture
def train(shared_target) -> int:
    """The pid of a training loop of job JOB under `dynprof run`, past its first step, tracing
    nothing: the module's one (``shared_target``), in the run dir and store this test now uses."""
    target = shared_target([PROGRAM, "--step-sleep", "0.01", "--max-seconds", "1800"], env={"DYNPROF_JOB_ID": JOB})
    (pid,) = target.ready_pids()
    return pid


def cli_json(*args: str) -> Any:
    proc = subprocess.run(
        [sys.executable, "-m", "dynprof", *args, "--json"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=str(ROOT),
    )
    assert proc.stdout.strip(), proc.stderr
    return proc.returncode, json.loads(proc.stdout)


def shape(value: Any) -> Any:
    """The keys of a JSON value, recursively (first element of lists), without the values."""
    if isinstance(value, dict):
        return {k: shape(v) for k, v in value.items()}
    if isinstance(value, list):
        return [shape(value[0])] if value else []
    return type(value).__name__ if value is not None else None


def same_keys(a: Any, b: Any) -> bool:
    if isinstance(a, dict) and isinstance(b, dict):
        return set(a) == set(b) and all(same_keys(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return not a or not b or same_keys(a[0], b[0])
    return True


def artifact_id(path: str, store_root: Path) -> str:
    return str(Path(path).relative_to(store_root))


# -- the actions answer as the CLI does ------------------------------------------------------------
def test_actions_answer_with_the_clis_json(sidecar, train, dynprof_dirs):
    # GIVEN a sidecar in front of a running training loop
    side = sidecar()

    # WHEN ps, stacks and a 2-step trace are asked over HTTP and with the CLI
    status, info = side.request("GET", "/api/v1/info")[0], json.loads(side.request("GET", "/api/v1/info")[2])
    http_ps = side.action("ps", {"job": JOB})
    cli_ps = cli_json("ps", "--job", JOB)
    http_stacks = side.action("stacks", {"job": JOB, "no_save": True})
    cli_stacks = cli_json("stacks", "--job", JOB, "--no-save")
    http_start = side.action("start", {"job": JOB, "steps": 2}, timeout=60)
    cli_start = cli_json("start", "--job", JOB, "--steps", "2", "--timeout", "60")

    # THEN info follows the contract
    assert status == 200
    assert info["api"] == 1 and info["dynprof_version"] and info["host"]
    assert {"ps", "stacks", "start", "stop", "memory", "nccl", "ls", "healthcheck"} <= set(info["actions"])
    assert info["job_wide"] is True
    # AND each action's answer wraps exactly what the CLI's --json prints
    for (code, answer), (cli_code, cli) in ((http_ps, cli_ps), (http_stacks, cli_stacks), (http_start, cli_start)):
        assert code == 200, answer
        assert set(answer) == {
            "api",
            "action",
            "host",
            "dynprof_version",
            "exit_code",
            "result",
            "messages",
            "error",
            "elapsed_s",
        }
        assert answer["api"] == 1 and answer["host"] == info["host"] and answer["error"] is None
        assert answer["exit_code"] == cli_code == 0, (answer, cli)
        assert same_keys(answer["result"], cli), (shape(answer["result"]), shape(cli))
    assert [a["pid"] for a in http_ps[1]["result"]["agents"]] == [train]
    assert http_ps[1]["result"]["agents"][0]["job"] == JOB
    (group,) = http_stacks[1]["result"]["groups"]
    assert group["pids"] == [train] and any(f["function"] == "main" for f in group["frames"])

    # AND the trace taken over HTTP is fetched back over /api/v1, whole
    (res,) = http_start[1]["result"]["results"]
    assert res["status"] == "complete", res
    art = artifact_id(res["artifact"], dynprof_dirs["artifacts"])
    code, _, body = side.request("GET", f"/api/v1/artifacts/{quote(art)}")
    manifest = json.loads(body)["manifest"]
    assert code == 200 and manifest["kind"] == "trace" and manifest["status"] == "complete"
    names = {f["name"]: f for f in manifest["files"]}
    assert "trace.json.gz" in names
    code, headers, data = side.request("GET", f"/api/v1/artifacts/{quote(art)}/files/trace.json.gz")
    assert code == 200 and len(data) == names["trace.json.gz"]["size"]
    assert data == (Path(res["artifact"]) / "trace.json.gz").read_bytes()
    assert headers["content-type"] == "application/octet-stream"
    # AND the unversioned routes still answer the same
    assert side.request("GET", f"/api/artifacts/{quote(art)}")[0] == 200


# -- refusals ---------------------------------------------------------------------------------------
def test_tokens_bodies_and_paths_are_refused_and_logged_without_the_token(sidecar, dynprof_dirs):
    # GIVEN a sidecar
    side = sidecar()
    wrong = "wrong-token-" + "x" * 20

    # WHEN requests come without the token, with a wrong one, in every place
    for path, method in (("/api/v1/info", "GET"), ("/api/v1/actions/ps", "POST"), ("/", "GET")):
        assert side.request(method, path, auth=False)[0] == 401
        assert side.request(method, path, headers={"Authorization": f"Bearer {wrong}"}, auth=False)[0] == 401
        assert side.request(method, path + f"?token={wrong}", auth=False)[0] == 401
        assert side.request(method, path, headers={"Cookie": f"dynprof_token={wrong}"}, auth=False)[0] == 401
    # AND with a DNS-rebinding Host, and from another site
    assert side.request("GET", "/api/v1/info", headers={"Host": "evil.example"})[0] == 400
    assert side.request("GET", "/api/v1/info", headers={"Origin": "http://evil.example"})[0] == 403

    # THEN each refusal is one line of the server's stderr that never holds a token (written
    # before the refusal is answered)
    log = side.stderr()
    refusals = [line for line in log.splitlines() if "refused" in line]
    assert len([r for r in refusals if "refused 401 (missing token)" in r]) == 3, refusals
    assert len([r for r in refusals if "refused 401 (wrong token)" in r]) == 9, refusals
    assert any("refused 400 (unexpected Host header)" in r for r in refusals)
    assert any("refused 403 (cross-site request)" in r for r in refusals)
    assert all(TOKEN not in r and wrong not in r for r in refusals)
    assert log.count(TOKEN) == 1  # the URL printed at start, nowhere else

    # AND bodies: too large 413, not JSON / not an object / unknown option or key 400
    big = json.dumps({"options": {"job": "j" * (70 * 1024)}}).encode()
    assert side.request("POST", "/api/v1/actions/ps", big)[0] == 413
    for body in (b"{", b"[]", b'"ps"', b"\xff\xfe", b'{"options": {"job": NaN}}', b'{"options": 1}'):
        code, _, data = side.request("POST", "/api/v1/actions/ps", body)
        assert code == 400 and json.loads(data)["code"] == 400, body
    assert side.request("POST", "/api/v1/actions/ps", b'{"options": {}, "options": {}}')[0] == 400
    assert side.request("POST", "/api/v1/actions/ps", b"[" * 500 + b"]" * 500)[0] == 400
    for name, body in (
        ("ps", {"options": {"output": "/etc/passwd"}}),
        ("ps", {"options": {}, "cwd": "/"}),
        ("ps", {"options": {"job": 7}}),
        ("stacks", {"options": {"pid": ["1; rm -rf /"]}}),
        ("start", {"options": {"job": "j", "steps": "--attach"}}),
        ("ps", {"timeout": -1}),
        ("shell", {}),
    ):
        code, _, data = side.request("POST", f"/api/v1/actions/{name}", body)
        assert code == 400 and "error" in json.loads(data), (name, body, data)
    # an action by GET: there is none
    assert side.request("GET", "/api/v1/actions/ps")[0] == 405

    # AND paths out of the store are refused, whatever the encoding
    outside = dynprof_dirs["artifacts"].parent / "outside"
    outside.mkdir()
    (outside / "secret.txt").write_text("secret-outside-the-store")
    for bad in (
        "/api/v1/artifacts/../outside/secret.txt",
        "/api/v1/artifacts/..%2foutside",
        "/api/v1/artifacts/%2e%2e/outside",
        f"/api/v1/artifacts/{outside}",
        f"/api/v1/artifacts/%2F{str(outside).lstrip('/')}",
        "/api/v1/artifacts/x/files/..%2f..%2foutside%2fsecret.txt",
        "/api/v1/artifacts/x/files/%2e%2e",
        "/api/v1/artifacts/..%00/files/secret.txt",
    ):
        code, _, data = side.request("GET", bad)
        assert code in (400, 404, 308), (bad, code)
        assert b"secret-outside-the-store" not in data


def test_refusal_log_is_rate_limited(sidecar):
    # GIVEN a sidecar WHEN 200 requests without a token arrive at once
    side = sidecar()
    t0 = time.monotonic()
    for _ in range(200):
        assert side.request("GET", "/api/v1/info", auth=False)[0] == 401
    elapsed = time.monotonic() - t0
    # THEN at most one burst of lines is written per window of the limit that the flood lasted
    # (a slow machine may spread it over more than one); the rest is counted, not logged
    windows = int(elapsed // REFUSAL_LOG_WINDOW_S) + 1
    lines = [line for line in side.stderr().splitlines() if "refused 401" in line]
    assert 1 <= len(lines) <= REFUSAL_LOG_BURST * windows, (len(lines), elapsed)


def test_csrf_value_is_required_from_a_browser(sidecar, train):
    # GIVEN the page opened with the token (its cookie set) and the CSRF value it carries
    side = sidecar()
    code, headers, page = side.request("GET", f"/?token={TOKEN}", auth=False)
    assert code == 200
    cookie = headers["set-cookie"].split(";", 1)[0]
    csrf = re.search(rb"name=dynprof-csrf content='([^']+)'", page).group(1).decode()  # type: ignore[union-attr]
    body = {"options": {"job": JOB}}
    # WHEN an action comes with the cookie alone, or a wrong CSRF value, or ?token= alone
    alone = side.request("POST", "/api/v1/actions/ps", body, headers={"Cookie": cookie}, auth=False)
    wrong = side.request(
        "POST", "/api/v1/actions/ps", body, headers={"Cookie": cookie, "X-Dynprof-CSRF": csrf[:-1] + "x"}, auth=False
    )
    query = side.request("POST", f"/api/v1/actions/ps?token={TOKEN}", body, auth=False)
    # THEN all are refused
    assert alone[0] == wrong[0] == query[0] == 403
    # AND with the page's value (or the Bearer header, an API client's) the action runs
    ok = side.request(
        "POST", "/api/v1/actions/ps", body, headers={"Cookie": cookie, "X-Dynprof-CSRF": csrf}, auth=False
    )
    assert ok[0] == 200 and json.loads(ok[2])["result"]["agents"][0]["pid"] == train
    assert side.action("ps", {"job": JOB})[0] == 200
    assert "refused 403 (missing or wrong CSRF value)" in side.stderr()


def test_read_only_sidecar_refuses_actions_that_change_jobs(sidecar, train):
    # GIVEN a read-only sidecar that never reaches other nodes
    side = sidecar("--read-only", "--no-job-wide")
    # WHEN a trace is asked, THEN 403 and nothing is started; reading actions still answer
    code, answer = side.action("start", {"job": JOB, "steps": 2})
    assert code == 403 and "read-only" in answer["error"]
    for name in ("stop", "memory", "nccl", "healthcheck"):
        assert side.action(name, {})[0] == 403
    code, answer = side.action("ps", {"job": JOB})
    assert code == 200 and answer["result"]["agents"][0]["state"] == "idle"
    info = json.loads(side.request("GET", "/api/v1/info")[2])
    assert info["read_only"] is True and "start" not in info["actions"] and "ps" in info["actions"]
    # AND a job-wide ask is refused before anything runs
    assert info["job_wide"] is False
    code, answer = side.action("ps", {"job": JOB, "hosts": ["127.0.0.1:1"]})
    assert code == 400 and "does not reach other nodes" in answer["error"]


def test_busy_slots_answer_429_with_retry_after(sidecar, train):
    # GIVEN a sidecar with one action slot, busy with a trace that lasts until it is stopped
    # (however slow the machine, it is still running when the next action comes)
    side = sidecar("--max-actions", "1")
    long_one: list[tuple[int, Any]] = []
    worker = threading.Thread(target=lambda: long_one.append(side.action("start", {"job": JOB, "duration": 300.0})))
    worker.start()
    try:
        # (the trace is seen running by the CLI, not through the busy sidecar)
        deadline = time.monotonic() + 30
        while cli_json("ps", "--job", JOB)[1]["agents"][0]["state"] != "tracing":
            assert time.monotonic() < deadline and not long_one, f"the trace did not start: {long_one}"
            time.sleep(0.1)
        # WHEN another action comes meanwhile
        seen = side.request("POST", "/api/v1/actions/ps", {"options": {}})
        # THEN it is refused at once with 429 and a Retry-After
        assert seen[0] == 429, (seen, long_one)
        assert seen[1]["retry-after"].isdigit() and json.loads(seen[2])["code"] == 429
        # AND a bad request is still 400, not 429
        assert side.request("POST", "/api/v1/actions/ps", {"options": {"nope": 1}})[0] == 400
    finally:
        stopped = cli_json("stop", "--job", JOB)
        worker.join(120)
    assert stopped[0] == 0, stopped
    # AND once the trace is done the slot is free again
    assert long_one and long_one[0][0] == 200 and long_one[0][1]["exit_code"] == 0, long_one
    assert side.action("ps", {})[0] == 200


def test_healthz_and_clean_stop(sidecar):
    # GIVEN a sidecar WHEN a probe asks /healthz without the token THEN "ok" and nothing else
    side = sidecar()
    code, headers, body = side.request("GET", "/healthz", auth=False)
    assert (code, body) == (200, b"ok\n") and headers["content-type"].startswith("text/plain")
    # WHEN it gets SIGTERM THEN it stops cleanly, exit 0
    side.proc.send_signal(signal.SIGTERM)
    assert side.proc.wait(timeout=20) == 0
    assert "stopped serving" in side.stderr() and "Traceback" not in side.stderr()


def test_a_loopback_sidecar_links_to_no_other_loopback_address(sidecar):
    # GIVEN another service of this machine listening on 127.0.0.9, counting its connections
    listener = socket.socket()
    listener.bind(("127.0.0.9", 0))
    listener.listen(64)
    listener.settimeout(0.2)
    port = listener.getsockname()[1]
    accepted: list[socket.socket] = []
    done = threading.Event()

    def accept() -> None:
        while not done.is_set():
            try:
                accepted.append(listener.accept()[0])
            except OSError:
                continue

    acceptor = threading.Thread(target=accept, daemon=True)
    acceptor.start()
    # AND a sidecar bound to 127.0.0.1 (job-wide, so it runs link tests)
    side = sidecar()
    try:
        # WHEN a token holder asks it for link tests toward that listener, as either rank
        answers = [
            side.action(
                "link-test", {"rank": rank, "world": 2, "store_host": "127.0.0.9", "store_port": port, "limit": 5}
            )
            for rank in (0, 1)
        ]
    finally:
        done.set()
        acceptor.join(10)
        listener.close()
        for conn in accepted:
            conn.close()
    # THEN both are refused, saying why, and nothing connected to the listener
    for code, answer in answers:
        assert code == 400, answer
        assert "127.0.0.9" in answer["error"] and "loopback" in answer["error"], answer
    assert accepted == []


def _catches(pid: int, signum: int) -> bool:
    """Whether process ``pid`` has a handler for ``signum`` (SigCgt of /proc/PID/status)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("SigCgt:"):
            return bool(int(line.split()[1], 16) & (1 << (signum - 1)))
    raise AssertionError(f"no SigCgt for pid {pid}")


def test_a_rank_killed_by_sigterm_leaves_no_record_once_the_sidecar_has_polled(sidecar, spawn, dynprof_dirs):
    # GIVEN a node's sidecar (polling its ranks' progress, every 2 s by default) and a rank of
    # a job, whose SIGTERM is left as the job had it: dynprof installs no handler for it
    side = sidecar()
    target = spawn([PROGRAM, "--step-sleep", "0.01"], env={"DYNPROF_JOB_ID": JOB})
    (pid,) = target.ready_pids()
    agents = dynprof_dirs["run"] / "agents"
    assert (agents / f"{pid}.json").exists() and (agents / f"{pid}.sock").exists()
    assert not _catches(pid, signal.SIGTERM)

    # WHEN the rank is killed by SIGTERM, and no dynprof command runs on the node
    os.kill(pid, signal.SIGTERM)

    # THEN the sidecar's next poll removes its record and socket (a far deadline: a hang detector)
    deadline = time.monotonic() + 120
    while (agents / f"{pid}.json").exists() or (agents / f"{pid}.sock").exists():
        assert time.monotonic() < deadline, f"the record of {pid} is still there: {side.stderr()}"
        time.sleep(0.1)
    assert side.proc.poll() is None


# -- TLS --------------------------------------------------------------------------------------------
def test_tls_with_a_self_signed_certificate(sidecar, tmp_path, cli):
    openssl = shutil.which("openssl")
    if openssl is None:
        pytest.skip("needs the openssl command to make a self-signed certificate")
    # GIVEN a self-signed certificate for 127.0.0.1
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    made = subprocess.run(
        [openssl, "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=127.0.0.1",
         "-addext", "subjectAltName=IP:127.0.0.1", "-keyout", str(key), "-out", str(cert)],
        capture_output=True,
        timeout=60,
    )  # fmt: skip
    if made.returncode != 0:
        pytest.skip(f"openssl could not make a certificate: {made.stderr[-300:]!r}")
    key.chmod(0o600)
    ctx = ssl.create_default_context(cafile=str(cert))
    # WHEN the sidecar serves with it
    side = sidecar("--certfile", str(cert), "--keyfile", str(key), tls=ctx)
    # THEN its URL is https, and a client that trusts the certificate is answered over TLS
    assert re.search(r"serving on https://127\.0\.0\.1:\d+/\?token=", side.stderr())
    code, _, body = side.request("GET", "/api/v1/info")
    assert code == 200 and json.loads(body)["api"] == 1
    assert side.action("ps", {})[0] == 200
    # AND plain HTTP on that port gets no answer
    plain = Sidecar(side.proc, side.port, side.stderr_path, None)
    with pytest.raises((OSError, http.client.HTTPException)):
        plain.request("GET", "/api/v1/info", timeout=5)
    # AND a certificate without its key is a usage error
    half = cli("serve", "--port", str(free_port()), "--token", TOKEN, "--certfile", str(cert), timeout=60)
    assert half.returncode == 2 and "--certfile and --keyfile together" in half.stderr
    # AND as many action slots as threads would leave no thread for /healthz: refused too
    crowded = cli("serve", "--port", str(free_port()), "--token", TOKEN, "--threads", "4", "--max-actions", "4")
    assert crowded.returncode == 2 and "needs --threads above it" in crowded.stderr


# -- the page, in a real headless Chromium ----------------------------------------------------------
def _above_ten(fd: int) -> int:
    high = fcntl.fcntl(fd, fcntl.F_DUPFD, 10)
    os.close(fd)
    return high


class Browser:
    """Headless Chromium driven over the DevTools protocol on a pipe (--remote-debugging-pipe:
    JSON messages ending in NUL, commands on its fd 3, answers on its fd 4)."""

    def __init__(self, exe: str) -> None:
        self.profile = tempfile.mkdtemp(prefix="dp-chromium-")
        to_child_r, self._to_child = os.pipe()
        self._from_child, from_child_w = os.pipe()
        # the child's ends moved to fds >= 10 first, so moving them to 3 and 4 never clobbers one
        to_child_r, from_child_w = _above_ten(to_child_r), _above_ten(from_child_w)
        args = [
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--no-first-run",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            "--remote-debugging-pipe",
            f"--user-data-dir={self.profile}",
            "about:blank",
        ]
        shell = f'exec "$0" "$@" 3<&{to_child_r} 4>&{from_child_w} {to_child_r}<&- {from_child_w}>&-'
        self.proc = subprocess.Popen(
            ["bash", "-c", shell, exe, *args],
            pass_fds=(to_child_r, from_child_w),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        os.close(to_child_r)
        os.close(from_child_w)
        self._buf = b""
        self._next = 0
        target = self.call("Target.createTarget", {"url": "about:blank"})["targetId"]
        self.session = self.call("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]

    def call(self, method: str, params: dict[str, Any] | None = None, session: str | None = None) -> Any:
        self._next += 1
        msg: dict[str, Any] = {"id": self._next, "method": method, "params": params or {}}
        if session:
            msg["sessionId"] = session
        os.write(self._to_child, json.dumps(msg).encode() + b"\0")
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            while b"\0" in self._buf:
                raw, self._buf = self._buf.split(b"\0", 1)
                answer = json.loads(raw)
                if answer.get("id") == self._next:
                    if "error" in answer:
                        raise AssertionError(f"{method}: {answer['error']}")
                    return answer.get("result")
            ready, _, _ = select.select([self._from_child], [], [], 1.0)
            if ready:
                chunk = os.read(self._from_child, 1 << 20)
                if not chunk:
                    raise AssertionError("chromium closed its DevTools pipe")
                self._buf += chunk
        raise AssertionError(f"no answer to {method}")

    def eval(self, expression: str) -> Any:
        result = self.call(
            "Runtime.evaluate", {"expression": expression, "returnByValue": True, "awaitPromise": True}, self.session
        )
        if "exceptionDetails" in result:
            raise AssertionError(f"{expression[:80]}: {result['exceptionDetails']}")
        return result["result"].get("value")

    def goto(self, url: str) -> None:
        self.call("Page.navigate", {"url": url}, self.session)
        self.wait_for("document.readyState === 'complete' && location.href.startsWith('http')")

    def wait_for(self, expression: str, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.eval(f"Boolean({expression})"):
                return
            time.sleep(0.1)
        raise AssertionError(f"still false after {timeout} s: {expression}")

    def close(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(timeout=10)
        os.close(self._to_child)
        os.close(self._from_child)
        shutil.rmtree(self.profile, ignore_errors=True)


@pytest.fixture
def browser() -> Iterator[Browser]:
    exe = chromium()
    if exe is None:
        pytest.skip("no Chromium here: install Debian's (apt-get install chromium) or set DYNPROF_TEST_CHROMIUM")
    b = Browser(exe)
    try:
        yield b
    finally:
        b.close()


def test_page_buttons_trace_and_show_merged_stacks(sidecar, train, browser, dynprof_dirs):
    # GIVEN the page of a sidecar in front of a running job, opened with the token
    side = sidecar()
    browser.goto(f"http://127.0.0.1:{side.port}/?token={TOKEN}")
    section = f"document.querySelector('section.job[data-job=\"{JOB}\"]')"
    assert browser.eval(f"{section}.querySelectorAll('tr').length") == 2  # header + the one rank
    assert browser.eval(f"{section}.querySelector('td.state').textContent") == "idle"

    step_before = int(browser.eval(f"{section}.querySelector('td.step').textContent"))
    traced_before = set(dynprof_dirs["artifacts"].rglob("trace.json.gz"))  # the module's earlier tests'

    # WHEN "Trace" is clicked for 2 steps
    browser.eval(f"{section}.querySelector('input.steps').value = '2'")
    browser.eval(f"{section}.querySelector('button[data-action=start]').click()")
    browser.wait_for(f"{section}.getAttribute('data-state') === 'done'")

    # THEN the result names a complete trace artifact, with a link that opens it
    head = browser.eval(f"{section}.querySelector('.result .head').textContent")
    assert head.startswith("start: exit 0"), head + str(browser.eval(f"{section}.querySelector('.result').innerText"))
    href = browser.eval(f"{section}.querySelector('.result a.artifact').getAttribute('href')")
    traces = list(set(dynprof_dirs["artifacts"].rglob("trace.json.gz")) - traced_before)
    assert len(traces) == 1
    art = artifact_id(str(traces[0].parent), dynprof_dirs["artifacts"])
    assert href == "/artifact/" + quote(art)
    # AND the ranks' steps and the artifacts table were refreshed
    assert int(browser.eval(f"{section}.querySelector('td.step').textContent")) >= step_before + 2
    browser.wait_for(f"document.getElementById('artifacts').textContent.includes({json.dumps(art)})")
    code, _, page = side.request("GET", href)
    assert code == 200 and b"trace.json.gz" in page

    # WHEN "Take stacks" is clicked
    browser.eval(f"{section}.setAttribute('data-state', '')")
    browser.eval(f"{section}.querySelector('button[data-action=stacks]').click()")
    browser.wait_for(f"{section}.getAttribute('data-state') === 'done'")

    # THEN the merged view groups the ranks by main-thread stack and shows the frames
    head = browser.eval(f"{section}.querySelector('.result .head').textContent")
    assert head.startswith("stacks: exit 0"), head
    groups = browser.eval(f"Array.from({section}.querySelectorAll('.result .group')).map(g => g.innerText)")
    assert len(groups) == 1 and f"pid {train}" in groups[0], groups
    frames = browser.eval(f"{section}.querySelector('.result .group pre').textContent")
    assert "main (" in frames and "train_program.py" in frames, frames
    # AND no request the page made was refused (token cookie and CSRF value were enough)
    assert "refused" not in side.stderr(), side.stderr()


HOSTILE_NAMES = "tests/integration/programs/hostile_names_program.py"


def _string_constants(path: Path) -> dict[str, str]:
    """A program's top-level string constants (read, not imported: no torch here)."""
    tree = ast.parse(path.read_text())
    return {
        node.targets[0].id: node.value.value
        for node in tree.body
        if isinstance(node, ast.Assign)
        and isinstance(node.targets[0], ast.Name)
        and isinstance(node.value, ast.Constant)
        and isinstance(node.value.value, str)
    }


# Characters that must never reach the page raw: a newline forges a line (of a frame list, of a
# cell's text), an escape sequence and bidirectional overrides make text read as it is not.
RAW = ("\n", "\r", "\x1b", "\u202e", "\u2066")


def test_page_script_shows_a_nodes_hostile_text_as_escaped_text(sidecar, spawn, browser):
    # GIVEN a rank whose job id, host, phase and stepping function's name hold a newline, a
    # right-to-left override, an escape sequence and markup
    job = "job\n<script>window.__pwned=3</script>\u202e\x1b[31m"
    host = "node\nrank 1 is fine\u2066\x1b[2J"
    target = spawn([HOSTILE_NAMES], env={"DYNPROF_JOB_ID": job, "DYNPROF_HOST": host})
    (pid,) = target.ready_pids()
    side = sidecar()
    browser.goto(f"http://127.0.0.1:{side.port}/?token={TOKEN}")
    section = "document.querySelector('section.job')"

    # WHEN its page takes its stacks, lists its ranks and its artifacts (the script renders each
    # answer, then refreshes the ranks' rows and the artifacts table from the JSON API)
    shown = {}
    for action in ("stacks", "ps", "ls"):
        browser.eval(f"{section}.setAttribute('data-state', '')")
        browser.eval(f"{section}.querySelector('button[data-action={action}]').click()")
        browser.wait_for(f"{section}.getAttribute('data-state') === 'done'")
        # the answer as shown, but its <pre> blocks (their newlines are dynprof's own)
        shown[action] = browser.eval(
            f"(function () {{ var box = {section}.querySelector('.result').cloneNode(true);"
            " box.querySelectorAll('pre').forEach(function (p) { p.remove(); }); return box.textContent; })()"
        )
        assert f"{action}: exit 0" in shown[action], shown[action]
        if action == "stacks":
            shown["frames"] = browser.eval(f"{section}.querySelector('.result .group pre').textContent")
    shown["cells"] = browser.eval("Array.from(document.querySelectorAll('td')).map(td => td.textContent).join('|')")
    shown["state"] = browser.eval(f"document.querySelector(\"tr[data-pid='{pid}'] td.state\").textContent")

    # THEN no script or handler from the text ran, and no raw newline, escape or override
    # reached the page: each is shown as its escape, as the server-rendered rows show it
    assert browser.eval("window.__pwned === undefined")
    assert browser.eval("document.querySelectorAll('section.job script, section.job img, section.job b').length") == 0
    for name, text in shown.items():
        raw = [c for c in RAW if c in text and not (c == "\n" and name == "frames")]
        assert not raw, (name, raw, text[:2000])
    # AND a frame's newline forges no line of the merged stacks
    lines = shown["frames"].split("\n")
    assert not [line for line in lines if line.startswith("rank 0 is fine")], lines
    # AND the script's escapes are dynprof.safetext.one_line's, character for character: the
    # function's name in the frames, the phase refreshed from the JSON API, the host in ps
    names = _string_constants(ROOT / HOSTILE_NAMES)
    function, phase = names["FUNCTION"], names["PHASE"]
    assert one_line(function) in shown["frames"], (one_line(function), shown["frames"])
    assert f"(in phase {one_line(phase)})" in shown["state"], (one_line(phase), shown["state"])
    assert one_line(host) in shown["ps"], (one_line(host), shown["ps"])


# -- job-wide: the page asks its own sidecar, which asks the other nodes' -----------------------------
def test_job_wide_view_through_one_sidecar(short_dir, sidecar, spawn, browser, tmp_path):
    # GIVEN two "nodes" on this machine: each a sidecar with its own run dir and store, and one
    # rank of job JOB; and a third address where nothing answers
    nodes = []
    for name in ("a", "b"):
        dirs = {"DYNPROF_RUN_DIR": short_dir(name), "DYNPROF_ARTIFACT_DIR": str(tmp_path / name)}
        target = spawn([PROGRAM, "--step-sleep", "0.01"], env={**dirs, "DYNPROF_JOB_ID": JOB})
        (pid,) = target.ready_pids()
        nodes.append((sidecar(env=dirs), pid, dirs))
    (a, pid_a, _), (b, pid_b, _) = nodes
    down = f"127.0.0.1:{free_port()}"
    hosts = [f"127.0.0.1:{a.port}", f"127.0.0.1:{b.port}"]
    # WHEN node a is asked for the job's ranks and stacks on both nodes (and one down)
    code, ps = a.action("ps", {"job": JOB, "hosts": [*hosts, down]}, timeout=30)
    code_stacks, stacks = a.action("stacks", {"job": JOB, "hosts": hosts}, timeout=60)

    # THEN both ranks are listed, each with its node, and the node down is named
    assert code == 200, ps
    assert sorted(r["pid"] for r in ps["result"]["agents"]) == sorted([pid_a, pid_b])
    by_node = {n["node"]: n for n in ps["result"]["nodes"]}
    assert by_node[down]["ok"] is False and by_node[down]["error"]
    assert all(by_node[h]["ok"] for h in hosts)
    # AND the stacks of both nodes are merged into one grouped view
    assert code_stacks == 200 and stacks["exit_code"] == 0, stacks
    members = sorted(m["pid"] for g in stacks["result"]["groups"] for m in g["members"])
    assert members == sorted([pid_a, pid_b])
    # AND a job-wide trace asked of node a traces the rank of each node, from one step
    code, start = a.action("start", {"job": JOB, "steps": 2, "hosts": hosts}, timeout=120)
    assert code == 200 and start["exit_code"] == 0, start
    assert sorted(r["pid"] for r in start["result"]["results"]) == sorted([pid_a, pid_b])
    assert all(r["status"] == "complete" for r in start["result"]["results"]), start["result"]["results"]
    assert not start["result"]["missed"] and len(start["result"]["artifacts"]) == 2
    assert len({r["start_step"] for r in start["result"]["results"]}) == 1, start["result"]["results"]

    # WHEN the page of node a is asked the same, its field naming both nodes
    browser.goto(f"http://127.0.0.1:{a.port}/?token={TOKEN}")
    section = f"document.querySelector('section.job[data-job=\"{JOB}\"]')"
    browser.eval(f"{section}.querySelector('input.hosts').value = {json.dumps(','.join(hosts))}")
    browser.eval(f"{section}.querySelector('button[data-action=ps]').click()")
    browser.wait_for(f"{section}.getAttribute('data-state') === 'done'")
    # THEN it shows the ranks of both nodes
    rows = browser.eval(f"Array.from({section}.querySelectorAll('.result table.agents tr')).length")
    assert rows == 3  # header + one rank per node
    browser.eval(f"{section}.setAttribute('data-state', '')")
    browser.eval(f"{section}.querySelector('button[data-action=stacks]').click()")
    browser.wait_for(f"{section}.getAttribute('data-state') === 'done'")
    text = browser.eval(f"{section}.querySelector('.result').innerText")
    assert "stacks: exit 0" in text and f"node 127.0.0.1:{b.port}: ok" in text, text
    # AND the artifacts of both nodes (the traces taken above) are listed with their node
    browser.eval(f"{section}.setAttribute('data-state', '')")
    browser.eval(f"{section}.querySelector('button[data-action=ls]').click()")
    browser.wait_for(f"{section}.getAttribute('data-state') === 'done'")
    cells = browser.eval(
        f"Array.from({section}.querySelectorAll('.result table.listing tr')).slice(1)"
        ".map(r => [r.cells[0].textContent, r.cells[2].textContent])"
    )
    assert sorted(c for c in cells if c[1] == "trace") == sorted([[h, "trace"] for h in hosts]), cells


def test_job_wide_action_answers_each_nodes_error_structured(short_dir, sidecar, spawn, tmp_path):
    # GIVEN two "nodes" (each a sidecar with its own run dir and store), a rank of job JOB on
    # the first only
    nodes = []
    for name in ("a", "b"):
        dirs = {"DYNPROF_RUN_DIR": short_dir(name), "DYNPROF_ARTIFACT_DIR": str(tmp_path / name)}
        nodes.append((sidecar(env=dirs), dirs))
    (a, dirs_a), (b, _) = nodes
    target = spawn([PROGRAM, "--step-sleep", "0.01"], env={**dirs_a, "DYNPROF_JOB_ID": JOB})
    (pid,) = target.ready_pids()
    hosts = [f"127.0.0.1:{a.port}", f"127.0.0.1:{b.port}"]
    # WHEN node b alone is asked for the job's stacks, and then node a for both nodes'
    code, alone = b.action("stacks", {"job": JOB, "no_save": True}, timeout=60)
    code_wide, wide = a.action("stacks", {"job": JOB, "no_save": True, "hosts": hosts}, timeout=60)
    # THEN node b answers its error structured, as the CLI's --json has it
    assert code == 200 and alone["exit_code"] != 0, alone
    assert isinstance(alone["error"]["type"], str) and alone["error"]["type"]  # the DynprofError's class
    assert alone["result"] == {"error": alone["error"]} and "job" in alone["error"]["message"]
    assert alone["error"]["exit_code"] == alone["exit_code"] and alone["error"]["message"]
    # AND the job-wide answer merges node a's rank, and names node b's error from that field
    assert code_wide == 200, wide
    members = [m["pid"] for g in wide["result"]["groups"] for m in g["members"]]
    assert members == [pid], wide["result"]
    by_node = {n["node"]: n for n in wide["result"]["nodes"]}
    assert by_node[hosts[0]]["ok"] is True
    assert by_node[hosts[1]]["ok"] is False and by_node[hosts[1]]["error"] == alone["error"]["message"]
