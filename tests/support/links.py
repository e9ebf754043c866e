"""Simulated nodes for the link tests (tests/integration/test_links.py, scripts/bench_links.py).

A node is a `dynprof serve` process with its own DYNPROF_HOST and run directory. On loopback
all nodes share 127.0.0.1 (distinct ports). In network namespaces (root, `ip`, `tc`), node i
lives in namespace ``dpln<net>n<i>`` with a veth ``eth0`` of address 10.<net>.0.(i+1)/24 whose peer
is on the bridge ``dpln<net>br`` of the root namespace (10.<net>.0.254), <net> the first network
from 213 that no other run uses (:meth:`NetnsNodes._claim_network`); the orchestrator reaches the sidecars
over that bridge and the link tests run between the namespaces over it. :meth:`NetnsNodes.shape`
limits one node's link both ways with ``tbf`` (egress in its namespace, and on its peer in the
root namespace). Everything is removed by :meth:`close`, which the fixtures always call.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from dynprof.nodes import Node
from tests._ports import free_port as _free_port

ROOT = Path(__file__).resolve().parents[2]
TOKEN = "links-test-token-0123456789abcdef"
SIDECAR_PORT = 8787
SERVE = [sys.executable, "-m", "dynprof", "serve", "--max-actions", "4"]


def netns_usable() -> str | None:
    """None when namespaces, veths, a bridge and tc work here; else why not (a skip reason)."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None or shutil.which("tc") is None:
        return "no `ip` or `tc` here"
    name = f"dplkprobe{os.getpid() % 100000}"
    try:
        subprocess.run(["ip", "netns", "add", name], check=True, capture_output=True, timeout=10)
        subprocess.run(["ip", "netns", "del", name], check=True, capture_output=True, timeout=10)
    except (subprocess.SubprocessError, OSError) as exc:
        return f"`ip netns add` is not permitted here: {exc}"
    return None


def _wait_listening(
    host: str, port: int, proc: subprocess.Popen[bytes], netns: str | None, timeout: float = 180.0
) -> None:
    # a deadline for a sidecar that never listens, not a bound on its start: three sidecars
    # start at once, each importing dynprof, and a loaded machine took over 60 s for one
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"dynprof serve on {host}:{port} exited ({proc.returncode})")
        try:
            with socket.create_connection((host, port), timeout=1):
                return
        except OSError:
            time.sleep(0.2)
    route = subprocess.run(["ip", "route", "get", host], capture_output=True, text=True, timeout=20)
    raise RuntimeError(
        f"dynprof serve is not listening on {host}:{port} after {timeout} s"
        f" (route here: {(route.stdout or route.stderr).strip()!r})"
    )


class SimNodes:
    """Sidecars on loopback: ``nodes`` (what the rounds are given), ``procs``, :meth:`close`."""

    def __init__(self, count: int, workdir: Path | None = None) -> None:
        self.workdir = Path(workdir or tempfile.mkdtemp(prefix="dp-links-"))
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.token_file = self.workdir / "token"
        self.token_file.write_text(TOKEN + "\n")
        self.token_file.chmod(0o600)
        self.nodes: list[Node] = []
        self.procs: list[subprocess.Popen[bytes]] = []
        self.run_dirs: list[Path] = []
        self.count = count

    def _serve(self, i: int, host: str, port: int, prefix: list[str], extra: tuple[str, ...] = ()) -> None:
        # node i (its sidecar, and so its link workers) on CPU i % cpus: every pair of a round
        # then shares the CPUs alike; left to the scheduler on a small machine, a pair whose two
        # ends happen to share a CPU measures several times slower than one that does not
        cpus = os.cpu_count() or 1
        if shutil.which("taskset") and cpus > 1:
            prefix = [*prefix, "taskset", "-c", str(i % cpus)]
        run_dir = Path(tempfile.mkdtemp(prefix=f"dp-lk{i}-", dir="/tmp"))  # short: its sockets
        self.run_dirs.append(run_dir)
        env = {**os.environ, "DYNPROF_HOST": f"node-{i}", "DYNPROF_RUN_DIR": str(run_dir), "PYTHONUNBUFFERED": "1"}
        env["DYNPROF_ARTIFACT_DIR"] = str(self.workdir / f"store-{i}")
        env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
        env.pop("DYNPROF_TOKEN_FILE", None)
        env.pop("DYNPROF", None)
        with open(self.workdir / f"serve-{i}.log", "wb") as log:
            proc = subprocess.Popen(
                [*prefix, *SERVE, "--host", host, "--port", str(port), "--token-file", str(self.token_file), *extra],
                env=env,
                cwd=str(ROOT),
                stdout=subprocess.DEVNULL,
                stderr=log,
                start_new_session=True,
            )
        self.procs.append(proc)
        self.nodes.append(Node(host, port))

    def start(self) -> SimNodes:
        for i in range(self.count):
            self._serve(i, "127.0.0.1", _free_port(), [])
        self._wait()
        return self

    def _wait(self, netns: list[str | None] | None = None) -> None:
        for i, (node, proc) in enumerate(zip(self.nodes, self.procs, strict=True)):
            _wait_listening(node.host, node.port, proc, (netns or [None] * len(self.nodes))[i])

    def stop_node(self, i: int) -> None:
        """SIGSTOP node i's sidecar (its process group): it never answers nor joins."""
        os.killpg(self.procs[i].pid, signal.SIGSTOP)

    def _signal_all(self, *signals: int) -> None:
        """Send ``signals`` in turn to each sidecar's process group."""
        for proc in self.procs:
            for sig in signals:
                try:
                    os.killpg(proc.pid, sig)
                except (ProcessLookupError, PermissionError):
                    pass

    def _wait_all(self, timeout: float) -> None:
        for proc in self.procs:
            try:
                proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                pass

    def close(self) -> None:
        # a sidecar that stops kills its actions' children first
        self._signal_all(signal.SIGCONT, signal.SIGTERM)
        self._wait_all(15)
        self._signal_all(signal.SIGCONT, signal.SIGKILL)
        self._wait_all(20)
        shutil.rmtree(self.workdir, ignore_errors=True)
        for run_dir in self.run_dirs:
            shutil.rmtree(run_dir, ignore_errors=True)


class NetnsNodes(SimNodes):
    """Sidecars in network namespaces of their own behind one bridge (see the module doc)."""

    def __init__(self, count: int, net: int = 213, workdir: Path | None = None) -> None:
        super().__init__(count, workdir)
        self.net = net  # the first network tried; start() claims a free one from here
        self.prefix = ""
        self.bridge = ""
        self.namespaces: list[str] = []
        self.host_veths: list[str] = []

    def _ip(self, *args: str) -> None:
        subprocess.run(["ip", *args], check=True, capture_output=True, timeout=20)

    def address(self, i: int) -> str:
        return f"10.{self.net}.0.{i + 1}"

    def _claim_network(self) -> None:
        """Take the first 10.N.0.0/24 from ``net`` on that nothing else here uses.

        The bridge is named after N, and creating it is the claim (the kernel refuses a second
        link of one name): two runs at once on one machine take different networks. A network
        whose address is already on some link (a run killed before its cleanup left its bridge)
        is passed over: its route would send the orchestrator's connections to that bridge.
        """
        for net in range(self.net, min(self.net + 40, 255)):
            bridge = f"dpln{net}br"
            made = subprocess.run(["ip", "link", "add", bridge, "type", "bridge"], capture_output=True, timeout=20)
            if made.returncode != 0:
                continue  # another run's bridge, live or left behind
            addresses = subprocess.run(["ip", "-4", "-o", "addr"], capture_output=True, text=True, timeout=20).stdout
            if f" 10.{net}.0." in addresses:
                subprocess.run(["ip", "link", "del", bridge], capture_output=True, timeout=20)
                continue
            self.net, self.bridge, self.prefix = net, bridge, f"dpln{net}n"
            return
        raise RuntimeError(f"no free network among 10.{self.net}..{self.net + 39}.0.0/24 for the link tests")

    def start(self) -> NetnsNodes:
        self._claim_network()
        self._ip("link", "set", self.bridge, "up")
        self._ip("addr", "add", f"10.{self.net}.0.254/24", "dev", self.bridge)
        for i in range(self.count):
            ns = f"{self.prefix}{i}"
            veth = f"{self.prefix}{i}h"
            self._ip("netns", "add", ns)
            self.namespaces.append(ns)
            self._ip("link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ns)
            self.host_veths.append(veth)
            self._ip("link", "set", veth, "master", self.bridge, "up")
            self._ip("-n", ns, "addr", "add", f"{self.address(i)}/24", "dev", "eth0")
            self._ip("-n", ns, "link", "set", "eth0", "up")
            self._ip("-n", ns, "link", "set", "lo", "up")
        for i, ns in enumerate(self.namespaces):
            # the other nodes are the peers its link tests may reach (no Slurm allocation here)
            peers = tuple(f"--allow-peer={self.address(j)}" for j in range(self.count) if j != i)
            self._serve(i, self.address(i), SIDECAR_PORT, ["ip", "netns", "exec", ns], peers)
        self._wait()
        return self

    def shape(self, i: int, rate: str = "40mbit") -> None:
        """Limit node i's link to ``rate`` both ways (tbf)."""
        tbf = ["root", "tbf", "rate", rate, "burst", "64kb", "latency", "100ms"]
        subprocess.run(["tc", "qdisc", "add", "dev", self.host_veths[i], *tbf], check=True, capture_output=True)
        subprocess.run(
            ["ip", "netns", "exec", self.namespaces[i], "tc", "qdisc", "add", "dev", "eth0", *tbf],
            check=True,
            capture_output=True,
        )

    def unshape(self, i: int) -> None:
        subprocess.run(["tc", "qdisc", "del", "dev", self.host_veths[i], "root"], capture_output=True)
        subprocess.run(
            ["ip", "netns", "exec", self.namespaces[i], "tc", "qdisc", "del", "dev", "eth0", "root"],
            capture_output=True,
        )

    def close(self) -> None:
        try:
            super().close()
        finally:
            for ns in self.namespaces:
                subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=20)
            for veth in self.host_veths:
                subprocess.run(["ip", "link", "del", veth], capture_output=True, timeout=20)
            if self.bridge:
                subprocess.run(["ip", "link", "del", self.bridge], capture_output=True, timeout=20)
