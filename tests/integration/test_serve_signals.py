"""A real `dynprof serve` stopped by signals: two SIGTERMs back to back, again and again.

The handler runs on the main thread between two of its bytecodes, wherever that thread is: it
only appends to a list and writes a byte to a pipe, never takes a lock the interrupted thread
may hold (``Event.set`` from a handler deadlocked inside ``Event.wait``). Loopback only.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from tests._ports import free_port
from tests.support.serving import healthz

ROOT = Path(__file__).resolve().parents[2]
ROUNDS = 20
HANG_BOUND_S = 60.0  # only bounds a hang: a stop takes well under a second


def _serving(tmp_path: Path, round_: int) -> tuple[subprocess.Popen[bytes], Path]:
    token = tmp_path / "token"
    if not token.exists():
        token.write_text("two-sigterms-token-0123456789abcdef\n")
        token.chmod(0o600)
    port = free_port()
    env = dict(os.environ, DYNPROF_HOME=str(tmp_path / "home"), HOME=str(tmp_path))
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    log_path = tmp_path / f"serve-{round_}.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "dynprof", "serve", "--port", str(port), "--token-file", str(token),
             "--progress-every", "0"],
            stdout=log, stderr=log, env=env, cwd=ROOT,
        )  # fmt: skip
    deadline = time.monotonic() + HANG_BOUND_S
    while not healthz(port):
        assert proc.poll() is None and time.monotonic() < deadline, log_path.read_text()[-3000:]
        time.sleep(0.1)
    return proc, log_path


def test_two_sigterms_back_to_back_stop_serve_every_time(tmp_path):
    for round_ in range(ROUNDS):
        # GIVEN a sidecar that answers /healthz
        proc, log_path = _serving(tmp_path, round_)
        try:
            # WHEN it is sent SIGTERM twice, back to back (the second one lands while the first
            # is handled, or while the stop it asked for runs); later rounds wait a little longer
            # between them, to land the second one at other points
            os.kill(proc.pid, signal.SIGTERM)
            if round_ % 4:
                time.sleep(0.001 * (round_ % 4))
            os.kill(proc.pid, signal.SIGTERM)
            # THEN it exits (no deadlock in its handler), having said that it stopped; a second
            # signal that lands after the handlers are restored ends it as SIGTERM does
            try:
                code = proc.wait(HANG_BOUND_S)
            except subprocess.TimeoutExpired:
                raise AssertionError(f"round {round_}: serve did not exit after two SIGTERMs") from None
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        text = log_path.read_text()
        assert code in (0, -signal.SIGTERM), f"round {round_}: exit {code}\n{text[-3000:]}"
        assert "Traceback" not in text, text[-3000:]
        if code == 0:
            assert "dynprof: stopped serving" in text
