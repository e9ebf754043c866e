"""A job whose id is not UTF-8 (``DYNPROF_JOB_ID=$'bad\\xff'`` in its environment) is one job
with an odd name: never a sidecar whose ``/metrics`` and page fail for every job of the node,
never an agent that writes into the job's stderr on every status request."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from tests._ports import free_port
from tests.support.serving import serve, write_token
from tests.support.waiting import wait_for

ROOT = Path(__file__).resolve().parent.parent.parent
TOKEN = "hostile-text-token-0123456789abcdef"
PROGRAM = "tests/integration/programs/train_program.py"


def _wait(pred, timeout: float = 120.0, what: str = "condition", seen=lambda: ""):
    """Until ``pred()`` is true; past the deadline, an error that says ``what`` and ``seen()``."""
    return wait_for(pred, timeout, what, seen)


def _tails(folder: Path, *names: str) -> str:
    """The last lines of each log ``names`` in ``folder`` (what the processes said)."""
    out = []
    for name in names:
        try:
            lines = (folder / name).read_bytes().decode(errors="replace").splitlines()
        except OSError as exc:
            lines = [f"(unreadable: {exc})"]
        out.append(f"--- {name}, last lines:\n" + "\n".join(lines[-15:]))
    return "\n".join(out)


def _environb(**extra: bytes) -> dict[bytes, bytes]:
    """This test's environment as bytes, with this checkout's dynprof first on the path (the
    agent inside the job is the one under test), and ``extra`` set."""
    env = {k: v for k, v in os.environb.items() if k != b"DYNPROF_TOKEN_FILE"}
    path = env.get(b"PYTHONPATH", b"")
    env[b"PYTHONPATH"] = os.fsencode(ROOT) + (b":" + path if path else b"")
    env[b"PYTHONUNBUFFERED"] = b"1"
    env.update(extra)
    return env


def _get(port: int, path: str) -> tuple[int, bytes]:
    request = urllib.request.Request(f"http://127.0.0.1:{port}{path}", headers={"Authorization": f"Bearer {TOKEN}"})
    try:
        with urllib.request.urlopen(request, timeout=30) as answer:
            return answer.status, answer.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()
    except OSError:
        return 0, b""


def _job(job_id: bytes, log: Path) -> subprocess.Popen[bytes]:
    with open(log, "wb") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "dynprof", "run", "-q", "--", sys.executable, PROGRAM, "--step-sleep", "0.05"],
            env=_environb(DYNPROF_JOB_ID=job_id, RANK=b"0", WORLD_SIZE=b"1"),
            stdout=subprocess.DEVNULL,
            stderr=out,
            cwd=str(ROOT),
            start_new_session=True,
        )


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)


def test_a_job_id_that_is_not_utf8_fails_neither_the_sidecar_nor_the_jobs_output(tmp_path, cli):
    # GIVEN a real job started with DYNPROF_JOB_ID=$'bad\xff', another job of the same node, and
    # a real `dynprof serve` polling every agent every 0.5 s
    token = write_token(tmp_path / "token", TOKEN + "\n")
    port = free_port()
    bad = _job(b"bad\xff", tmp_path / "bad.err")
    good = _job(b"good", tmp_path / "good.err")
    with open(tmp_path / "serve.err", "wb") as log:
        server = serve(
            port,
            token,
            "--progress-every",
            "0.5",
            env=_environb(),
            stdout=subprocess.DEVNULL,
            stderr=log,
            cwd=str(ROOT),
            start_new_session=True,
        )
    try:

        def progress() -> dict | None:
            code, body = _get(port, "/api/progress")
            return json.loads(body) if code == 200 else None

        last: list[dict | None] = [None]

        def both_listed() -> dict | None:
            p = last[0] = progress()
            ranks = (p or {}).get("ranks", [])
            good_steps = [r["step"] for r in ranks if r["job"] == "good"]
            return p if len(ranks) == 2 and good_steps and good_steps[0] > 0 else None

        def seen() -> str:
            state = (
                f"jobs running: bad {bad.poll() is None}, good {good.poll() is None}, sidecar {server.poll() is None}"
            )
            return f"last progress: {last[0]}\n{state}\n" + _tails(tmp_path, "bad.err", "good.err", "serve.err")

        _wait(both_listed, what="both jobs in the sidecar's progress, the good one stepping", seen=seen)
        # WHEN the sidecar's pollers have asked the job's agent for its status ten more times
        polls: set[float] = set()

        def ten_polls() -> bool:
            for r in (progress() or {}).get("ranks", []):
                if r["job"] != "good":
                    polls.add(r["polled_at"])
            return len(polls) >= 10

        _wait(ten_polls, what="ten polls of the job's agent", seen=seen)
        metrics_code, metrics = _get(port, "/metrics")
        page_code, page = _get(port, "/")
        shown = cli("ps", "--json", timeout=120)
        p = progress()
    finally:
        _stop(bad)
        _stop(good)
        _stop(server)
    # THEN /metrics answers with every job's series, the bad id as its escaped text
    assert metrics_code == 200, (tmp_path / "serve.err").read_text()
    samples = [s for f in text_string_to_metric_families(metrics.decode()) for s in f.samples]
    up = {s.labels["job_id"]: s.value for s in samples if s.name == "dynprof_rank_agent_up"}
    assert up == {"good": 1.0, "bad\\xff": 1.0}
    assert any(s.name == "dynprof_rank_steps_total" and s.labels["job_id"] == "good" for s in samples)
    # and the page answers, naming both jobs
    assert page_code == 200
    assert "bad\\xff" in page.decode() and "good" in page.decode()
    # and the job's agent answers its status (it is up, in the progress and in ps)
    assert p is not None and {r["job"]: r["agent"] for r in p["ranks"]}["bad\\xff"] == "up"
    assert shown.returncode == 0, shown.stderr
    assert "bad\\xff" in {a["job"] for a in json.loads(shown.stdout)["agents"]}
    # and the job's stderr holds at most one line of dynprof's
    said = [line for line in (tmp_path / "bad.err").read_bytes().split(b"\n") if line.startswith(b"dynprof")]
    assert len(said) <= 1, said
