"""Record the committed trace fixtures of tests/unit/data/traces (CPU, torch.distributed gloo).

Runs tests/integration/programs/straggler_program.py as a 2-rank job under `dynprof run`, traces
it job-wide with `dynprof start --job J --steps 3`, and copies the artifacts (manifest and
trace.json.gz, in the store's layout) under tests/unit/data/traces/<name>/:

    slow1        rank 1 sleeps 60 ms per step in load_batch, rank 0 1 ms
    slow1_stack  the same, traced with --with-stack (Python functions named in the trace)
    even         both ranks sleep 20 ms per step in load_batch

    PYTHONPATH=. python tests/data/record_gloo_traces.py
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PROGRAM = ROOT / "tests" / "integration" / "programs" / "straggler_program.py"
OUT = ROOT / "tests" / "unit" / "data" / "traces"


def record(name: str, program_args: list[str], start_args: list[str]) -> None:
    store = Path(tempfile.mkdtemp(prefix="dp-store-"))
    run_dir = Path(tempfile.mkdtemp(prefix="dp-", dir="/tmp"))
    job = f"fixture-{name}"
    env = dict(os.environ, DYNPROF_ARTIFACT_DIR=str(store), DYNPROF_RUN_DIR=str(run_dir), DYNPROF_JOB_ID=job)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    procs = []
    try:
        for rank in (0, 1):
            penv = dict(env, RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
            cmd = [sys.executable, "-m", "dynprof", "run", "-q", "--", sys.executable, str(PROGRAM), *program_args]
            procs.append(subprocess.Popen(cmd, env=penv, stdout=subprocess.PIPE, text=True))
        for p in procs:
            assert p.stdout is not None
            line = p.stdout.readline()
            assert line.startswith("READY"), line
        time.sleep(1.0)
        cmd = [sys.executable, "-m", "dynprof", "start", "--job", job, "--steps", "3", "--json", *start_args]
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120, check=True)
        results = json.loads(done.stdout)["results"]
        dest = OUT / name
        shutil.rmtree(dest, ignore_errors=True)
        for res in results:
            art = Path(res["artifact"])
            shutil.copytree(art, dest / art.relative_to(store))
        print(f"{name}: {[r['artifact'] for r in results]}")
    finally:
        for p in procs:
            p.terminate()
            p.wait(timeout=30)
        shutil.rmtree(store, ignore_errors=True)
        shutil.rmtree(run_dir, ignore_errors=True)


def main() -> int:
    record("slow1", ["--slow-ranks", "1", "--load-ms", "60", "--base-load-ms", "1"], [])
    record("slow1_stack", ["--slow-ranks", "1", "--load-ms", "60", "--base-load-ms", "1"], ["--with-stack"])
    record("even", ["--load-ms", "20", "--base-load-ms", "20"], [])
    return 0


if __name__ == "__main__":
    sys.exit(main())
