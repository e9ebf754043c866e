"""One framework job, run twice: once under plain python, once under `dynprof run` with every
capture taken while it trains. The tests of each check read what the two runs recorded.

The dynprof run does, in order, while the job trains: `ps --json` twice a second apart (right
after READY, or after the case's `wait_for` line such as a new optimizer's), `stacks --full`, a
step-mode trace (`start --steps 3`), a duration-mode trace (`start --duration 1`), `ps --json`
again; then it lets the job run until it has computed at least as many losses as the plain run,
and ends it through its stop file. Each action's outcome (or exception) is recorded, so one
failure (a crashed job, say) shows in its own test and not as a setup error of all of them.
"""

from __future__ import annotations

import gzip
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.support.commands import run_dynprof
from tests.support.lines import LineReader, start_in_session

ROOT = Path(__file__).resolve().parents[2]
PROGRAMS = Path(__file__).resolve().parent / "programs"

STEP_TRACE_STEPS = 3
DURATION_S = 1.0
HANG_TIMEOUT_S = 3.0
CLI_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class Case:
    """A framework loop: its program, arguments and what it needs."""

    name: str
    program: str
    args: tuple[str, ...] = ()
    needs: tuple[str, ...] = ()  # importable modules the job needs (skipped without them)
    ranks: int = 1  # 2: launched by torchrun, --nproc-per-node 2
    plain_steps: int = 40  # optimizer steps of the plain run; the dynprof run reaches at least as many
    wait_for: str = ""  # a line the job prints before the captures begin (e.g. "STAGE 2")
    ci: bool = True  # False: run on demand only (`pytest -m frameworks`)
    slow: bool = False
    gpu: bool = False  # needs a CUDA GPU (marked `gpu`: skipped without one)
    own_profiler: bool = False  # the job runs its own torch.profiler: a clear refusal is acceptable

    def command(self, extra: list[str]) -> list[str]:
        prog = str(PROGRAMS / self.program)
        if self.ranks > 1:
            return [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--standalone",
                "--nproc-per-node",
                str(self.ranks),
                prog,
                *self.args,
                *extra,
            ]
        return [sys.executable, prog, *self.args, *extra]


@dataclass
class Outcome:
    """What one CLI action returned: the completed process, or the exception it raised."""

    argv: list[str]
    proc: subprocess.CompletedProcess[str] | None = None
    error: str = ""

    @property
    def ok(self) -> bool:
        return self.proc is not None and self.proc.returncode == 0

    def json(self) -> Any:
        assert self.proc is not None, self.describe()
        return json.loads(self.proc.stdout)

    def describe(self) -> str:
        if self.proc is None:
            return f"dynprof {' '.join(self.argv)}: {self.error}"
        return (
            f"dynprof {' '.join(self.argv)}: exit {self.proc.returncode}\n"
            f"stdout: {self.proc.stdout[-3000:]}\nstderr: {self.proc.stderr[-3000:]}"
        )


@dataclass
class JobRun:
    """A finished run of the job: every output line, exit status and the pids of its ranks."""

    lines: list[str]
    returncode: int | None
    pids: list[int] = field(default_factory=list)
    error: str = ""

    def losses(self) -> dict[str, list[str]]:
        out: dict[str, list[str]] = {}
        for line in self.lines:
            parts = line.split()
            if len(parts) == 3 and parts[0] == "LOSS":
                out.setdefault(parts[1], []).append(parts[2])
        return out

    def loss_count(self) -> int:
        return sum(1 for line in self.lines if line.startswith("LOSS "))

    def tail(self, n: int = 60) -> str:
        return "\n".join(self.lines[-n:])


@dataclass
class Scenario:
    case: Case
    plain: JobRun
    traced: JobRun
    env: dict[str, str]
    steps_before: Outcome | None = None
    steps_soon_after: Outcome | None = None  # a second later, before any capture
    step_trace: Outcome | None = None
    duration_trace: Outcome | None = None
    stacks: Outcome | None = None
    steps_after: Outcome | None = None
    hang_listing: Outcome | None = None
    stage_lines_seen: bool = True
    leftover_tmp: list[str] = field(default_factory=list)  # hidden in-progress dirs left in the store

    def artifacts(self, outcome: Outcome | None) -> list[tuple[dict[str, Any], dict[str, Any]]]:
        """(result, manifest) of each process's trace of a `start --json` outcome."""
        assert outcome is not None and outcome.ok, outcome.describe() if outcome else "not attempted"
        out = []
        for res in outcome.json()["results"]:
            manifest = json.loads((Path(res["artifact"]) / "manifest.json").read_text()) if res.get("artifact") else {}
            out.append((res, manifest))
        return out


def read_trace(path: Path) -> dict[str, Any]:
    with gzip.open(path, "rt") as fh:
        data: dict[str, Any] = json.load(fh)
    return data


def normalize(line: str) -> str:
    """A line with its numbers, addresses and temporary names blurred, to compare two runs."""
    line = re.sub(r"0x[0-9a-fA-F]+", "0x#", line)
    line = re.sub(r"/tmp/[^\s'\"]+", "/tmp/#", line)
    return re.sub(r"\d+(\.\d+)?(e[-+]?\d+)?", "#", line)


# -- processes --------------------------------------------------------------------------------
class _Job(LineReader):
    def __init__(self, argv: list[str], env: dict[str, str]) -> None:
        super().__init__(start_in_session(argv, env, ROOT))

    def wait_until(self, pred: Any, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if pred():
                return True
            if self.proc.poll() is not None and not self._reader.is_alive():
                return bool(pred())
            time.sleep(0.05)
        return False

    def lines_starting(self, prefix: str) -> list[str]:
        return [line for line in list(self.lines) if line.startswith(prefix)]

    def finish(self, timeout: float) -> int | None:
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, 15)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, 9)
                self.proc.wait(timeout=10)
            self._reader.join(timeout=5)
            return None
        self._reader.join(timeout=10)
        return self.proc.returncode

    def kill(self) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, 9)
            except ProcessLookupError:
                pass
            self.proc.wait(timeout=10)


def base_env(run_dir: Path, artifacts: Path, job_id: str) -> dict[str, str]:
    env = dict(os.environ)
    for name in ("DYNPROF", "DYNPROF_HANG_TIMEOUT", "DYNPROF_HANG_FIRST_STEP_TIMEOUT"):
        env.pop(name, None)
    env.update(
        PYTHONUNBUFFERED="1",
        DYNPROF_RUN_DIR=str(run_dir),
        DYNPROF_ARTIFACT_DIR=str(artifacts),
        DYNPROF_JOB_ID=job_id,
        OMP_NUM_THREADS="1",
        TOKENIZERS_PARALLELISM="false",
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
    )
    return env


def cli(env: dict[str, str], *args: str, timeout: float = CLI_TIMEOUT_S) -> Outcome:
    argv = list(args)
    try:
        proc = run_dynprof(argv, env, timeout)
    except subprocess.TimeoutExpired:
        return Outcome(argv, error=f"no answer within {timeout:g} s")
    return Outcome(argv, proc=proc)


TEARDOWN_CRASH = "terminate called without an active exception"


def _crashed_in_teardown(lines: list[str], rc: int | None, ranks: int) -> bool:
    """Every rank said DONE, then torch's own teardown aborted the process (seen with FSDP2 on
    the 2-core CI machine, in the run without dynprof): the job's work was all done."""
    done = sum(1 for line in lines if line.startswith("DONE"))
    return rc not in (0, None) and done >= ranks and any(TEARDOWN_CRASH in line for line in lines)


def run_plain(case: Case, env: dict[str, str]) -> JobRun:
    """The job without dynprof: the baseline the traced run is compared with. A baseline whose
    teardown crashed after every rank's DONE is run once more (dynprof was not in it); the run
    under dynprof is never retried."""
    for attempt in (1, 2):
        job = _Job(case.command(["--stop-after", str(case.plain_steps)]), env)
        rc = job.finish(timeout=600 if case.slow else 300)
        lines = list(job.lines)
        if attempt == 2 or not _crashed_in_teardown(lines, rc, case.ranks):
            break
    return JobRun(lines, rc, error="" if rc is not None else "timed out")


def run_traced(case: Case, env: dict[str, str], stop_file: Path, need: list[int]) -> Scenario:
    run_env = dict(env)
    argv = [
        sys.executable,
        "-m",
        "dynprof",
        "run",
        "-q",
        "--hang-timeout",
        str(HANG_TIMEOUT_S),
        "--",
        *case.command(["--stop-file", str(stop_file), "--max-seconds", "400"]),
    ]
    job = _Job(argv, run_env)
    sc = Scenario(case=case, plain=JobRun([], None), traced=JobRun([], None), env=run_env)
    try:
        ready_timeout = 400 if case.slow else 180
        if not job.wait_until(lambda: len(job.lines_starting("READY")) >= case.ranks, ready_timeout):
            job.kill()
            sc.traced = JobRun(list(job.lines), job.proc.returncode, error="the job never printed READY")
            return sc
        pids = [int(line.split()[1]) for line in job.lines_starting("READY")[: case.ranks]]
        if case.wait_for:
            sc.stage_lines_seen = job.wait_until(lambda: bool(job.lines_starting(case.wait_for)), 180)
        sel = ",".join(map(str, pids))
        sc.steps_before = cli(run_env, "ps", "--json")
        # asked again a second later, and then until every rank has stepped since (a loaded
        # machine may take longer than a second for one step)
        deadline = time.monotonic() + 120
        time.sleep(1.0)
        sc.steps_soon_after = cli(run_env, "ps", "--json")
        while time.monotonic() < deadline and not _stepped(sc.steps_before, sc.steps_soon_after, pids):
            time.sleep(0.5)
            sc.steps_soon_after = cli(run_env, "ps", "--json")
        sc.stacks = cli(run_env, "stacks", "--pid", sel, "--no-save", "--full")
        sc.step_trace = cli(run_env, "start", "--pid", sel, "--steps", str(STEP_TRACE_STEPS), "--json")
        sc.duration_trace = cli(run_env, "start", "--pid", sel, "--duration", str(DURATION_S), "--json")
        time.sleep(0.5)
        sc.steps_after = cli(run_env, "ps", "--json")
        # Run on until every rank has computed at least the losses of the plain run.
        job.wait_until(lambda: all(a >= b for a, b in zip(_losses_by_rank(job.lines, case.ranks), need)), 300)
        stop_file.write_text("stop\n")
        rc = job.finish(timeout=120)
        sc.hang_listing = cli(run_env, "ls", "--kind", "hang", "--json")
        store = Path(run_env["DYNPROF_ARTIFACT_DIR"])
        sc.leftover_tmp = sorted(str(p.relative_to(store)) for p in store.glob("*/*/*/*/.*.tmp"))
        sc.traced = JobRun(
            list(job.lines), rc, pids, error="" if rc is not None else "did not exit after its stop file"
        )
    finally:
        job.kill()
    return sc


def _stepped(before: Outcome, after: Outcome, pids: list[int]) -> bool:
    """Every pid's step count in ``after`` is past the one in ``before`` (False if unreadable)."""
    try:
        steps = [{a["pid"]: a["step"] for a in o.json()["agents"]} for o in (before, after)]
        return all((steps[1].get(p) or 0) > (steps[0].get(p) or 0) for p in pids)
    except Exception:
        return False


def _losses_by_rank(lines: list[str], ranks: int) -> list[int]:
    """How many LOSS lines each rank has printed (tags ``r<rank>:...`` on a torchrun job)."""
    done = [0] * ranks
    for line in list(lines):
        parts = line.split()
        if len(parts) != 3 or parts[0] != "LOSS":
            continue
        tag = parts[1]
        rank = 0
        if tag.startswith("r") and ":" in tag:
            head, tag = tag.split(":", 1)
            rank = int(head[1:])
        if rank < ranks:
            done[rank] += 1
    return done


def run_scenario(case: Case, workdir: Path) -> Scenario:
    run_dir = Path(tempfile.mkdtemp(prefix="dpf-", dir="/tmp"))
    try:
        env = base_env(run_dir, workdir / "artifacts", f"fw-{case.name}")
        plain = run_plain(case, env)
        sc = run_traced(case, env, workdir / "stop", _losses_by_rank(plain.lines, case.ranks))
        sc.plain = plain
        return sc
    finally:
        # The agents' logs outlive the run directory, for whoever reads a failure.
        if (run_dir / "logs").is_dir():
            shutil.copytree(run_dir / "logs", workdir / "agent-logs", dirs_exist_ok=True)
        shutil.rmtree(run_dir, ignore_errors=True)
