#!/usr/bin/env python3
"""Produce the small real CUDA memory artifact kept in tests/data (run on a GPU machine).

Runs tests/integration/programs/oom_program.py under `dynprof run` with a 1000-event history and
a 1 GiB cap on the process's share of the GPU (set_per_process_memory_fraction), so the
caching allocator raises a real OutOfMemoryError quickly and the snapshot stays small; copies
the `memory` artifact dynprof wrote at the OOM to OUT/memory_oom_artifact.

    python tests/data/make_memory_snapshot.py --out tests/data
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent.parent


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=str(ROOT / "tests" / "data"))
    parser.add_argument(
        "--leak-policy",
        action="append",
        default=[],
        metavar="POLICY",
        help="instead: the launch-bound leaking loop (oom_leak_program.py) under this history policy, "
        "copied to OUT/memory_leak_<policy>_artifact (repeatable)",
    )
    args = parser.parse_args()
    if args.leak_policy:
        return max(_leak(args.out, policy) for policy in args.leak_policy)
    program = [str(ROOT / "tests/integration/programs/oom_program.py")]
    program += ["--limit-gb", "1", "--width", "1024", "--grow-mb", "32", "--warmup-steps", "50"]
    return _capture("1000", program, Path(args.out) / "memory_oom_artifact")


def _leak(out: str, policy: str) -> int:
    program = [str(ROOT / "tests/integration/programs/oom_leak_program.py")]
    program += ["--workload", "launch", "--warmup-seconds", "3", "--leak-mb", "2", "--limit-gb", "0.5"]
    return _capture(policy, program, Path(out) / f"memory_leak_{policy.replace(':', '_').replace('%', '')}_artifact")


def _capture(policy: str, program: list[str], dest: Path) -> int:
    """Run PROGRAM under `dynprof run --memory-history POLICY` and copy its one memory artifact to DEST."""
    with tempfile.TemporaryDirectory() as tmp:
        env = dict(
            os.environ,
            DYNPROF_ARTIFACT_DIR=str(Path(tmp) / "art"),
            DYNPROF_RUN_DIR=str(Path(tmp) / "run"),
            PYTHONUNBUFFERED="1",
        )
        cmd = [sys.executable, "-m", "dynprof", "run", "--memory-history", policy, "--job-id", "testdata", "--"]
        cmd += [sys.executable, *program]
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
        print(proc.stdout[-2000:])
        print(proc.stderr[-3000:], file=sys.stderr)
        manifests = list((Path(tmp) / "art").rglob("manifest.json"))
        if len(manifests) != 1:
            print(f"{policy}: expected one artifact, found {len(manifests)}", file=sys.stderr)
            return 1
        shutil.rmtree(dest, ignore_errors=True)
        shutil.copytree(manifests[0].parent, dest)
        for f in sorted(dest.iterdir()):
            print(f"{policy} {f.name}: {f.stat().st_size} bytes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
