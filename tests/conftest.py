"""Shared fixtures: isolated run/artifact directories, real target processes, capability probes."""

from __future__ import annotations

import contextlib
import functools
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests._ports import free_port
from tests.support.commands import run_dynprof
from tests.support.lines import LineReader, start_in_session
from tests.support.procs import terminate
from tests.support.ranks import rank_env

ROOT = Path(__file__).resolve().parent.parent
PROGRAMS = ROOT / "tests" / "integration" / "programs"

# One OpenMP thread per torch process the suite starts (unless the caller set a count), as
# torchrun gives each of its workers. The suite runs dozens of torch processes side by side on
# a few cores: with a thread per core each, their OpenMP threads spin-wait against each other.
# Measured on a 2-core machine under `stress-ng --cpu 2`, one job-safety test took 18.4 CPU-s
# with the default and 10.0 CPU-s with one thread. Nothing the suite checks depends on torch's
# intra-op thread count; the tests that use several threads set it themselves.
os.environ.setdefault("OMP_NUM_THREADS", "1")


# -- capability probes (each tries the capability once) -------------------------------------
@functools.cache
def cuda_device_count() -> int:
    try:
        import torch

        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:
        return 0


@functools.cache
def ptrace_works() -> bool:
    """Can py-spy read a child process's stacks here? (CAP_SYS_PTRACE, ptrace_scope)."""
    exe = shutil.which("py-spy")
    if exe is None:
        return False
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        time.sleep(0.3)
        proc = subprocess.run([exe, "dump", "--pid", str(child.pid)], capture_output=True, timeout=20)
        return proc.returncode == 0
    except Exception:
        return False
    finally:
        child.kill()
        child.wait()


@functools.cache
def gdb_calls_refused() -> str:
    """Why gdb cannot call a function in a process here ("" where it can).

    dynprof's own probe (dynprof.attach._gdb): on some CPUs and kernels gdb cannot write a
    thread's extended register state back, so attach refuses to inject (and says so); the
    tests of a real injection cannot run there, the refusal's test runs instead.
    """
    from dynprof.attach._gdb import GdbSession, RegistersRefused

    exe = shutil.which("gdb")
    if exe is None or not ptrace_works():
        return ""  # the tests' own gdb / ptrace skips say why
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        time.sleep(0.3)
        GdbSession(exe, child.pid, {}).run([])
        return ""
    except RegistersRefused as e:
        return e.said
    finally:
        child.kill()
        child.wait()


# The end-to-end families start real processes (training programs, torch, sidecars, servers):
# tests/integration, tests/frameworks and tests/gpu carry the `e2e` marker, so
# `pytest -m "not e2e"` is the unit suite alone (seconds per file, no process started).
E2E_DIRS = tuple(ROOT / "tests" / name for name in ("integration", "frameworks", "gpu"))


# Tests that must run on one xdist worker, one after the other: each family shares a setup made
# once (a module- or class-scoped fixture: on two workers it would be made twice, and a framework
# case's jobs run twice), or a machine-wide resource two workers must not use at once (the link
# tests' network namespaces and fixed ports; the default sidecar port 8787, which both cases of
# test_watch_sample_addresses listen on). A family is a module, or one case of a framework
# class (its class-scoped scenario). The groups are read by node id in the scheduler below:
# xdist's own `xdist_group` mark no longer groups under pytest 9.2 (it rewrites a node id field
# pytest stopped reading: pytest-dev/pytest-xdist#1386), and a mark the workers see is out of the
# scheduler's reach. tests/unit/test_suite_order.py holds each module here to a file that exists.
ONE_WORKER_MODULES = (
    "tests/integration/test_links.py",
    "tests/integration/test_serve_abuse.py",
    "tests/integration/test_hostile_sidecar_http.py",
    "tests/integration/test_healthcheck_fleet_simulated.py",
    "tests/unit/test_collectors_memory_plan_recipes.py",
    "tests/unit/test_sidecar_server.py",
    "tests/unit/test_watch_sample_addresses.py",
    "tests/integration/test_trace.py",
    "tests/integration/test_agent.py",
    "tests/integration/test_sidecar_actions_processes.py",
)
FRAMEWORKS = "tests/frameworks/"


def one_worker_group(nodeid: str) -> str | None:
    """The family ``nodeid`` runs in (None: it may run on any worker, alone)."""
    path, _, rest = nodeid.partition("::")
    if path in ONE_WORKER_MODULES:
        return path
    cls, _, test = rest.partition("::")
    if path.startswith(FRAMEWORKS) and test.endswith("]") and "[" in test:
        return f"{path}::{cls}[{test[test.index('[') + 1 : -1]}]"
    return None


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object:
    """xdist's `loadgroup` scheduling, with the families above as its groups."""
    from xdist.scheduler import LoadGroupScheduling

    class FamilyScheduling(LoadGroupScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return one_worker_group(nodeid) or super()._split_scope(nodeid)

    return FamilyScheduling(config, log)


# The longest tests and families (each over 20 s, most of it waiting: a 150 s link round, four
# ~100 s watch phases, Prometheus's scrapes; from `make test`'s --durations), run first: on
# xdist's workers (`make test`) they overlap the many short ones, where started last they would
# be the run's tail. Prefixes of node ids, in this order; every other test keeps its place.
# tests/unit/test_suite_order.py holds each prefix to a test that exists.
LONG_FIRST = (
    "tests/integration/test_links.py::",
    "tests/integration/test_watch_faults.py::test_busy_phases_longer_than_the_stall_time_are_not_called_a_hang",
    "tests/integration/test_watch_cli.py::test_watch_sample_every_on_this_nodes_agents",
    "tests/integration/test_prometheus.py::",
    "tests/integration/test_healthcheck_fleet_simulated.py::",
    "tests/integration/test_watch_faults.py::",
    "tests/frameworks/test_distributed.py::",
    "tests/integration/test_job_safety.py::",
    "tests/integration/test_roles_under_launchers.py::",
    "tests/frameworks/",
)


def long_first_rank(nodeid: str) -> int:
    """Where a test goes in the run: its LONG_FIRST index, or after all of them."""
    return next((i for i, prefix in enumerate(LONG_FIRST) if nodeid.startswith(prefix)), len(LONG_FIRST))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    items.sort(key=lambda item: long_first_rank(item.nodeid))  # stable: the rest keep their order
    for item in items:
        if any(Path(item.path).is_relative_to(folder) for folder in E2E_DIRS):
            item.add_marker(pytest.mark.e2e)
        if "gpu" in item.keywords and cuda_device_count() < 1:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU: run on the GPU machine (pytest -m gpu)"))
        if "multi_gpu" in item.keywords and cuda_device_count() < 2:
            item.add_marker(pytest.mark.skip(reason="needs two or more CUDA GPUs"))
        if "gdb_calls" in item.keywords and gdb_calls_refused():
            item.add_marker(
                pytest.mark.skip(
                    reason=f"gdb cannot write registers on this machine ({gdb_calls_refused()}): attach refuses "
                    "to inject here, which test_attach_refuses_where_gdb_cannot_write_registers checks"
                )
            )
        if "gdb_calls_refused" in item.keywords and not gdb_calls_refused():
            item.add_marker(pytest.mark.skip(reason="gdb can write registers here: attach injects (tested)"))
        if "ptrace" in item.keywords and not ptrace_works():
            item.add_marker(
                pytest.mark.skip(
                    reason="py-spy cannot read other processes here (no CAP_SYS_PTRACE or ptrace_scope > 1)"
                )
            )


# -- a test that times out: its children's stacks first ----------------------------------------
# pytest-timeout (300 s a test, pyproject.toml) fails a test that runs too long; every deadline a
# test waits on is shorter. Before it fails the test (and the test's fixtures kill the processes
# it started), the stacks of every process the test started are dumped with `dynprof stacks`,
# so a hang shows where each child was stuck.
CHILD_STACKS_BUDGET_S = 60.0
CHILD_STACKS_MAX = 16


def _descendants(root: int) -> list[int]:
    """Live descendants of ``root``, parents before their children, read from /proc."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as fh:
                fields = fh.read().rsplit(b")", 1)[1].split()
        except OSError:
            continue
        if fields[0] != b"Z":
            children.setdefault(int(fields[1]), []).append(int(entry))
    found: list[int] = []
    todo = list(children.get(root, []))
    while todo:
        pid = todo.pop(0)
        found.append(pid)
        todo.extend(children.get(pid, []))
    return found


def dump_children_stacks(item: pytest.Item) -> None:
    """Write the stacks of the test's child processes to the terminal (each with `dynprof stacks`)."""
    terminal = item.config.get_terminal_writer()
    pids = _descendants(os.getpid())
    terminal.sep("+", title=f"Timeout: stacks of the {len(pids)} processes this test started")
    deadline = time.monotonic() + CHILD_STACKS_BUDGET_S
    for pid in pids[:CHILD_STACKS_MAX]:
        left = deadline - time.monotonic()
        if left <= 1:
            terminal.line(f"pid {pid}: not read (out of time)")
            continue
        command = "?"
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as fh:
                command = " ".join(fh.read().decode(errors="replace").replace("\0", " ").split())[:200]
            found = run_cli("stacks", "--pid", str(pid), "--no-save", timeout=min(30.0, left))
            text = (found.stdout + found.stderr).rstrip()
        except Exception as exc:
            text = f"(dynprof stacks failed: {exc})"
        terminal.sep("-", title=f"pid {pid}: {command}")
        terminal.line(text)
    if len(pids) > CHILD_STACKS_MAX:
        terminal.line(f"({len(pids) - CHILD_STACKS_MAX} more processes not read)")


@pytest.hookimpl(tryfirst=True)
def pytest_timeout_set_timer(item: pytest.Item, settings: object) -> bool | None:
    """pytest-timeout's signal method, with the children's stacks dumped before the failure."""
    if getattr(settings, "method", None) != "signal" or threading.current_thread() is not threading.main_thread():
        return None  # pytest-timeout's own timer
    import pytest_timeout

    def handler(signum: int, frame: object) -> None:
        __tracebackhide__ = True
        if settings.disable_debugger_detection or not pytest_timeout.is_debugging():  # type: ignore[attr-defined]
            dump_children_stacks(item)
        pytest_timeout.timeout_sigalrm(item, settings)

    def cancel() -> None:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, signal.SIG_DFL)

    item.cancel_timeout = cancel  # type: ignore[attr-defined]
    signal.signal(signal.SIGALRM, handler)
    signal.setitimer(signal.ITIMER_REAL, settings.timeout)  # type: ignore[attr-defined]
    return True


# -- isolation and hygiene ----------------------------------------------------------------------
@pytest.fixture(autouse=True)
def dynprof_dirs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, Path]]:
    """A private run dir (short path: Unix socket paths are limited to 107 bytes) and store."""
    run_dir = Path(tempfile.mkdtemp(prefix="dp-", dir="/tmp"))
    artifacts = tmp_path / "artifacts"
    monkeypatch.setenv("DYNPROF_RUN_DIR", str(run_dir))
    monkeypatch.setenv("DYNPROF_ARTIFACT_DIR", str(artifacts))
    monkeypatch.delenv("DYNPROF", raising=False)
    monkeypatch.delenv("DYNPROF_JOB_ID", raising=False)
    yield {"run": run_dir, "artifacts": artifacts}
    shutil.rmtree(run_dir, ignore_errors=True)


@pytest.fixture
def eager_process(monkeypatch: pytest.MonkeyPatch) -> Callable[..., list[str]]:
    """The memory plan's measurement in this pytest process as in a job that compiled nothing:
    other tests of the same worker run torch.compile in-process, and a measured step refuses a
    process with compiled code (collectors.memory.plan.blocks.compiled_code says why)."""
    import collectors.memory.plan.capture as capture

    real: Callable[..., list[str]] = capture.compiled_code
    monkeypatch.setattr(capture, "compiled_code", lambda limit=3: [])
    return real  # for a test that reads dynamo's record itself


@pytest.fixture
def short_dir() -> Iterator[Callable[[str], str]]:
    """``short_dir(name)``: a new directory under /tmp (a short path, for run dirs whose Unix
    sockets must fit 107 bytes), removed with everything in it at the test's end. Name it first
    among a test's fixtures: it is then removed after the targets and sidecars that write there."""
    made: list[str] = []

    def make(name: str) -> str:
        made.append(tempfile.mkdtemp(prefix=f"dp-{name}-", dir="/tmp"))
        return made[-1]

    yield make
    for path in made:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(autouse=True)
def hygiene() -> Iterator[None]:
    """Each test leaves no agent, no profiler, no memory history and no stray agent threads."""
    import signal

    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2)}
    yield
    import dynprof.agent

    dynprof.agent.shutdown()
    for s, h in handlers.items():
        assert signal.getsignal(s) == h, f"signal handler for {s!r} was not restored"
    torch = sys.modules.get("torch")
    if torch is not None:
        from torch.autograd import profiler as autograd_profiler

        assert not autograd_profiler._is_profiler_enabled, "a torch profiler was left running"
        # a measurement's saved-tensor hooks or dispatch mode left on this thread would change
        # every later test of the worker (seen: another test's plan measured through them)
        top = getattr(getattr(getattr(torch, "_C", None), "_autograd", None), "_top_saved_tensors_default_hooks", None)
        if top is not None:  # the real torch (a test may stand a fake one in sys.modules)
            from torch.utils._python_dispatch import _get_current_dispatch_mode

            hooks = top(False)
            assert hooks is None, f"saved-tensor hooks were left on: {hooks}"
            assert _get_current_dispatch_mode() is None, "a dispatch mode was left on"
    deadline = time.monotonic() + 2
    while time.monotonic() < deadline:
        stray = [t.name for t in threading.enumerate() if t.name == "dynprof-agent" and t.is_alive()]
        if not stray:
            break
        time.sleep(0.05)
    else:
        raise AssertionError(f"agent threads left running: {stray}")


def wait_parked(pid: int, timeout: float = 60.0, reads: int = 3) -> None:
    """Wait until the main thread of ``pid`` sleeps in the kernel (state S) on ``reads``
    consecutive looks 0.1 s apart: parked where the test sent it (a sleep, a blocking collective,
    a C call), not still on its way there after its READY line, however slow the machine."""
    deadline = time.monotonic() + timeout
    seen = 0
    state = b"?"
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/task/{pid}/stat", "rb") as fh:
                state = fh.read().rsplit(b")", 1)[1].split()[0]
        except OSError as exc:
            raise AssertionError(f"pid {pid} is gone while waiting for it to park: {exc}") from None
        seen = seen + 1 if state == b"S" else 0
        if seen >= reads:
            return
        time.sleep(0.1)
    raise AssertionError(f"the main thread of pid {pid} did not park within {timeout} s (state {state.decode()})")


@pytest.fixture
def parked() -> object:
    """``parked(pid)``: :func:`wait_parked` for tests (the main thread of pid is parked)."""
    return wait_parked


# -- real target processes ------------------------------------------------------------------
class Target(LineReader):
    """A child process started for a test, with its output lines collected."""

    def __init__(self, proc: subprocess.Popen[str], run_dir: str | None = None) -> None:
        self.run_dir = run_dir  # its DYNPROF_RUN_DIR, where its agents' logs are
        super().__init__(proc)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def wait_for_line(self, prefix: str, timeout: float = 60.0, count: int = 1) -> list[str]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = [line for line in self.lines if line.startswith(prefix)]
            if len(found) >= count:
                return found
            if self.proc.poll() is not None and not self._reader.is_alive():
                break
            time.sleep(0.02)
        raise AssertionError(
            f"no {prefix!r} line from pid {self.proc.pid} after {timeout} s "
            f"(exit {self.proc.poll()}); output:\n" + "\n".join(self.lines[-40:]) + self.stacks()
        )

    def stacks(self) -> str:
        """Where the process is stuck, read with our own `dynprof stacks` (empty if it has exited)."""
        if self.proc.poll() is not None:
            return ""
        try:
            found = run_cli("stacks", "--pid", str(self.proc.pid), "--no-save", timeout=60)
        except Exception as exc:
            return f"\n(dynprof stacks failed: {exc})"
        return f"\nstacks of pid {self.proc.pid}:\n{found.stdout}{found.stderr}"

    def state(self, pid: int | None = None) -> str:
        """For a failed call's message: whether the target still runs, its last output lines
        (its stderr too) and the end of the agent log of ``pid`` (a process of the target; the
        agent notes there a connection it could not serve)."""
        parts = [f"\ntarget exit status: {self.proc.poll()}; its last output:", *self.lines[-20:]]
        if pid is not None and self.run_dir:
            log = Path(self.run_dir) / "logs" / f"{pid}.log"
            tail = log.read_text(errors="replace").splitlines()[-30:] if log.exists() else ["(none)"]
            parts += [f"agent log {log}:", *tail]
        return "\n".join(parts)

    def ready_pids(self, count: int = 1, timeout: float = 60.0) -> list[int]:
        return [int(line.split()[1]) for line in self.wait_for_line("READY", timeout, count)[:count]]

    def stop(self) -> None:
        """End the target and every process it left in its session (started with
        ``start_new_session``, so its group is its pid): spawned helpers, multiprocessing's
        resource tracker and DataLoader workers outlive a terminated parent, and would go on
        writing to the test's run directory after the test."""
        if self.proc.poll() is None:
            terminate(self.proc)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)


def start_target(args: list[str], under_run: bool = True, env: dict[str, str] | None = None) -> Target:
    """A target process: ``python ARGS``, under `dynprof run` unless ``under_run`` is false, in
    its own session, with this process's environment and ``env``."""
    full_env = dict(os.environ)
    full_env["PYTHONUNBUFFERED"] = "1"
    if env:
        full_env.update(env)
    cmd = (
        [sys.executable, "-m", "dynprof", "run", "-q", "--", sys.executable, *args]
        if under_run
        else [sys.executable, *args]
    )
    return Target(start_in_session(cmd, full_env, ROOT), full_env.get("DYNPROF_RUN_DIR"))


@pytest.fixture
def spawn() -> Iterator[object]:
    """``spawn(args, under_run=True, env=None)`` starts a target; all are reaped at the end."""
    targets: list[Target] = []

    def _spawn(args: list[str], under_run: bool = True, env: dict[str, str] | None = None) -> Target:
        targets.append(start_target(args, under_run, env))
        return targets[-1]

    try:
        yield _spawn
    finally:
        for t in targets:
            t.stop()


# -- targets shared by the tests of a module -------------------------------------------------------
# A torch training process costs 3.5 CPU-s to start (importing torch, then torch._dynamo at its
# first optimizer) before a test checks anything. Tests that only ask a running loop questions
# (trace it, refuse a bad request, send it garbage) share one: ``shared_target``. A module that
# uses it is one worker's family (ONE_WORKER_MODULES; tests/unit/test_suite_order.py checks),
# or each worker would start its own.
@pytest.fixture(scope="module")
def module_dirs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Path]]:
    """The run dir and store of a module's shared targets (removed after them)."""
    run_dir = Path(tempfile.mkdtemp(prefix="dp-", dir="/tmp"))
    artifacts = tmp_path_factory.mktemp("module-store") / "artifacts"
    yield {"run": run_dir, "artifacts": artifacts}
    shutil.rmtree(run_dir, ignore_errors=True)


@pytest.fixture(scope="module")
def module_targets(module_dirs: dict[str, Path]) -> Iterator[dict[object, Target]]:
    started: dict[object, Target] = {}
    yield started
    for target in started.values():
        target.stop()


def _idle(target: Target, timeout: float = 60.0) -> None:
    """Until the agent of ``target`` (its READY pid) traces nothing: a trace an earlier test
    left running or armed (it failed midway) is stopped, so each test starts from an idle agent."""
    from dynprof.client import AgentClient
    from dynprof.proto import pb

    (pid,) = target.ready_pids(timeout=120)
    client = AgentClient.for_pid(pid, timeout=30)
    deadline = time.monotonic() + timeout
    state = client.status().trace.state
    if state in ("armed", "tracing"):
        client.request(raise_on_error=False, stop_trace=pb.StopTraceRequest())
    while state != "idle":
        assert time.monotonic() < deadline, f"the shared target {pid}'s trace is still {state} after {timeout} s"
        time.sleep(0.1)
        state = client.status().trace.state


@pytest.fixture
def shared_target(
    module_dirs: dict[str, Path],
    module_targets: dict[object, Target],
    dynprof_dirs: dict[str, Path],
    monkeypatch: pytest.MonkeyPatch,
) -> Callable[..., Target]:
    """``shared_target(args, under_run=True, env=None)``: the module's running target of those
    arguments, started by the first test that asks for it and ended after the module's last
    (give it a time limit longer than the module takes on a loaded machine: train_program.py's
    default --max-seconds of 120 is not).
    Under `dynprof run`, its agent traces nothing when the test gets it. The test's run dir and
    store (``dynprof_dirs``, the environment its CLI calls see) become the module's, where the
    target registered and writes."""
    monkeypatch.setenv("DYNPROF_RUN_DIR", str(module_dirs["run"]))
    monkeypatch.setenv("DYNPROF_ARTIFACT_DIR", str(module_dirs["artifacts"]))
    dynprof_dirs.update(module_dirs)

    def get(args: list[str], under_run: bool = True, env: dict[str, str] | None = None) -> Target:
        key = (tuple(args), under_run, tuple(sorted((env or {}).items())))
        target = module_targets.get(key)
        if target is None or target.proc.poll() is not None or any(line.startswith("DONE") for line in target.lines):
            # (a loop that reached its own limit says DONE and exits: the next test gets a new one)
            if target is not None:
                target.stop()
            target = module_targets[key] = start_target(args, under_run, env)
        if under_run:
            _idle(target)
        return target

    return get


@pytest.fixture
def sim_nodes(tmp_path: Path) -> Iterator[dict[str, object]]:
    """Two simulated nodes, each a `dynprof serve` with its own run directory, store and
    DYNPROF_HOST: ``{"a": SimNode, "b": SimNode, "token": Path, "hosts": "A,B"}``, node A on
    127.0.0.1 and node B on localhost (tests/support/nodes.py). Stopped at the test's end."""
    from tests.support.nodes import two_nodes

    with two_nodes(tmp_path, "sim-nodes-token-0123456789") as nodes:
        yield nodes


@pytest.fixture(scope="session")
def nobody_site() -> Iterator[tuple[Path, str]]:
    """(a world-readable copy of dynprof and what it imports, the interpreter user `nobody` runs it
    with): the checkout itself may be private (a clone in `mktemp -d`). tests/support/other_user.py."""
    from tests.support.other_user import readable_site

    with readable_site() as site:
        yield site


@pytest.fixture
def nobody(nobody_site: tuple[Path, str]) -> Iterator[object]:
    """An ``OtherUser``: runs dynprof as `nobody` in a fresh directory of its own (its run dir and
    store inside), from the copy of ``nobody_site``. Skips without root (fails under CI without
    what it needs)."""
    from tests.support.other_user import other_user

    with other_user(*nobody_site) as user:
        yield user


def run_cli(*args: str, timeout: float = 120, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """Run ``python -m dynprof ARGS`` as a real subprocess."""
    full_env = dict(os.environ)
    if env:
        full_env.update(env)
    return run_dynprof(list(args), full_env, timeout)


@pytest.fixture
def cli() -> object:
    """``cli(*args)`` runs ``python -m dynprof ARGS`` in a subprocess and returns the result."""
    return run_cli


HANG_PROGRAM = "tests/integration/programs/hang_program.py"


@pytest.fixture
def hang_job(spawn: object) -> object:
    """``hang_job(job, hold, run_args=())`` starts a 2-rank gloo job of hang_program.py under
    ``dynprof run RUN_ARGS``: rank 0 waits in an all_reduce that rank 1 (holding in ``hold``:
    sleep, gil, ...) never enters. Returns the ranks' pids once both are in place."""

    def _start(job: str, hold: str = "sleep", run_args: list[str] | tuple[str, ...] = ()) -> list[int]:
        port = str(free_port())
        targets = []
        for rank in (0, 1):
            env = rank_env(rank, 2, port, DYNPROF_JOB_ID=job)
            args = [
                "-m",
                "dynprof",
                "run",
                "-q",
                *run_args,
                "--",
                sys.executable,
                HANG_PROGRAM,
                "--hold",
                hold,
                "--seconds",
                "90",
            ]
            targets.append(spawn(args, under_run=False, env=env))  # type: ignore[operator]
        pids = [pid for t in targets for pid in t.ready_pids(timeout=90)]
        for pid in pids:  # rank 0 enters the collective right after its READY line
            wait_parked(pid)
        return pids

    return _start
