#!/usr/bin/env python3
"""Wall time of job-wide `dynprof ps` and `dynprof stacks`, and of the watch's poll cycle and
look, over many simulated nodes.

Each simulated node is its own run directory and artifact directory, a `dynprof serve` sidecar
on a loopback port, and --ranks-per-node light ranks (processes with the dynprof agent but no
torch, forked from one parent so they share its pages: scripts/_fanout_ranks.py). All ranks
are one job; one rank sleeps in another function, so the merged stacks have an outlier.

Once every sidecar answers and every rank's agent is up, it times the whole CLI command, as an
on-call engineer runs it, over host files of the first 1, 8, 16, 32, 64 nodes:

    dynprof ps     --job J --hostfile F --json
    dynprof stacks --job J --hostfile F --json

and the two parts of `dynprof watch` that grow with the nodes, from this process as the watch
runs them (through :class:`dynprof.job.client.SidecarClient`, every node at once, at most its
``max_in_flight``):

    poll     one ``GET /api/v1/progress?job=J`` per node: the watch's poll cycle
    look     two job-wide stacks samples (the nodes' ``stacks`` action), ``--look-gap`` seconds
             apart (the gap not counted): what the watch does before it calls a stall a hang
    verdict  detection -> verdict written, by the watch engine (measured where the engine is
             in the checkout; else said so)

several times each (after one warm-up), checks that every rank is in the answer, and prints
the median and spread, the cost per node (the slope of a least-squares line over the node
counts), the CPU the CLI itself spent per node, and a paper estimate for 1 024 nodes (the model
is printed with it). Memory of the sidecars and ranks (RSS, and PSS: shared pages split among
their users) is measured and printed. Everything it started is stopped on exit, Ctrl-C and
SIGTERM included; ranks and sidecars also die with it if it is killed (PR_SET_PDEATHSIG).

    python scripts/bench_fanout.py                     # 64 nodes x 8 ranks, 5 runs each
    python scripts/bench_fanout.py --nodes 8 --repeat 3  # a quick check of the harness
    python scripts/bench_fanout.py --harness-only      # start, measure memory, stop; time nothing
    python scripts/bench_fanout.py --nodes 8,16,32,64 --commands poll,look,verdict --repeat 3

The machine is shared by everything running on it, sidecars included: with all nodes on a
few cores, the per-node cost measured here is an upper bound of what a node costs the CLI.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import http.client
import json
import os
import resource
import secrets
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

ROOT = Path(__file__).resolve().parent.parent
RANKS_PROGRAM = ROOT / "scripts" / "_fanout_ranks.py"
TARGET_S = 3.0
# The watch's look is part of the hang verdict's budget (<= 30 s at 512 ranks); the poll cycle
# has no target of its own but the poll interval.
TARGETS_S = {"ps": TARGET_S, "stacks": TARGET_S, "look": 30.0}
TARGET_WHAT = {"look": " (the whole verdict's budget)"}
TARGET_RANKS = 512
PAPER_NODES = 1024
ASSUMED_RTT_S = 0.0005  # one request/answer between two nodes of one cluster network
PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    with contextlib.suppress(OSError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _memory_kib(pid: int) -> tuple[int, int]:
    """(RSS, PSS) of one process in KiB; (0, 0) if it is gone."""
    rss = pss = 0
    try:
        with open(f"/proc/{pid}/smaps_rollup") as fh:
            for line in fh:
                if line.startswith("Rss:"):
                    rss = int(line.split()[1])
                elif line.startswith("Pss:"):
                    pss = int(line.split()[1])
    except OSError:
        pass
    return rss, pss


def _cpu_s(pid: int) -> float:
    """CPU seconds of a process and of its children it has reaped (py-spy runs, for a sidecar)."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            fields = fh.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return sum(int(x) for x in fields[11:15]) / os.sysconf("SC_CLK_TCK")


def _children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as fh:
            return [int(x) for x in fh.read().split()]
    except OSError:
        return []


def _alive(pid: int) -> bool:
    """Running, and not a zombie waiting to be reaped."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _mem_available_kib() -> int:
    with open("/proc/meminfo") as fh:
        for line in fh:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1])
    return 0


@dataclass
class Node:
    index: int
    host: str
    run_dir: Path
    artifact_dir: Path
    port: int = 0
    proc: subprocess.Popen[bytes] | None = None
    log: Path | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"


@dataclass
class Cluster:
    """Simulated nodes on this machine: sidecars and light ranks, and their teardown."""

    nodes_count: int
    ranks_per_node: int
    job: str = "bench-fanout"
    root: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="dpf-", dir="/tmp")))
    nodes: list[Node] = field(default_factory=list)
    ranks_proc: subprocess.Popen[str] | None = None
    rank_pids: list[int] = field(default_factory=list)
    token_file: Path | None = None

    @property
    def world_size(self) -> int:
        return self.nodes_count * self.ranks_per_node

    def env(self) -> dict[str, str]:
        env = dict(os.environ, PYTHONUNBUFFERED="1", DYNPROF_TOKEN_FILE=str(self.token_file))
        env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])
        for name in ("DYNPROF", "DYNPROF_JOB_ID", "DYNPROF_HOST", "SLURM_JOB_NODELIST", "SLURM_NODELIST"):
            env.pop(name, None)
        return env

    # -- start ---------------------------------------------------------------------------------
    def start(self, timeout: float = 300.0) -> dict[str, float]:
        t0 = time.monotonic()
        self.root.chmod(0o700)
        self.token_file = self.root / "token"
        fd = os.open(self.token_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as fh:
            fh.write(secrets.token_urlsafe(24) + "\n")
        for i in range(self.nodes_count):
            # Short paths: an agent's socket path must fit in 107 bytes.
            node = Node(i, f"node-{i:03d}", self.root / f"n{i}" / "r", self.root / f"n{i}" / "a")
            node.run_dir.mkdir(parents=True, mode=0o700)
            node.artifact_dir.mkdir(parents=True, mode=0o700)
            self.nodes.append(node)
        self._start_ranks()
        for node in self.nodes:
            self._start_sidecar(node)
        deadline = t0 + timeout
        self._wait_ranks(deadline)
        t_ranks = time.monotonic() - t0
        for node in self.nodes:
            self._wait_sidecar(node, deadline)
        return {"ranks_ready_s": t_ranks, "all_ready_s": time.monotonic() - t0}

    def _start_ranks(self) -> None:
        plan = {
            "job": self.job,
            "world_size": self.world_size,
            "odd_rank": min(37, self.world_size - 1),
            "ranks": [
                {
                    "rank": n.index * self.ranks_per_node + lr,
                    "local_rank": lr,
                    "node": n.index,
                    "host": n.host,
                    "run_dir": str(n.run_dir),
                    "artifact_dir": str(n.artifact_dir),
                }
                for n in self.nodes
                for lr in range(self.ranks_per_node)
            ],
        }
        with open(self.root / "ranks.log", "wb") as log:
            self.ranks_proc = subprocess.Popen(
                [sys.executable, str(RANKS_PROGRAM)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=log,
                text=True,
                env=self.env(),
                cwd=str(ROOT),
                start_new_session=True,
                preexec_fn=_die_with_parent,
            )
        assert self.ranks_proc.stdin is not None
        self.ranks_proc.stdin.write(json.dumps(plan))
        self.ranks_proc.stdin.close()

    def _wait_ranks(self, deadline: float) -> None:
        assert self.ranks_proc is not None and self.ranks_proc.stdout is not None
        while len(self.rank_pids) < self.world_size:
            if time.monotonic() > deadline:
                raise RuntimeError(f"only {len(self.rank_pids)} of {self.world_size} ranks ready in time")
            line = self.ranks_proc.stdout.readline()
            if not line:
                log = (self.root / "ranks.log").read_text(errors="replace")[-2000:]
                raise RuntimeError(f"the ranks' parent exited ({self.ranks_proc.poll()}):\n{log}")
            if line.startswith("READY"):
                self.rank_pids.append(int(line.split()[3]))

    def _start_sidecar(self, node: Node) -> None:
        node.port = _free_port()
        node.log = self.root / f"n{node.index}" / "serve.log"
        env = self.env()
        env.update(
            DYNPROF_RUN_DIR=str(node.run_dir), DYNPROF_ARTIFACT_DIR=str(node.artifact_dir), DYNPROF_HOST=node.host
        )
        cmd = [sys.executable, "-m", "dynprof", "serve", "--host", "127.0.0.1", "--port", str(node.port)]
        cmd += ["--token-file", str(self.token_file)]
        with open(node.log, "wb") as log:
            node.proc = subprocess.Popen(
                cmd,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=log,
                env=env,
                cwd=str(ROOT),
                start_new_session=True,
                preexec_fn=_die_with_parent,
            )

    def _wait_sidecar(self, node: Node, deadline: float) -> None:
        """Ready when it answers HTTP (any status: /healthz where the sidecar has it)."""
        retried = False
        while True:
            assert node.proc is not None
            if node.proc.poll() is not None:
                log = node.log.read_text(errors="replace")[-1500:] if node.log else ""
                if not retried and "Address already in use" in log:
                    retried = True  # another program took the free port in between
                    self._start_sidecar(node)
                    continue
                raise RuntimeError(f"the sidecar of {node.host} exited ({node.proc.returncode}):\n{log}")
            try:
                conn = http.client.HTTPConnection("127.0.0.1", node.port, timeout=2)
                conn.request("GET", "/healthz")
                conn.getresponse().read()
                conn.close()
                return
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"the sidecar of {node.host} did not answer on port {node.port} in time")
            time.sleep(0.1)

    # -- measure -------------------------------------------------------------------------------
    def sidecar_pids(self) -> list[int]:
        return [n.proc.pid for n in self.nodes if n.proc is not None]

    def memory(self) -> dict[str, Any]:
        sidecars = [_memory_kib(pid) for pid in self.sidecar_pids()]
        ranks = [_memory_kib(pid) for pid in self.rank_pids]
        parent = _memory_kib(self.ranks_proc.pid) if self.ranks_proc is not None else (0, 0)

        def mib(kib: float) -> float:
            return round(kib / 1024, 1)

        total_pss = sum(p for _, p in sidecars) + sum(p for _, p in ranks) + parent[1]
        return {
            "sidecar_rss_mib": mib(statistics.median(r for r, _ in sidecars)) if sidecars else 0,
            "sidecar_pss_mib": mib(statistics.median(p for _, p in sidecars)) if sidecars else 0,
            "rank_rss_mib": mib(statistics.median(r for r, _ in ranks)) if ranks else 0,
            "rank_pss_mib": mib(statistics.median(p for _, p in ranks)) if ranks else 0,
            "total_rss_mib": mib(sum(r for r, _ in sidecars) + sum(r for r, _ in ranks) + parent[0]),
            "total_pss_mib": mib(total_pss),
        }

    def node_cpu_s(self, count: int) -> float:
        """CPU spent by the first ``count`` nodes: sidecars (with the readers they ran) and ranks."""
        pids = [n.proc.pid for n in self.nodes[:count] if n.proc is not None]
        pids += self.rank_pids[: count * self.ranks_per_node]
        return sum(_cpu_s(pid) for pid in pids)

    def hostfile(self, count: int) -> Path:
        path = self.root / f"hosts.{count}"
        path.write_text("".join(f"{n.address}\n" for n in self.nodes[:count]))
        return path

    # -- stop ----------------------------------------------------------------------------------
    def stop(self) -> list[int]:
        """Stop everything; return the pids still alive after it (none, normally)."""
        started = [p for p in [self.ranks_proc, *(n.proc for n in self.nodes)] if p is not None]
        everyone = [p.pid for p in started] + self.rank_pids
        for pid in self.sidecar_pids():
            everyone += _children(pid)  # readers a sidecar was running
        for p in started:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(p.pid, signal.SIGTERM)
        deadline = time.monotonic() + 10
        for p in started:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
        for p in started:
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(p.pid, signal.SIGKILL)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    p.wait(timeout=5)
        for pid in everyone:  # ranks, readers: in the process groups above, or orphans
            if _alive(pid):
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and any(_alive(pid) for pid in everyone):
            time.sleep(0.05)
        shutil.rmtree(self.root, ignore_errors=True)
        return [pid for pid in everyone if _alive(pid)]


# -- timing ------------------------------------------------------------------------------------
@dataclass
class Run:
    wall_s: float
    cli_cpu_s: float
    node_cpu_s: float
    found: int
    code: int
    error: str = ""


def _count(command: str, out: str) -> tuple[int, str]:
    try:
        data = json.loads(out)
    except ValueError:
        return 0, "no JSON on stdout"
    rows = data.get("agents" if command == "ps" else "processes") if isinstance(data, dict) else None
    return (len(rows), "") if isinstance(rows, list) else (0, "no list of ranks in the JSON")


def time_command(cluster: Cluster, command: str, count: int, timeout: float, extra: list[str]) -> Run:
    cmd = [sys.executable, "-m", "dynprof", command, "--job", cluster.job, "--hostfile", str(cluster.hostfile(count))]
    cmd += ["--json", *(["--no-save"] if command == "stacks" else []), *extra]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    node_before = cluster.node_cpu_s(count)
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=cluster.env(), cwd=str(ROOT))
    except subprocess.TimeoutExpired:
        return Run(time.perf_counter() - t0, 0.0, 0.0, 0, 124, f"timed out after {timeout:g} s")
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    found, why = _count(command, proc.stdout)
    error = why or ""
    if proc.returncode != 0 or found != count * cluster.ranks_per_node:
        error = (proc.stderr.strip().splitlines() or [why or "?"])[-1][:300]
    return Run(wall, cpu, cluster.node_cpu_s(count) - node_before, found, proc.returncode, error)


def _watch_client(cluster: Cluster) -> Any:
    from dynprof.job.client import SidecarClient

    assert cluster.token_file is not None
    return SidecarClient(cluster.token_file.read_text().strip(), timeout=30.0, max_in_flight=fanout_in_flight())


def _progress_of(client: Any, node: Any, job: str) -> dict[str, Any]:
    """One node's progress document, through the client's ``progress`` where it has one."""
    ask = getattr(client, "progress", None)
    if ask is not None:
        return dict(ask(node, job))
    # A checkout whose client has no progress request yet: the same GET, by hand.
    conn = http.client.HTTPConnection(node.host, node.port, timeout=client.timeout)
    try:
        conn.request("GET", f"/api/v1/progress?job={job}", headers={"Authorization": f"Bearer {client.token}"})
        resp = conn.getresponse()
        body = resp.read()
    finally:
        conn.close()
    if resp.status != 200:
        raise RuntimeError(f"{node}: HTTP {resp.status}")
    return dict(json.loads(body))


def time_poll(cluster: Cluster, count: int, client: Any) -> Run:
    """One poll cycle of the watch: every node's progress, all at once."""
    from concurrent.futures import ThreadPoolExecutor

    from dynprof.nodes import parse_node
    from dynprof.watch.model import NodeProgress

    nodes = [parse_node(n.address) for n in cluster.nodes[:count]]

    def one(node: Any) -> int:
        return len(NodeProgress.from_json(_progress_of(client, node, cluster.job)).ranks)

    node_before = cluster.node_cpu_s(count)
    c0, t0 = time.process_time(), time.perf_counter()
    errors: list[str] = []
    found = 0
    with ThreadPoolExecutor(max_workers=min(client.max_in_flight, len(nodes))) as pool:
        for got in pool.map(lambda n: _try(one, n), nodes):
            if isinstance(got, int):
                found += got
            else:
                errors.append(got)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    error = errors[0] if errors else ("" if found == count * cluster.ranks_per_node else f"{found} ranks read")
    return Run(wall, cpu, cluster.node_cpu_s(count) - node_before, found, 0 if not error else 1, error)


def _try(fn: Any, arg: Any) -> Any:
    try:
        return fn(arg)
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"[:300]


def time_look(cluster: Cluster, count: int, client: Any, gap: float) -> Run:
    """The watch's look: two job-wide stacks samples, ``gap`` seconds apart (not counted)."""
    from dynprof.nodes import parse_node

    nodes = [parse_node(n.address) for n in cluster.nodes[:count]]
    wall = cpu = node_cpu = 0.0
    found = 0
    error = ""
    for i in range(2):
        if i:
            time.sleep(gap)
        node_before = cluster.node_cpu_s(count)
        c0, t0 = time.process_time(), time.perf_counter()
        answers = client.action_all(nodes, "stacks", {"job": cluster.job, "no_save": True}, timeout=60.0)
        wall += time.perf_counter() - t0
        cpu += time.process_time() - c0
        node_cpu += cluster.node_cpu_s(count) - node_before
        ranks = sum(len(a.result.get("processes") or []) for a in answers if a.ok and isinstance(a.result, dict))
        found = min(found, ranks) if i else ranks
        bad = [a for a in answers if not a.ok]
        if bad and not error:
            error = f"{bad[0].node}: {bad[0].error or bad[0].command_error()}"[:300]
    if not error and found != count * cluster.ranks_per_node:
        error = f"{found} ranks read"
    return Run(wall, cpu, node_cpu, found, 0 if not error else 1, error)


def time_verdict(cluster: Cluster, count: int, client: Any, gap: float) -> Run | None:
    """The watch engine's look and verdict over ``count`` nodes: one round that looks whatever
    the stall (``once``), as a stalled job's round does: two stacks samples ``gap`` apart (a
    native read of the ranks not seen in a collective), each involved node's quick healthcheck,
    the decision and the verdict artifact. Timed: from the round's start to the verdict
    written (the engine's own ``verdict_s`` is in the verdict's evidence). The light ranks do
    not step: the verdict itself says what it finds of them; its cost is what is measured."""
    import importlib.util

    if importlib.util.find_spec("dynprof.watch.engine") is None:
        return None
    from dynprof.nodes import parse_node
    from dynprof.watch.engine import WatchConfig, WatchEngine
    from dynprof.watch.sources import SidecarSource

    nodes = [parse_node(n.address) for n in cluster.nodes[:count]]
    verdicts: list[Any] = []
    config = WatchConfig(job=cluster.job, interval_s=1.0, stall_after_s=1.0, look_interval_s=gap, save=True)
    engine = WatchEngine(config, SidecarSource(client, nodes), on_verdict=lambda verdict, *_: verdicts.append(verdict))
    node_before = cluster.node_cpu_s(count)
    c0, t0 = time.process_time(), time.perf_counter()
    try:
        engine.run(once=True)
    except Exception as exc:
        return Run(time.perf_counter() - t0, time.process_time() - c0, 0.0, 0, 1, f"{type(exc).__name__}: {exc}"[:300])
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    node_cpu = cluster.node_cpu_s(count) - node_before
    if not verdicts:
        return Run(wall, cpu, node_cpu, 0, 1, "no verdict")
    verdict = verdicts[-1]
    timing = verdict.evidence.get("timing") or {}
    found = len(verdict.ranks)
    error = "" if found == count * cluster.ranks_per_node else f"{found} ranks in the verdict"
    print(
        f"  verdict ({verdict.kind}) over {count} nodes: round {wall:.2f} s; engine verdict_s "
        f"{timing.get('verdict_s')}, look_s {timing.get('look_s')}; healthchecks of "
        f"{len(verdict.evidence.get('healthcheck') or {})} node(s)",
        flush=True,
    )
    return Run(wall, cpu, node_cpu, found, 0 if not error else 1, error)


def fit_line(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least squares y = a + b x: (a, b)."""
    if len(xs) < 2:
        return (ys[0] if ys else 0.0), 0.0
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx else 0.0
    return my - b * mx, b


def fanout_in_flight() -> int:
    try:
        from dynprof.job.client import DEFAULT_MAX_IN_FLIGHT  # type: ignore[import-not-found,unused-ignore]

        return int(DEFAULT_MAX_IN_FLIGHT)
    except Exception:
        return 64


def fanout_available(command: str) -> bool:
    proc = subprocess.run(
        [sys.executable, "-m", "dynprof", command, "--help"], capture_output=True, text=True, cwd=str(ROOT)
    )
    return "--hostfile" in proc.stdout


# -- main --------------------------------------------------------------------------------------
def _raise_interrupt(_sig: int, _frame: Any) -> None:
    raise KeyboardInterrupt


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nodes", default="1,8,16,32,64", help="node counts to time (default 1,8,16,32,64)")
    parser.add_argument("--ranks-per-node", type=int, default=8)
    parser.add_argument("--repeat", type=int, default=5, help="timed runs per command and node count")
    parser.add_argument(
        "--commands", default="ps,stacks", help="of ps, stacks, poll, look, verdict (default ps,stacks)"
    )
    parser.add_argument("--look-gap", type=float, default=2.0, help="seconds between the look's two samples")
    parser.add_argument("--timeout", type=float, default=120.0, help="limit per CLI run (s)")
    parser.add_argument("--harness-only", action="store_true", help="start, measure memory, stop; time nothing")
    parser.add_argument("--max-memory-gib", type=float, default=24.0, help="refuse to start past this estimate")
    parser.add_argument("cli_args", nargs="*", help="after --: extra arguments for each timed CLI command")
    args = parser.parse_args()
    counts = sorted({int(x) for x in args.nodes.split(",") if x.strip()})
    if not counts or counts[0] < 1 or args.ranks_per_node < 1 or args.repeat < 1:
        parser.error("node counts, --ranks-per-node and --repeat must be positive")
    commands = [c for c in args.commands.split(",") if c]
    cluster = Cluster(max(counts), args.ranks_per_node)

    # Frugal by construction (ranks share their parent's pages); checked before starting.
    estimate_mib = cluster.world_size * 16 + cluster.nodes_count * 80
    available_mib = _mem_available_kib() // 1024
    if estimate_mib > args.max_memory_gib * 1024 or estimate_mib > available_mib * 0.8:
        shutil.rmtree(cluster.root, ignore_errors=True)
        print(
            f"refused: about {estimate_mib} MiB needed for {cluster.nodes_count} sidecars and {cluster.world_size} "
            f"ranks; {available_mib} MiB available, limit {args.max_memory_gib:g} GiB",
            file=sys.stderr,
        )
        return 2
    signal.signal(signal.SIGTERM, _raise_interrupt)
    signal.signal(signal.SIGHUP, _raise_interrupt)
    results: dict[tuple[str, int], list[Run]] = {}
    left: list[int] = []
    try:
        print(
            f"starting {cluster.nodes_count} nodes x {cluster.ranks_per_node} ranks "
            f"({cluster.world_size} ranks, one job) on {os.cpu_count()} CPUs; python {sys.version.split()[0]}",
            flush=True,
        )
        ready = cluster.start()
        mem = cluster.memory()
        print(
            f"ready in {ready['all_ready_s']:.1f} s (ranks {ready['ranks_ready_s']:.1f} s)\n"
            f"memory: sidecar {mem['sidecar_rss_mib']} MiB RSS / {mem['sidecar_pss_mib']} MiB PSS each, "
            f"rank {mem['rank_rss_mib']} MiB RSS / {mem['rank_pss_mib']} MiB PSS each; "
            f"total {mem['total_pss_mib'] / 1024:.2f} GiB PSS ({mem['total_rss_mib'] / 1024:.2f} GiB RSS summed)",
            flush=True,
        )
        if args.harness_only:
            return 0
        missing = [c for c in commands if c in ("ps", "stacks") and not fanout_available(c)]
        if missing:
            print(
                f"not timed: `dynprof {'/'.join(missing)}` has no --hostfile in this checkout (the fan-out is not "
                "merged here); the harness above works, the timed part needs the fan-out and the sidecar's actions",
                flush=True,
            )
            commands = [c for c in commands if c not in missing]
        client = _watch_client(cluster) if {"poll", "look", "verdict"} & set(commands) else None

        def timed(command: str, count: int) -> Run | None:
            if command == "poll":
                return time_poll(cluster, count, client)
            if command == "look":
                return time_look(cluster, count, client, args.look_gap)
            if command == "verdict":
                return time_verdict(cluster, count, client, args.look_gap)
            return time_command(cluster, command, count, args.timeout, args.cli_args)

        for command in commands:
            for count in counts:
                if timed(command, count) is None:  # warm-up
                    print(
                        f"{command}: not measured in this checkout (the watch engine's detection -> verdict "
                        "time is measured where dynprof.watch.engine is)",
                        flush=True,
                    )
                    break
                runs = [r for r in (timed(command, count) for _ in range(args.repeat)) if r is not None]
                results[(command, count)] = runs
                ok = [r for r in runs if not r.error]
                walls = sorted(r.wall_s for r in runs)
                print(
                    f"{command:6s} {count:3d} nodes {count * cluster.ranks_per_node:4d} ranks: "
                    f"median {statistics.median(walls):.3f} s  [{walls[0]:.3f} - {walls[-1]:.3f}]  "
                    f"{len(ok)}/{len(runs)} complete"
                    + (f"  (last problem: {next(r.error for r in runs if r.error)})" if len(ok) < len(runs) else ""),
                    flush=True,
                )
    except KeyboardInterrupt:
        print("interrupted: stopping the nodes", file=sys.stderr)
        return 130
    finally:
        left = cluster.stop()
        if left:
            print(f"WARNING: {len(left)} process(es) still alive after the teardown: {left[:20]}", file=sys.stderr)
        else:
            print("all nodes and ranks stopped", flush=True)
    if results:
        report(results, cluster.ranks_per_node)
    return 1 if left else 0


def report(results: dict[tuple[str, int], list[Run]], ranks_per_node: int) -> None:
    print()
    print("| command | nodes | ranks | median s | min s | max s | stdev s | CLI CPU s | node CPU s / node | complete |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for (command, count), runs in sorted(results.items()):
        walls = [r.wall_s for r in runs]
        print(
            f"| {command} | {count} | {count * ranks_per_node} | {statistics.median(walls):.3f} | {min(walls):.3f} | "
            f"{max(walls):.3f} | {statistics.pstdev(walls):.3f} | {statistics.median(r.cli_cpu_s for r in runs):.3f} | "
            f"{statistics.median(r.node_cpu_s for r in runs) / count:.3f} | "
            f"{sum(not r.error for r in runs)}/{len(runs)} |"
        )
    in_flight = fanout_in_flight()
    for command in sorted({c for c, _ in results}):
        rows = sorted((n, runs) for (c, n), runs in results.items() if c == command)
        xs = [float(n) for n, _ in rows]
        walls = [statistics.median(r.wall_s for r in runs) for _, runs in rows]
        cpus = [statistics.median(r.cli_cpu_s for r in runs) for _, runs in rows]
        nodes_cpu = [statistics.median(r.node_cpu_s for r in runs) / n for n, runs in rows]
        a, b = fit_line(xs, walls)
        _, cb = fit_line(xs, cpus)
        one_node = walls[0] if rows[0][0] == 1 else a + b
        node_cost = statistics.median(nodes_cpu)
        here = a + b * PAPER_NODES
        cluster = one_node + cb * PAPER_NODES + -(-PAPER_NODES // in_flight) * ASSUMED_RTT_S
        print(f"\n{command}: wall = {a:.3f} s + {b * 1000:.1f} ms x nodes here (least squares over {len(rows)} counts)")
        print(
            f"  per node: {b * 1000:.1f} ms of wall time here, {cb * 1000:.1f} ms of the CLI's own CPU, "
            f"{node_cost * 1000:.0f} ms of CPU on the node (sidecar, its readers and the {ranks_per_node} ranks)"
        )
        biggest = max(n for n, _ in rows)
        target = TARGETS_S.get(command)
        if target is not None and biggest * ranks_per_node >= TARGET_RANKS:
            t = statistics.median(r.wall_s for r in results[(command, biggest)])
            verdict = "meets" if t <= target else "MISSES"
            print(
                f"  {biggest * ranks_per_node} ranks: {t:.3f} s; target <= {target:g} s for {TARGET_RANKS}"
                f"{TARGET_WHAT.get(command, '')}: {verdict}"
            )
        print(
            f"  paper estimate, {PAPER_NODES} nodes x {ranks_per_node} ranks: {here:.1f} s if every node shared this "
            f"machine's CPUs (the line above); on a cluster, where nodes answer in parallel on their own CPUs: "
            f"one node's time {one_node:.2f} s + {PAPER_NODES} x {cb * 1000:.1f} ms of CLI CPU + "
            f"{-(-PAPER_NODES // in_flight)} rounds of {in_flight} requests x {ASSUMED_RTT_S * 1000:.1f} ms assumed "
            f"round trip = {cluster:.1f} s"
        )


if __name__ == "__main__":
    sys.exit(main())
