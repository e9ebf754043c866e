#!/usr/bin/env python3
"""What one look of ``dynprof watch`` costs each rank of a hung job, and the watch itself, in CPU.

A look reads every rank's progress (the agent's status), its Python stacks twice
(``--look-interval`` apart, through its agent) and, for the ranks that do not wait with the
others, its native stack from outside (py-spy; the rank is paused while it is read). This
starts a 2-rank gloo job that hangs (rank 0 waits in all_reduce, rank 1 sleeps in Python, or
with ``--gpu`` blocks in ``.item()`` behind an endless CUDA kernel: the GPU fault program), then
runs ``dynprof watch --job J --once`` ``--looks`` times, and reads each rank's CPU time
(every thread's ``/proc/PID/task/TID/schedstat``, in ns) before and after each watch, and over windows of the same
length with no watch (the ranks' own CPU while hung: the baseline, measured in the same run,
alternating). What a look costs a rank is its CPU in a watch window less its CPU in a quiet one;
the watch's own CPU is its child's rusage.

    python scripts/bench_watch_look.py [--looks 6] [--gpu]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CLK = os.sysconf("SC_CLK_TCK")


def cpu_s(pid: int) -> float:
    """The CPU time of all the process's threads, in ns resolution (each thread's schedstat);
    the process's stat (10 ms ticks) where schedstat is not there."""
    total = 0
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            try:
                with open(f"/proc/{pid}/task/{tid}/schedstat") as fh:
                    total += int(fh.read().split()[0])
            except (OSError, ValueError, IndexError):
                pass  # a thread that just ended
        return total / 1e9
    except OSError:
        with open(f"/proc/{pid}/stat") as fh:
            fields = fh.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / CLK


def free_port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


def start_job(job: str, gpu: bool, env: dict[str, str]) -> list[subprocess.Popen[str]]:
    port = free_port()
    procs = []
    for rank in range(2):
        e = {**env, "RANK": str(rank), "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}
        e["DYNPROF_JOB_ID"] = job
        if gpu:
            prog = ["tests/gpu/programs/gpu_fault_program.py", "--fault", "item", "--at-step", "5"]
        else:
            prog = ["tests/integration/programs/hang_program.py", "--hold", "sleep", "--seconds", "600"]
        cmd = [sys.executable, "-m", "dynprof", "run", "-q", "--", sys.executable, *prog]
        procs.append(
            subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=e, cwd=ROOT)
        )
    return procs


def ready_pid(proc: subprocess.Popen[str], timeout: float = 240.0) -> int:
    deadline = time.monotonic() + timeout
    assert proc.stdout is not None
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            raise SystemExit(f"a rank exited before it was ready (exit {proc.poll()})")
        if line.startswith("READY "):
            return int(line.split()[1])
    raise SystemExit("a rank was not ready in time")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--looks", type=int, default=6)
    ap.add_argument("--gpu", action="store_true", help="CUDA ranks (the GPU fault program, rank 1 behind a kernel)")
    ap.add_argument("--look-interval", type=float, default=1.0)
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="dp-look-"))
    env = {**os.environ, "DYNPROF_RUN_DIR": str(tmp / "run"), "DYNPROF_ARTIFACT_DIR": str(tmp / "store")}
    env["PYTHONPATH"] = f"{ROOT}{os.pathsep}{env.get('PYTHONPATH', '')}"
    job = "benchlook"
    procs = start_job(job, args.gpu, env)
    try:
        pids = [ready_pid(p) for p in procs]
        time.sleep(3.0)  # past the stall time the watch is given
        watch = [
            sys.executable, "-m", "dynprof", "watch", "--job", job, "--once", "--json", "--stall-after", "2",
            "--look-interval", str(args.look_interval), "--no-healthcheck", "--no-save",
        ]  # fmt: skip
        quiet: list[list[float]] = []
        looked: list[list[float]] = []
        watch_cpu: list[float] = []
        walls: list[float] = []
        kinds: list[str] = []
        for n in range(args.looks):
            # a watch window, then a quiet window of the same wall length (order flips each round)
            order = ("watch", "quiet") if n % 2 == 0 else ("quiet", "watch")
            wall = walls[-1] if walls else 6.0
            for what in order:
                before = [cpu_s(p) for p in pids]
                t0 = time.monotonic()
                if what == "watch":
                    r0 = resource.getrusage(resource.RUSAGE_CHILDREN)
                    out = subprocess.run(watch, capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)
                    r1 = resource.getrusage(resource.RUSAGE_CHILDREN)
                    wall = time.monotonic() - t0
                    walls.append(wall)
                    watch_cpu.append((r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime))
                    events = [json.loads(x) for x in out.stdout.splitlines() if x.strip().startswith("{")]
                    kinds.append(",".join(e["verdict"]["kind"] for e in events if "verdict" in e) or "none")
                    looked.append([cpu_s(p) - b for p, b in zip(pids, before)])
                else:
                    time.sleep(wall)
                    quiet.append([cpu_s(p) - b for p, b in zip(pids, before)])
        print(f"{'CUDA' if args.gpu else 'CPU'} ranks, {args.looks} looks (one `watch --once` each), verdicts: {kinds}")
        print(f"watch wall per look: median {statistics.median(walls):.2f} s")
        print(
            f"watch process CPU per look (its own, and its py-spy children): median {statistics.median(watch_cpu) * 1000:.0f} ms"
        )
        for i, pid in enumerate(pids):
            extra = [lk[i] - q[i] for lk, q in zip(looked, quiet)]
            print(
                f"rank {i} (pid {pid}): CPU in a look's window {statistics.median(x[i] for x in looked) * 1000:.0f} ms, "
                f"in a quiet window {statistics.median(x[i] for x in quiet) * 1000:.0f} ms: a look costs it "
                f"median {statistics.median(extra) * 1000:.0f} ms (min {min(extra) * 1000:.0f}, max {max(extra) * 1000:.0f})"
            )
        return 0
    finally:
        for p in procs:
            p.kill()
            p.wait()


if __name__ == "__main__":
    raise SystemExit(main())
