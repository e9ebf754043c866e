"""The sidecar's ``healthcheck`` action on real GPUs: a real `dynprof serve` on a loopback port
runs the checks its request names in its child process (run on the GPU machine: pytest -m gpu).

The action carries the healthcheck's request (``HealthcheckRequest``): what it reads, the runner
gets (the level, the devices expected, the checks skipped, not saving), and a value it refuses
is the healthcheck's "could not run" (3) before any check starts.
"""

from __future__ import annotations

import http.client
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests._ports import free_port

ROOT = Path(__file__).resolve().parents[2]
TOKEN = "sidecar-healthcheck-gpu-token-0123456789"
pytestmark = pytest.mark.gpu


class Served:
    def __init__(self, proc: subprocess.Popen[bytes], port: int, stderr: Path) -> None:
        self.proc, self.port, self.stderr = proc, port, stderr

    def action(self, name: str, options: dict[str, Any], timeout: float = 300) -> tuple[int, dict[str, Any]]:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        try:
            conn.request(
                "POST",
                f"/api/v1/actions/{name}",
                body=json.dumps({"options": options, "timeout": timeout}).encode(),
                headers={"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"},
            )
            resp = conn.getresponse()
            return resp.status, json.loads(resp.read())
        finally:
            conn.close()


@pytest.fixture
def served(dynprof_dirs, tmp_path) -> Iterator[Served]:
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    token_file.chmod(0o600)
    port = free_port()
    stderr = tmp_path / "serve.stderr"
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    with open(stderr, "wb") as err:
        proc = subprocess.Popen(
            [sys.executable, "-m", "dynprof", "serve", "--port", str(port), "--token-file", str(token_file)],
            stdout=subprocess.DEVNULL,
            stderr=err,
            env=env,
            cwd=str(ROOT),
        )
    side = Served(proc, port, stderr)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                conn = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
                conn.request("GET", "/healthz")
                if conn.getresponse().status == 200:
                    break
            except OSError:
                pass
            assert proc.poll() is None and time.monotonic() < deadline, stderr.read_text(errors="replace")
            time.sleep(0.1)
        yield side
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


def _gpu_count() -> int:
    import torch

    return torch.cuda.device_count()


def test_the_healthcheck_action_reads_every_device_with_the_options_it_was_given(served, dynprof_dirs):
    n = _gpu_count()
    # WHEN the sidecar is asked for a quick healthcheck expecting this node's devices
    status, answer = served.action("healthcheck", {"level": "quick", "expect_devices": n})
    # THEN its child read every device through NVML and saved the report as an artifact
    assert status == 200, answer
    report = answer["result"]
    assert answer["exit_code"] in (0, 1, 2) and answer["error"] is None, answer
    assert report["level"] == "quick" and len(report["devices"]) == n, report["devices"]
    devices = [c for c in report["checks"] if c["name"] == "devices"]
    assert devices and devices[0]["status"] == "pass", devices
    assert report["artifact"] and Path(report["artifact"]).is_dir()
    assert str(dynprof_dirs["artifacts"]) in report["artifact"]
    print(f"\nquick through the sidecar: exit {answer['exit_code']}, {answer['elapsed_s']} s")

    # WHEN it is asked for one device more than there are, skipping two checks, not saving
    status, answer = served.action(
        "healthcheck", {"expect_devices": n + 1, "skip": ["temperature", "xid_live"], "no_save": True}
    )
    # THEN the missing device fails the node (2: drain), the skipped checks are said skipped,
    # and no artifact was written
    assert status == 200, answer
    report = answer["result"]
    assert answer["exit_code"] == 2, answer
    devices = [c for c in report["checks"] if c["name"] == "devices"]
    assert devices and devices[0]["status"] == "fail", devices
    assert devices[0]["expected"] == str(n + 1), devices
    skipped = {c["name"] for c in report["checks"] if c["status"] == "skipped"}
    assert {"temperature", "xid_live"} <= skipped, skipped
    assert report["artifact"] is None


def test_a_healthcheck_option_it_refuses_is_could_not_run_before_any_check(served):
    status, answer = served.action("healthcheck", {"level": "thorough"})
    assert status == 200 and answer["exit_code"] == 3, answer
    assert answer["error"]["type"] == "UsageError" and "--level 'thorough'" in answer["error"]["message"]
