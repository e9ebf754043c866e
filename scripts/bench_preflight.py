#!/usr/bin/env python3
"""Wall time of a job-wide preflight (`dynprof healthcheck --hosts ...`) over simulated nodes.

Each simulated node is a `dynprof serve` on its own loopback address (127.0.0.N) with its own
run directory and artifact store; the CLI asks every node's sidecar for its healthcheck at once
and judges the reports together. Printed: per run, the wall time of the whole command, the
nodes' own healthcheck times (median, max) and the fan-out overhead (wall time minus the
slowest node's healthcheck); then a paper estimate for 128 and 1024 nodes x 8 GPUs from the
measured overhead per node and the per-node GPU figures of docs/healthcheck.md.

This machine's nodes share its few cores: the per-node time here grows with the node count
(every node's checks run at once on the same CPUs), which a real fleet does not do. The
estimate therefore takes the fan-out's own cost per node from the runs, not the per-node time.

    python scripts/bench_preflight.py --nodes 8,16,32,64 --level quick

:class:`SimFleet` is also what tests/integration/test_healthcheck_fleet_simulated.py starts its nodes with
(``slow`` nodes run in a cgroup limited to a small share of one CPU).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
TOKEN = "bench-preflight-token-0123456789abcdef"
# docs/healthcheck.md, "Measured on H200": the standard level on 2 x H200 took 12.6 s (whole
# command), functional checks 11.8-12.6 s; quick 0.61 s. Functional checks run per device in
# parallel (one worker each), the all-reduce over all devices: 8 GPUs cost about what 2 do, plus
# the all-reduce's larger group; the estimate below adds 20 % for it.
H200_STANDARD_S = 12.6
H200_QUICK_S = 0.61
EIGHT_GPU_FACTOR = 1.2


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


@dataclass
class SimNode:
    host: str
    port: int
    run_dir: Path
    proc: subprocess.Popen[bytes]

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"


def cpu_cgroup_root() -> Path | None:
    """Where a CPU-limited cgroup can be made here (v2: the unified root with the cpu
    controller; v1: the cpu hierarchy), or None."""
    v2 = Path("/sys/fs/cgroup")
    if (v2 / "cgroup.controllers").is_file() and "cpu" in (v2 / "cgroup.controllers").read_text().split():
        candidates = [v2]
    else:
        candidates = [v2 / "cpu", v2 / "cpu,cpuacct"]
    for root in candidates:
        probe = root / f"dynprof-probe-{os.getpid()}"
        try:
            probe.mkdir()
        except OSError:
            continue
        probe.rmdir()
        return root
    return None


def limit_cpu(pid: int, name: str, fraction: float) -> Path:
    """Put process ``pid`` (and so every child it starts from now on) in a new cgroup that may
    use ``fraction`` of one CPU."""
    root = cpu_cgroup_root()
    if root is None:
        raise RuntimeError("no writable cgroup with the cpu controller here")
    group = root / name
    group.mkdir(exist_ok=True)
    period = 100_000
    if (group / "cpu.max").exists():
        (group / "cpu.max").write_text(f"{int(period * fraction)} {period}\n")
    else:
        (group / "cpu.cfs_period_us").write_text(f"{period}\n")
        (group / "cpu.cfs_quota_us").write_text(f"{int(period * fraction)}\n")
    (group / "cgroup.procs").write_text(f"{pid}\n")
    return group


@dataclass
class SimFleet:
    """``count`` sidecars on 127.0.0.2, 127.0.0.3, ...; the nodes in ``slow`` are honestly
    slower, not scaled: once its sidecar listens, it is moved into a cgroup that may use
    ``slow_cpu`` (default 5 %) of one CPU, so the healthcheck it starts, and the measurements
    that healthcheck makes, get that much."""

    count: int
    workdir: Path
    slow: frozenset[int] = frozenset()
    slow_cpu: float = 0.05
    serve_args: dict[int, list[str]] = field(default_factory=dict)  # more `dynprof serve` options, by node
    nodes: list[SimNode] = field(default_factory=list)
    cgroups: list[Path] = field(default_factory=list)

    @property
    def token_file(self) -> Path:
        return self.workdir / "token"

    def start(self, timeout: float = 120.0) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.token_file.write_text(TOKEN + "\n")
        self.token_file.chmod(0o600)
        for i in range(self.count):
            host = f"127.0.0.{i + 2}"
            port = free_port(host)
            run_dir = Path(tempfile.mkdtemp(prefix=f"dp-pre{i}-", dir="/tmp"))
            env = {
                **os.environ,
                "DYNPROF_RUN_DIR": str(run_dir),
                "DYNPROF_ARTIFACT_DIR": str(self.workdir / f"store-{i}"),
                "DYNPROF_HOST": f"sim{i}",
                "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
            }
            env.pop("DYNPROF_TOKEN_FILE", None)
            cmd = [sys.executable, "-m", "dynprof", "serve", "--host", host, "--port", str(port)]
            cmd += ["--token-file", str(self.token_file), *self.serve_args.get(i, [])]
            with open(self.workdir / f"serve-{i}.log", "wb") as log:
                proc = subprocess.Popen(
                    cmd, env=env, cwd=str(ROOT), stdout=subprocess.DEVNULL, stderr=log, start_new_session=True
                )
            self.nodes.append(SimNode(host, port, run_dir, proc))
        deadline = time.monotonic() + timeout
        for node in self.nodes:
            while True:
                if node.proc.poll() is not None:
                    raise RuntimeError(f"dynprof serve on {node.address} exited: see {self.workdir}")
                try:
                    with socket.create_connection((node.host, node.port), timeout=1):
                        break
                except OSError:
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"dynprof serve on {node.address} is not listening") from None
                    time.sleep(0.1)
        for i in sorted(self.slow):
            name = f"dynprof-slow-node-{os.getpid()}-{i}"
            self.cgroups.append(limit_cpu(self.nodes[i].proc.pid, name, self.slow_cpu))

    def hosts(self, indices: list[int] | None = None) -> str:
        chosen = self.nodes if indices is None else [self.nodes[i] for i in indices]
        return ",".join(n.address for n in chosen)

    def stop(self) -> None:
        for node in self.nodes:
            if node.proc.poll() is None:
                try:
                    os.killpg(node.proc.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        for node in self.nodes:
            try:
                node.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(node.proc.pid, signal.SIGKILL)
                node.proc.wait(timeout=15)
            shutil.rmtree(node.run_dir, ignore_errors=True)
        for group in self.cgroups:
            for _ in range(50):  # its processes are gone once the kernel has reaped them
                try:
                    group.rmdir()
                    break
                except OSError:
                    time.sleep(0.1)

    def __enter__(self) -> SimFleet:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def preflight(
    fleet: SimFleet, extra: list[str], indices: list[int] | None = None, timeout: float = 900.0
) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    env["DYNPROF_TOKEN_FILE"] = str(fleet.token_file)
    cmd = [sys.executable, "-m", "dynprof", "healthcheck", "--hosts", fleet.hosts(indices), "--json", "-q", *extra]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=str(ROOT))


def measure(count: int, level: str, workdir: Path) -> dict[str, Any]:
    with SimFleet(count, workdir / f"n{count}") as fleet:
        t0 = time.monotonic()
        out = preflight(fleet, ["--level", level, "--expect-devices", "0", "--no-save"])
        wall = time.monotonic() - t0
    if not out.stdout.strip():
        raise RuntimeError(f"no answer at {count} nodes: {out.stderr[-2000:]}")
    doc = json.loads(out.stdout)
    durations = [n["duration_s"] for n in doc["nodes"] if n["duration_s"] is not None]
    elapsed = [n["elapsed_s"] for n in doc["nodes"] if n["elapsed_s"] is not None]
    return {
        "nodes": count,
        "exit_code": out.returncode,
        "answered": sum(1 for n in doc["nodes"] if n["answered"]),
        "wall_s": wall,
        "node_check_median_s": statistics.median(durations) if durations else None,
        "node_check_max_s": max(durations) if durations else None,
        "node_answer_max_s": max(elapsed) if elapsed else None,
        "overhead_s": wall - (max(durations) if durations else 0.0),
    }


def judged_runs(runs: int, slow_runs: int, nodes: int, threshold: float, workdir: Path) -> int:
    """False positives and misses of the peer comparison: ``runs`` preflights of ``nodes``
    healthy nodes (every drain is a false positive), then ``slow_runs`` with one node slowed by
    the cgroup limit (a different one each run: it must be the only node drained)."""
    options = ["--level", "full", "--expect-devices", "0", "--no-save", "--skip", "host_memory_bandwidth"]
    options += ["--peer-threshold", str(threshold), "--timeout-scale", "3"]
    false_positives = 0
    with SimFleet(nodes, workdir / "healthy") as fleet:
        for run in range(runs):
            doc = json.loads(preflight(fleet, options).stdout)
            drained = [d["node"] for d in doc["drain"]]
            medians = [p["median"] for p in doc["peer"]["figures"] if p["metric"] == "host_gemm_fp32_gflops"]
            values = [
                c.get("value")
                for n in doc["nodes"]
                for c in n["checks"]
                if c["name"] == "host_gemm_fp32" and isinstance(c.get("value"), (int, float))
            ]
            ratios = [round(v / medians[0], 2) for v in values] if medians and medians[0] else []
            false_positives += len(drained)
            print(f"healthy run {run + 1:>2}: drained {drained or 'none'} {ratios if ratios else ''}", flush=True)
    named = 0
    if slow_runs and cpu_cgroup_root() is None:
        print("no writable cgroup with the cpu controller: no slowed runs")
        slow_runs = 0
    for run in range(slow_runs):
        slow = run % nodes
        with SimFleet(nodes, workdir / f"slow{run}", slow=frozenset({slow})) as fleet:
            doc = json.loads(preflight(fleet, options).stdout)
        drained = [d["node"] for d in doc["drain"]]
        right = drained == [fleet.nodes[slow].host]
        named += right
        print(
            f"slowed run {run + 1:>2}: node {fleet.nodes[slow].host} slowed, drained {drained}: {'right' if right else 'WRONG'}"
        )
    print(
        f"\npeer comparison at threshold {threshold:g}, {nodes} nodes: {runs} healthy runs, "
        f"{false_positives} false positive(s); {slow_runs} slowed runs, {named} named right"
    )
    return 0


def fit_line(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least squares ``y = a + b x`` (b = 0 with one point)."""
    if len(xs) < 2:
        return (ys[0] if ys else 0.0), 0.0
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx if sxx else 0.0
    return my - b * mx, b


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nodes", default="8,16,32,64", help="node counts to run (default 8,16,32,64)")
    parser.add_argument("--level", default="quick", choices=("quick", "standard"), help="healthcheck level")
    parser.add_argument(
        "--healthy-runs",
        type=int,
        default=0,
        metavar="N",
        help="instead of timing: N healthy preflights (false positives of the peer comparison) and "
        "--slow-runs with one node slowed",
    )
    parser.add_argument("--slow-runs", type=int, default=0, metavar="N")
    parser.add_argument("--fp-nodes", type=int, default=4, metavar="N", help="nodes of the --healthy-runs fleet")
    parser.add_argument("--threshold", type=float, default=0.5, help="--peer-threshold of those runs (default 0.5)")
    args = parser.parse_args(argv)
    if args.healthy_runs or args.slow_runs:
        workdir = Path(tempfile.mkdtemp(prefix="dp-bench-preflight-"))
        try:
            return judged_runs(args.healthy_runs, args.slow_runs, args.fp_nodes, args.threshold, workdir)
        finally:
            shutil.rmtree(workdir, ignore_errors=True)
    counts = [int(x) for x in args.nodes.split(",") if x.strip()]
    workdir = Path(tempfile.mkdtemp(prefix="dp-bench-preflight-"))
    rows = []
    try:
        print(
            f"{'nodes':>5}  {'wall s':>7}  {'node check med/max s':>20}  {'answer max s':>12}  {'overhead s':>10}  exit"
        )
        for count in counts:
            row = measure(count, args.level, workdir)
            rows.append(row)
            print(
                f"{row['nodes']:>5}  {row['wall_s']:>7.2f}  "
                f"{row['node_check_median_s']:>9.2f} / {row['node_check_max_s']:<8.2f}  "
                f"{row['node_answer_max_s']:>12.2f}  {row['overhead_s']:>10.2f}  {row['exit_code']}"
                f" ({row['answered']}/{row['nodes']} answered)",
                flush=True,
            )
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    # Paper estimate: a real node's own healthcheck time (docs/healthcheck.md) plus the fan-out's
    # overhead (wall time minus the slowest node's own healthcheck: the CLI's start, each sidecar's
    # action child, the merge), fitted as a + b x nodes over the runs. Here every node's sidecar,
    # child and checks share this machine's cores, so b is an upper bound of a real fleet's.
    a, b = fit_line([float(r["nodes"]) for r in rows], [r["overhead_s"] for r in rows])
    print(f"\nfan-out overhead: {a:.2f} s + {b * 1000:.1f} ms per node (fitted over {len(rows)} run(s))")
    node_s = {"quick": H200_QUICK_S, "standard": H200_STANDARD_S * EIGHT_GPU_FACTOR}
    for nodes in (128, 1024):
        for level, seconds in node_s.items():
            # --max-in-flight (default 64) nodes at once: the others wait for a free slot.
            batches = -(-nodes // 64)
            estimate = a + b * nodes + batches * seconds
            print(
                f"estimate {nodes:>5} nodes x 8 GPUs, {level:>8}: {estimate:6.1f} s with --max-in-flight 64 "
                f"({batches} x {seconds:.1f} s per node + {a:.2f} s + {nodes} x {b * 1000:.1f} ms); "
                f"with --max-in-flight {nodes}: {a + b * nodes + seconds:.1f} s"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
