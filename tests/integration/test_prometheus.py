"""A real Prometheus server (Debian's ``prometheus``, on loopback) scrapes a real sidecar of a
running training job with the sidecar's bearer token and evaluates the SHIPPED alert rules
unchanged: the scrape is up, the series are there, and when the job stops stepping the stall
alert fires. Skipped where ``prometheus`` is not installed."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests._ports import free_port
from tests.support.procs import terminate

ROOT = Path(__file__).resolve().parents[2]
RULES = ROOT / "scripts" / "deploy" / "prometheus" / "dynprof-alerts.yml"
PROMETHEUS = shutil.which("prometheus")
TOKEN = "prometheus-test-token-0123456789"

pytestmark = pytest.mark.skipif(
    PROMETHEUS is None, reason="prometheus is not installed (Debian: apt install prometheus)"
)


def wait_for(
    what: str, pred: Callable[[], Any], timeout: float = 180.0, procs: tuple[subprocess.Popen[bytes], ...] = ()
) -> Any:
    """``pred()``'s first true value; a far deadline, a hang detector."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        for p in procs:
            assert p.poll() is None, f"{p.args[0]} exited ({p.returncode}) while waiting for {what}"
        try:
            value = pred()
        except OSError as exc:  # not listening yet
            last = exc
        else:
            if value:
                return value
            last = value
        time.sleep(0.5)
    raise AssertionError(f"{what}: not seen within {timeout} s (last: {last!r})")


def api(port: int, path: str, **params: str) -> Any:
    url = f"http://127.0.0.1:{port}/api/v1/{path}" + (f"?{urllib.parse.urlencode(params)}" if params else "")
    with urllib.request.urlopen(url, timeout=10) as answer:
        doc = json.loads(answer.read())
    assert doc["status"] == "success", doc
    return doc["data"]


def query(port: int, expr: str) -> list[dict[str, Any]]:
    return list(api(port, "query", query=expr)["result"])


def start(argv: list[str], log: Path, env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    with open(log, "wb") as out:  # the child keeps its own descriptor
        return subprocess.Popen(
            argv, stdout=out, stderr=subprocess.STDOUT, cwd=str(ROOT), env=env, start_new_session=True
        )


def stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        terminate(proc, 15)


def test_prometheus_scrapes_the_sidecar_and_the_stall_alert_fires(spawn, tmp_path):
    # GIVEN a training rank with its agent, stepping every ~50 ms
    rank = spawn(
        ["tests/integration/programs/train_program.py", "--step-sleep", "0.05", "--max-seconds", "600"],
        env={"DYNPROF_JOB_ID": "promjob", "RANK": "0", "WORLD_SIZE": "1"},
    )
    (pid,) = rank.ready_pids()
    token = tmp_path / "token"
    token.write_text(TOKEN + "\n")
    token.chmod(0o600)
    # AND the node's sidecar polling it twice a second, with a 3 s stall time
    sidecar_port, prom_port = free_port(), free_port()
    env = {**os.environ, "DYNPROF_HOST": "node-p"}
    env.pop("DYNPROF_TOKEN_FILE", None)
    sidecar = start(
        [
            sys.executable,
            "-m",
            "dynprof",
            "serve",
            "--port",
            str(sidecar_port),
            "--token-file",
            str(token),
            "--progress-every",
            "0.5",
            "--stall-after",
            "3",
        ],
        tmp_path / "serve.log",
        env,
    )
    # AND Prometheus scraping it every second with the token, evaluating the shipped rules
    config = tmp_path / "prometheus.yml"
    config.write_text(
        "global: {scrape_interval: 1s, evaluation_interval: 1s, scrape_timeout: 1s}\n"
        f"rule_files: [{json.dumps(str(RULES))}]\n"
        "scrape_configs:\n"
        "  - job_name: dynprof\n"
        f"    authorization: {{type: Bearer, credentials_file: {json.dumps(str(token))}}}\n"
        f"    static_configs: [{{targets: ['127.0.0.1:{sidecar_port}']}}]\n"
    )
    assert PROMETHEUS is not None
    prometheus = start(
        [
            PROMETHEUS,
            f"--config.file={config}",
            f"--storage.tsdb.path={tmp_path / 'tsdb'}",
            f"--web.listen-address=127.0.0.1:{prom_port}",
            "--storage.tsdb.retention.time=1h",
        ],
        tmp_path / "prometheus.log",
    )
    stopped = False
    try:
        procs = (sidecar, prometheus)
        # WHEN Prometheus has scraped a few times
        targets = wait_for(
            "the sidecar's scrape up",
            lambda: [t for t in api(prom_port, "targets")["activeTargets"] if t["health"] == "up"],
            procs=procs,
        )
        # THEN the scrape is up, with the token (no 401), and the rank's series are there
        assert targets[0]["labels"]["job"] == "dynprof" and not targets[0]["lastError"]
        steps = wait_for(
            "the rank's steps advancing",
            lambda: query(prom_port, 'increase(dynprof_rank_steps_total{job_id="promjob"}[10s]) > 0'),
            procs=procs,
        )
        assert steps[0]["metric"]["host"] == "node-p" and steps[0]["metric"]["rank"] == "0"
        for name in (
            "dynprof_rank_step_seconds_bucket",
            "dynprof_rank_seconds_since_step",
            "dynprof_rank_agent_up",
            "dynprof_stall_after_seconds",
        ):
            assert query(prom_port, f'{name}{{job_id="promjob"}}'), name
        assert query(prom_port, 'dynprof_stall_after_seconds{job_id="promjob"}')[0]["value"][1] == "3"
        labels = set().union(*(r["metric"] for r in query(prom_port, '{job_id="promjob"}')))
        assert labels <= {"__name__", "job", "instance", "job_id", "host", "rank", "le", "kind"}

        # WHEN the rank stops stepping (SIGSTOP)
        os.kill(pid, signal.SIGSTOP)
        stopped = True
        # THEN the shipped DynprofJobStalled alert fires for the job
        firing = wait_for(
            "DynprofJobStalled firing",
            lambda: [
                a
                for a in api(prom_port, "alerts")["alerts"]
                if a["labels"]["alertname"] == "DynprofJobStalled" and a["state"] == "firing"
            ],
            procs=procs,
        )
        assert firing[0]["labels"]["job_id"] == "promjob" and firing[0]["labels"]["severity"] == "critical"
        assert float(firing[0]["value"]) > 3
    except AssertionError:
        for log in ("serve.log", "prometheus.log"):
            print(f"--- {log}\n" + (tmp_path / log).read_text(errors="replace")[-4000:])
        raise
    finally:
        if stopped:
            os.kill(pid, signal.SIGCONT)
        stop(prometheus)
        stop(sidecar)
