#!/usr/bin/env python3
"""dynprof demo: trace 3 steps of a running training job without touching it.

Starts a small real training loop under `dynprof run`, then runs the commands a user would
type in another terminal: `dynprof ps`, `dynprof start --steps 3`, `dynprof show`. Each
command is printed before its output. Artifacts go to a temporary store unless
DYNPROF_ARTIFACT_DIR is set.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROGRAM = ROOT / "tests" / "integration" / "programs" / "train_program.py"


def dynprof(*args: str) -> subprocess.CompletedProcess[str]:
    print(f"\n$ dynprof {' '.join(shlex.quote(a) for a in args)}", flush=True)
    result = subprocess.run([sys.executable, "-m", "dynprof", *args], text=True, cwd=str(ROOT))
    if result.returncode != 0:
        raise SystemExit(f"demo: `dynprof {args[0]}` failed with exit code {result.returncode}")
    return result


def main() -> int:
    os.environ.setdefault("DYNPROF_ARTIFACT_DIR", tempfile.mkdtemp(prefix="dynprof-demo-"))
    os.environ.setdefault("DYNPROF_RUN_DIR", tempfile.mkdtemp(prefix="dpdemo-", dir="/tmp"))
    os.environ["DYNPROF_JOB_ID"] = "demo"
    os.environ["PYTHONUNBUFFERED"] = "1"
    cmd = [
        sys.executable,
        "-m",
        "dynprof",
        "run",
        "--",
        sys.executable,
        str(PROGRAM),
        "--step-sleep",
        "0.02",
        "--width",
        "256",
        "--max-seconds",
        "120",
    ]
    print("$ dynprof run -- python train_program.py --step-sleep 0.02 --width 256 &   # the training job", flush=True)
    job = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, cwd=str(ROOT))
    try:
        assert job.stdout is not None
        line = job.stdout.readline()
        if not line.startswith("READY"):
            raise SystemExit(f"demo: the training job did not start (got {line!r})")
        pid = line.split()[1]
        print(f"training job running as pid {pid}", flush=True)
        dynprof("ps")
        dynprof("start", "--pid", pid, "--steps", "3")
        listing = subprocess.run(
            [sys.executable, "-m", "dynprof", "ls", "--kind", "trace", "--json"],
            capture_output=True,
            text=True,
            check=True,
            cwd=str(ROOT),
        )
        artifact = json.loads(listing.stdout)["artifacts"][0]["path"]
        dynprof("show", artifact)
        dynprof("ls", "--job", "demo")
        print(f"\nOpen the trace in https://ui.perfetto.dev or chrome://tracing: {artifact}/trace.json.gz")
    finally:
        job.terminate()
        job.wait(timeout=30)
    return 0


if __name__ == "__main__":
    sys.exit(main())
