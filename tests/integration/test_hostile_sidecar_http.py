"""A real `dynprof serve` (subprocess, loopback, a token file) attacked over HTTP as a hostile
client would: slow heads and bodies, idle connections, Content-Length values that are not
lengths, OPTIONS, wrong Content-Types, an Origin on another port; the warnings of a risky
command line; a token file that is not UTF-8. The harness is scripts/hostile_sidecar.py's.

Deadlines here are far bounds (a hang detector), never measurements: the figures are the
script's. Run with -s to see the server's peak RSS.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.scripts import load_script

ROOT = Path(__file__).resolve().parents[2]
THREADS = 4
DRIP_S = 2.0  # a byte every 2 s: far below any idle timeout, so only a whole-request deadline ends it
FAR_S = 30.0
RSS_TARGET_MB = 200


hs = load_script("hostile_sidecar")


@pytest.fixture(scope="module")
def server() -> Iterator[Any]:
    env = {"PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    with hs.Server(THREADS, ("--max-actions", "2"), env=env) as s:
        yield s


def _answers(server: Any) -> None:
    """/healthz and the API (with the token) both answer within the far bound."""
    got = hs.probe(server.port, FAR_S)
    assert got["healthz"][0] == 200, f"/healthz did not answer within {FAR_S} s: {got}"
    assert got["info"][0] == 200, f"/api/v1/info did not answer 200 within {FAR_S} s: {got}"


def _answers_busy(server: Any) -> None:
    """/healthz answers, and the API answers a token holder 200 or 429 with a Retry-After
    (busy with other token holders), within the far bound."""
    assert hs.healthz(server.port, FAR_S) is not None, f"/healthz did not answer within {FAR_S} s"
    status, headers, _ = hs.request(server.port, "GET", "/api/v1/info", timeout=FAR_S)
    assert status == 200 or (status == 429 and headers["retry-after"].isdigit()), status


def _answer_after_busy(server: Any) -> int | str:
    """The API's answer to a token holder, asked again on 429 (it says when: Retry-After) until
    200 or the far bound: the status, or what went wrong."""
    deadline = time.monotonic() + FAR_S
    got: int | str = "not asked"
    while time.monotonic() < deadline:
        try:
            status, headers, _ = hs.request(server.port, "GET", "/api/v1/info", timeout=FAR_S)
        except OSError as exc:
            return f"{type(exc).__name__}: {exc}"
        got = status
        if status != 429:
            return status
        time.sleep(min(float(headers.get("retry-after", "1")), 2.0))
    return got


def _wait_for_a_cut_off(counts: dict[str, int]) -> None:
    """Wait (at most 2 FAR_S) until the server has closed one of the dripping connections."""
    deadline = time.monotonic() + 2 * FAR_S
    while counts["closed_by_server"] == 0 and time.monotonic() < deadline:
        time.sleep(0.5)


def test_dripping_heads_do_not_starve_healthz_or_the_api(server):
    # GIVEN as many connections as the server has threads, each sending its head a byte at a time
    head = f"GET / HTTP/1.1\r\nHost: 127.0.0.1:{server.port}\r\n".encode()
    with hs.dripping(server.port, THREADS, head, DRIP_S) as counts:
        time.sleep(1)
        # WHEN a probe and a token holder ask THEN both are answered while the attack goes on
        _answers(server)
        # AND the server cuts the dripping connections off (a whole-request deadline, not an idle one)
        _wait_for_a_cut_off(counts)
    assert counts["closed_by_server"] > 0
    assert server.tracebacks() == 0, server.stderr()


def test_four_times_as_many_dripping_heads_do_not_starve_healthz(server):
    head = f"GET / HTTP/1.1\r\nHost: 127.0.0.1:{server.port}\r\n".encode()
    with hs.dripping(server.port, 4 * THREADS, head, DRIP_S):
        time.sleep(1)
        assert hs.healthz(server.port, FAR_S) is not None
    assert server.tracebacks() == 0, server.stderr()


def test_idle_connections_hold_no_worker(server):
    # GIVEN four times as many connections as threads that send nothing
    with hs.idle(server.port, 4 * THREADS):
        time.sleep(1)
        # THEN the server answers the others all the same
        _answers(server)


def test_a_dripping_body_does_not_starve_the_server(server):
    # GIVEN token holders' actions whose whole head came, then a body of 4096 bytes a byte at a time
    head = (
        f"POST /api/v1/actions/ps HTTP/1.1\r\nHost: 127.0.0.1:{server.port}\r\nAuthorization: Bearer {hs.TOKEN}\r\n"
        "Content-Type: application/json\r\nContent-Length: 4096\r\n\r\n"
    ).encode()
    with hs.dripping(server.port, THREADS, head, DRIP_S) as counts:
        time.sleep(1)
        # THEN the others are answered, and the dripping bodies are cut off (408)
        _answers_busy(server)
        _wait_for_a_cut_off(counts)
    assert counts["closed_by_server"] > 0
    assert server.tracebacks() == 0, server.stderr()


def test_token_holders_reading_slowly_leave_a_thread_to_the_others(server):
    # GIVEN as many token holders as threads downloading a 16 MiB file and never reading it
    path = hs.plant_big_file(server)
    with hs.slow_readers(server.port, THREADS, path):
        time.sleep(1)
        # WHEN a probe and another token holder ask
        # THEN the probe is answered, and so is the token holder: 200, or 429 with a Retry-After
        # at once (every thread but one is taken), never left waiting
        _answers_busy(server)
    # AND once they are gone, the API answers 200 again: at once, or after a 429 while the
    # threads that wrote to them learn that they closed (when not: the server's own log says why)
    got = _answer_after_busy(server)
    assert got == 200, f"{got}\n{server.stderr()}"
    assert server.tracebacks() == 0, server.stderr()


def test_malformed_content_length_is_400_without_traceback_and_frees_the_worker(server):
    # WHEN requests carry Content-Length values that are not lengths (negative, signed, hex, lists)
    answers = hs.bad_lengths(server.port)
    # THEN each is answered at once with 400 (or 413 for a huge one), never left to time out
    for value, status in answers.items():
        expected = "413" if value.isascii() and value.isdigit() else "400"
        assert status.startswith(f"HTTP/1.1 {expected}"), (value, status)
    # AND nothing is printed but one line each at most, and the next requests are answered
    assert server.tracebacks() == 0, server.stderr()
    _answers(server)


def test_options_wrong_content_type_and_another_port_are_refused(server):
    auth_json = {"Content-Type": "application/json"}
    # OPTIONS on an action: 405, POST only
    status, headers, _ = hs.request(server.port, "OPTIONS", "/api/v1/actions/ps")
    assert status == 405 and headers["allow"] == "POST"
    # an action's body sent as a form or as text: 415
    for ctype in ("text/plain", "application/x-www-form-urlencoded"):
        status = hs.request(server.port, "POST", "/api/v1/actions/ps", b"{}", {"Content-Type": ctype})[0]
        assert status == 415, ctype
    # a page of another server on this machine (another port): 403
    other = {"Origin": f"http://127.0.0.1:{server.port + 1}", **auth_json}
    assert hs.request(server.port, "POST", "/api/v1/actions/ps", b"{}", other)[0] == 403
    assert hs.request(server.port, "GET", "/api/v1/info", None, other)[0] == 403
    # and this server's own origin, JSON body: served
    own = {"Origin": f"http://127.0.0.1:{server.port}", **auth_json}
    assert hs.request(server.port, "GET", "/api/v1/info", None, own)[0] == 200
    assert server.tracebacks() == 0, server.stderr()


def test_peak_rss_of_the_attacked_server(server):
    # after every attack above: the server's peak RSS, sampled every 50 ms
    time.sleep(0.2)
    mb = server.peak_rss / 1e6
    print(f"\nsidecar peak RSS during the attacks: {mb:.1f} MB (target < {RSS_TARGET_MB} MB)")
    assert 0 < mb < RSS_TARGET_MB
    assert server.tracebacks() == 0, server.stderr()


def _serve(args: list[str], tmp_path: Path, wait_for: str = "serving on") -> tuple[int | None, str]:
    """Start `dynprof serve ARGS`, wait for ``wait_for`` in its stderr or its exit, stop it;
    (exit code or None when it was stopped, stderr)."""
    err = tmp_path / "serve.stderr"
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
        "DYNPROF_RUN_DIR": str(tmp_path / "run"),
        "DYNPROF_ARTIFACT_DIR": str(tmp_path / "artifacts"),
    }
    env.pop("DYNPROF_TOKEN_FILE", None)
    (tmp_path / "run").mkdir(mode=0o700, exist_ok=True)
    with open(err, "wb") as fh:
        proc = subprocess.Popen([sys.executable, "-m", "dynprof", "serve", *args], stderr=fh, env=env)
    try:
        deadline = time.monotonic() + 60
        while wait_for not in err.read_text(errors="replace") and proc.poll() is None:
            assert time.monotonic() < deadline, err.read_text(errors="replace")
            time.sleep(0.1)
        code = proc.poll()
    finally:
        if proc.poll() is None:
            proc.terminate()
            proc.wait(20)
    return code, err.read_text(errors="replace")


def test_a_token_on_the_command_line_and_plain_http_on_every_address_are_warned(tmp_path):
    # WHEN the sidecar is started on every address without TLS, with the token in its argv
    port = hs.free_port()
    _, err = _serve(["--host", "0.0.0.0", "--port", str(port), "--token", hs.TOKEN], tmp_path)
    # THEN it says both, each with what to do instead
    lines = [x for x in err.splitlines() if x.startswith("dynprof: warning:")]
    assert any("--token" in x and "process list" in x and "--token-file" in x for x in lines), err
    assert any("0.0.0.0" in x and "in clear" in x and "--certfile" in x for x in lines), err


def test_loopback_and_a_token_file_are_not_warned(tmp_path):
    token = tmp_path / "token"
    token.write_text(hs.TOKEN + "\n")
    token.chmod(0o600)
    _, err = _serve(["--port", str(hs.free_port()), "--token-file", str(token)], tmp_path)
    assert "serving on" in err and "warning" not in err, err


def test_a_token_file_that_is_not_utf8_is_refused(tmp_path):
    # GIVEN a private token file of 30 bytes that are not UTF-8
    token = tmp_path / "token"
    token.write_bytes(b"\xfe" * 30 + b"\n")
    token.chmod(0o600)
    # WHEN serve is asked to use it THEN it refuses to start, saying why, and serves nothing
    code, err = _serve(["--port", str(hs.free_port()), "--token-file", str(token)], tmp_path)
    assert code is not None and code != 0
    assert "not UTF-8" in err and "serving on" not in err and "Traceback" not in err, err


def _https_healthz(port: int, ctx: Any, timeout: float) -> bool:
    import http.client

    conn = http.client.HTTPSConnection("127.0.0.1", port, timeout=timeout, context=ctx)
    try:
        conn.request("GET", "/healthz")
        resp = conn.getresponse()
        return resp.status == 200 and resp.read() == b"ok\n"
    except OSError:
        return False
    finally:
        conn.close()


def test_tls_connections_that_never_say_hello_do_not_stop_the_server(tmp_path):
    import shutil
    import ssl

    openssl = shutil.which("openssl")
    if openssl is None:
        pytest.skip("needs the openssl command to make a self-signed certificate")
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    made = subprocess.run(
        [openssl, "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=127.0.0.1",
         "-keyout", str(key), "-out", str(cert)],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    if made.returncode != 0:
        pytest.skip(f"openssl could not make a certificate: {made.stderr[-300:]!r}")
    ctx = ssl.create_default_context(cafile=str(cert))
    ctx.check_hostname = False
    env = {"PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    server = hs.Server(THREADS, ("--max-actions", "2", "--certfile", str(cert), "--keyfile", str(key)), env=env)
    server.base.joinpath("run").mkdir(mode=0o700)
    with open(server.stderr_path, "wb") as err:
        server.proc = subprocess.Popen(
            [sys.executable, "-m", "dynprof", "serve", "--port", str(server.port), "--token-file",
             str(server.token_file), "--threads", str(THREADS), *server.args],
            stdout=subprocess.DEVNULL, stderr=err, env=server.env,
        )  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while not _https_healthz(server.port, ctx, 2):
            assert server.proc.poll() is None and time.monotonic() < deadline, server.stderr()
            time.sleep(0.2)
        # GIVEN TCP connections to the TLS port that never start the handshake, more than threads
        with hs.idle(server.port, 2 * THREADS):
            time.sleep(1)
            # WHEN a probe asks over TLS THEN it is answered (the handshake holds no shared thread)
            assert _https_healthz(server.port, ctx, FAR_S), server.stderr()
        assert server.tracebacks() == 0, server.stderr()
    finally:
        server.stop()
