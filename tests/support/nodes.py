"""Simulated nodes for the many-node tests, in one place.

A node is a `dynprof serve` subprocess on a loopback port with its own run directory, artifact
store and DYNPROF_HOST; a rank "runs on" a node when it starts with that node's directories.
The ranks of one gloo job are spread over the nodes by :func:`split_job`. The CLI or the watch
then runs from a third place with no agents (the test's own run directory and store).

The link tests' nodes (tests/support/links.py) are another thing: there each
node is a sidecar plus the link-test workers it starts, in network namespaces where it can.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests._ports import free_port
from tests.support.procs import terminate
from tests.support.serving import serve, write_token

ROOT = Path(__file__).resolve().parents[2]
# Two nodes whose names the output tells apart: the host is how the CLI and the watch name a
# node when it appears once (127.0.0.1:P1 is "127.0.0.1", localhost:P2 is "localhost").
TWO_NODES = (("node-a", "127.0.0.1"), ("node-b", "localhost"))


@dataclass
class SimNode:
    name: str  # its DYNPROF_HOST
    address: str  # HOST:PORT, what --hosts names
    run_dir: Path
    artifacts: Path
    proc: subprocess.Popen[bytes] | None = None

    @property
    def label(self) -> str:
        """How the watch and the CLI name this node (its host, where it appears once)."""
        return self.address.rsplit(":", 1)[0]

    @property
    def port(self) -> int:
        return int(self.address.rsplit(":", 1)[1])

    @property
    def env(self) -> dict[str, str]:
        """The environment of a rank that runs on this node."""
        return {
            "DYNPROF_RUN_DIR": str(self.run_dir),
            "DYNPROF_ARTIFACT_DIR": str(self.artifacts),
            "DYNPROF_HOST": self.name,
        }


def token_file(directory: Path, token: str) -> Path:
    """A token file of mode 0600 in ``directory``."""
    return write_token(directory / "token", token + "\n")


def wait_listening(port: int, proc: subprocess.Popen[bytes], timeout: float = 60.0) -> None:
    """Until something accepts on 127.0.0.1:``port`` (``proc`` must stay alive meanwhile)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, "dynprof serve exited"
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                return
        except OSError:
            time.sleep(0.1)
    raise AssertionError(f"dynprof serve is not listening on {port} after {timeout} s")


@contextlib.contextmanager
def sidecar_nodes(
    workdir: Path, token: Path, layout: Sequence[tuple[str, str]] = TWO_NODES, serve_args: Sequence[str] = ()
) -> Iterator[list[SimNode]]:
    """One node per (name, host) of ``layout``, each a `dynprof serve --token-file TOKEN` on a
    free port; its log is ``workdir/serve-NAME.log``, its store ``workdir/store-NAME``. Its run
    directory is a short path under /tmp (agents' Unix sockets must fit 107 bytes), removed
    after the sidecar has ended."""
    sims: list[SimNode] = []
    try:
        for name, host in layout:
            run_dir = Path(tempfile.mkdtemp(prefix=f"dp-{name[-1]}-", dir="/tmp"))
            sim = SimNode(name, f"{host}:{free_port()}", run_dir, workdir / f"store-{name}")
            sims.append(sim)
            env = {**os.environ, **sim.env, "PYTHONUNBUFFERED": "1"}
            env.pop("DYNPROF_TOKEN_FILE", None)
            with open(workdir / f"serve-{name}.log", "wb") as log:  # the child keeps its own descriptor
                sim.proc = serve(
                    sim.port,
                    token,
                    *serve_args,
                    env=env,
                    cwd=str(ROOT),
                    stdout=subprocess.DEVNULL,
                    stderr=log,
                    start_new_session=True,
                )
        for sim in sims:
            assert sim.proc is not None
            wait_listening(sim.port, sim.proc)
        yield sims
    finally:
        for sim in sims:
            if sim.proc is not None:
                terminate(sim.proc)
            shutil.rmtree(sim.run_dir, ignore_errors=True)


def two_nodes(workdir: Path, token_text: str) -> contextlib.AbstractContextManager[dict[str, Any]]:
    """Nodes A (127.0.0.1) and B (localhost) with one token, as the many-node tests take them:
    ``{"a": SimNode, "b": SimNode, "token": Path, "hosts": "A,B"}``."""

    @contextlib.contextmanager
    def _nodes() -> Iterator[dict[str, Any]]:
        token = token_file(workdir, token_text)
        with sidecar_nodes(workdir, token) as (a, b):
            yield {"a": a, "b": b, "token": token, "hosts": f"{a.address},{b.address}"}

    return _nodes()


def dynprof(*args: str, token: Path | None = None, timeout: float = 90) -> subprocess.CompletedProcess[str]:
    """``python -m dynprof ARGS`` from here (the test's own run directory and store: no agents),
    with ``token`` as its DYNPROF_TOKEN_FILE (tests/conftest.py's ``run_cli``)."""
    from tests.conftest import run_cli

    return run_cli(*args, timeout=timeout, env={"DYNPROF_TOKEN_FILE": str(token)} if token is not None else None)


def split_job(
    spawn: Any,
    program: str,
    placement: Sequence[SimNode],
    job: str,
    args: Sequence[str],
    run_args: Sequence[str] = (),
    rank_env: Any = None,
) -> list[Any]:
    """A gloo job of len(placement) ranks: rank i runs ``program ARGS`` under
    `dynprof run -q RUN_ARGS` on placement[i]'s node; ``rank_env(i)`` adds to rank i's
    environment. Returns the suite's targets (tests/conftest.py's ``spawn``)."""
    master = str(free_port())
    targets = []
    for rank, sim in enumerate(placement):
        env = {
            **sim.env,
            "RANK": str(rank),
            "WORLD_SIZE": str(len(placement)),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": master,
            "DYNPROF_JOB_ID": job,
            **(rank_env(rank) if rank_env else {}),
        }
        cmd = ["-m", "dynprof", "run", "-q", *run_args, "--", sys.executable, program, *args]
        targets.append(spawn(cmd, under_run=False, env=env))
    return targets
