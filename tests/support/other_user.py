"""dynprof run as another user (`nobody`), for the tests of other users' processes.

The checkout may sit where `nobody` cannot read it: a clone inside `mktemp -d` or under /root
(mode 0700), and so may the virtual environment and its interpreter. `nobody` gets a
world-readable copy of what dynprof needs (its three packages, protobuf and psutil) in a
directory of its own under /tmp, and an interpreter of the test interpreter's version that it
can run (the test's own base interpreter, else the system's python3). A probe run as `nobody`
imports dynprof from there before any test relies on it.

What cannot be had skips the test on a user's machine with the precise reason; under CI
(DYNPROF_CI=1, set by .ci/run) it fails instead, as a missing program does
(tests/unit/test_ci_programs.py).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent.parent
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to switch to the nobody user")
PACKAGES = ("dynprof", "collectors", "healthcheck")  # pyproject's packages: what `python -m dynprof` imports
SETPRIV = ("setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups")
PROBE = "import dynprof.__main__, dynprof.cli.attach, dynprof.cli.stacks, dynprof.agent; print(dynprof.__file__)"


@dataclass(frozen=True)
class OtherUser:
    """A directory `nobody` reads and writes, the interpreter it runs and the environment."""

    base: Path
    python: str
    env: dict[str, str]

    def argv(self, cmd: list[str]) -> list[str]:
        """``cmd`` run as `nobody` (uid and gid, no supplementary groups)."""
        return [*SETPRIV, *cmd]

    def dynprof(self, *args: str) -> list[str]:
        """`python -m dynprof ARGS` as `nobody`, from the readable copy."""
        return self.argv([self.python, "-m", "dynprof", *args])

    def full_env(self) -> dict[str, str]:
        return {**os.environ, **self.env}

    def run_dynprof(self, *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
        """`dynprof ARGS` run as `nobody` to its end, in its directory; what it printed."""
        return subprocess.run(
            self.dynprof(*args),
            capture_output=True,
            text=True,
            env=self.full_env(),
            timeout=timeout,
            cwd=str(self.base),
        )


def unavailable(reason: str) -> None:
    """Skip with ``reason``; under CI (DYNPROF_CI=1) fail with it: CI must run these tests."""
    if os.environ.get("DYNPROF_CI"):
        pytest.fail(f"CI cannot run a test as another user: {reason}", pytrace=False)
    pytest.skip(reason)


def _world_readable(path: Path) -> None:
    for dirpath, _dirnames, filenames in os.walk(path):
        os.chmod(dirpath, 0o755)
        for name in filenames:
            file = os.path.join(dirpath, name)
            os.chmod(file, os.stat(file).st_mode & 0o777 | 0o444)


def _copy_site(site: Path) -> None:
    """dynprof's packages and its imported third-party ones, world-readable, into ``site``."""
    import google.protobuf
    import psutil

    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for name in PACKAGES:
        shutil.copytree(ROOT / name, site / name, ignore=ignore)
    shutil.copytree(Path(google.protobuf.__file__).parent.parent, site / "google", ignore=ignore)
    shutil.copytree(Path(psutil.__file__).parent, site / "psutil", ignore=ignore)
    _world_readable(site)


def _runs_as_nobody(python: str, env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess[str]:
    # os.access as well as running it: `dynprof run` finds its command through PATH's rules, which
    # ask os.access, and some filesystems run what os.access refuses
    check = (
        f"import os, sys; assert sys.version_info[:2] == {tuple(sys.version_info[:2])}, sys.version; "
        f"assert os.access({python!r}, os.X_OK), 'os.access refuses to execute {python}'; " + PROBE
    )
    return subprocess.run(
        [*SETPRIV, python, "-c", check],
        capture_output=True,
        text=True,
        env={**os.environ, **env},
        cwd=str(cwd),
        timeout=120,
    )


def _interpreters() -> list[str]:
    """The test's own base interpreter (a venv's python is a link to it), then the system's."""
    found = [os.path.realpath(getattr(sys, "_base_executable", sys.executable)), "/usr/bin/python3"]
    return [p for i, p in enumerate(found) if p not in found[:i] and os.path.exists(p)]


@contextmanager
def readable_site() -> Iterator[tuple[Path, str]]:
    """(a world-readable directory holding dynprof's copy, the interpreter `nobody` runs it with);
    skips (fails under CI) with the reason when there is none."""
    if os.geteuid() != 0:
        pytest.skip("needs root to act as another user")
    if shutil.which("setpriv") is None:
        unavailable("needs setpriv to act as another user")
    top = Path(tempfile.mkdtemp(prefix="dp-nobody-site-", dir="/tmp"))
    try:
        os.chmod(top, 0o755)
        site = top / "site"
        _copy_site(site)
        tried = []
        for python in _interpreters():
            probe = _runs_as_nobody(python, {"PYTHONPATH": str(site), "PATH": "/usr/bin:/bin"}, top)
            if probe.returncode == 0 and probe.stdout.strip() == str(site / "dynprof" / "__init__.py"):
                yield site, python
                return
            why = (probe.stderr.strip().splitlines() or [probe.stdout.strip()])[-1:]
            tried.append(f"{python}: {' '.join(why) or f'exit {probe.returncode}'}")
        unavailable(
            "user nobody cannot import dynprof from a world-readable copy with any interpreter of "
            f"Python {sys.version_info[0]}.{sys.version_info[1]} (" + "; ".join(tried or ["none found"]) + ")"
        )
    finally:
        shutil.rmtree(top, ignore_errors=True)


@contextmanager
def other_user(site: Path, python: str) -> Iterator[OtherUser]:
    """A fresh directory of `nobody`'s (its run dir and store inside) over the copy at ``site``."""
    base = Path(tempfile.mkdtemp(prefix="dp-nobody-", dir="/tmp"))
    try:
        os.chmod(base, 0o755)
        run_dir, arts = base / "run", base / "arts"
        for d in (run_dir, arts):
            d.mkdir()
            shutil.chown(d, "nobody")
        env = {
            "PYTHONPATH": str(site),
            "DYNPROF_RUN_DIR": str(run_dir),
            "DYNPROF_ARTIFACT_DIR": str(arts),
            "PATH": "/usr/bin:/bin",
            "HOME": str(base),
        }
        yield OtherUser(base=base, python=python, env=env)
    finally:
        shutil.rmtree(base, ignore_errors=True)


def as_nobody(fn: Callable[[], object]) -> tuple[int, str]:
    """Run ``fn()`` in a forked child as uid/gid nobody (root only); its exit code, and what it
    wrote on its stdout and stderr (a traceback, if it raised)."""
    import concurrent.futures  # noqa: F401  (the child cannot read this Python's files under /root)

    from dynprof.cli import build_parser

    build_parser()
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # child
        code = 99
        try:
            os.close(r)
            os.dup2(w, 1)
            os.dup2(w, 2)
            sys.stdout = open(1, "w", closefd=False)
            sys.stderr = open(2, "w", closefd=False)
            os.setgroups([])
            os.setgid(65534)
            os.setuid(65534)
            code = fn()
        except BaseException:
            os.write(2, traceback.format_exc().encode())
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code if isinstance(code, int) else 98)
    os.close(w)
    chunks: list[bytes] = []
    while chunk := os.read(r, 65536):
        chunks.append(chunk)
    os.close(r)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status), b"".join(chunks).decode(errors="replace")
