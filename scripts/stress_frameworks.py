"""Trace the crash-prone framework loops many times and count what happens to the job.

    PYTHONPATH=. python scripts/stress_frameworks.py                 # every case, 20 traces each
    PYTHONPATH=. python scripts/stress_frameworks.py --runs 5 --cases ckpt-duration,fsdp2-duration
    PYTHONPATH=. python scripts/stress_frameworks.py --device cuda    # the checkpointing and own-profiler loops on a GPU

Each case is a training loop from tests/frameworks/programs/ launched under `dynprof run` and one
kind of trace (`dynprof start --steps 3` or `--duration SEC`) requested from it RUNS times, one
after the other. A job killed by a signal is counted as a crash and started again; with --fresh
every trace gets a new job. For each case the table gives: runs, crashes (the job died of a
signal), traces complete, refused with a clear error (non-zero exit, no traceback; or, for a job
with its own profiler, a trace given up or cut short with a reason naming that profiler), and
failed (anything else: a failed or partial artifact, a traceback, no answer, or a refusal that
blames a profiler of the job's own on a job that runs none); for duration mode also the
training thread's pause to stop the profiler (`training_thread_pause_ms` of the manifest) and
the requested vs profiled seconds (`profiled_s`). Exits 1 if any job crashed.

Everything runs in a private run directory and artifact store, removed at the end (--keep keeps
the store). Needs the `frameworks` extra for the HF and Lightning cases (skipped without it).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
PROGRAMS = ROOT / "tests" / "frameworks" / "programs"


@dataclass(frozen=True)
class Case:
    name: str
    program: str
    args: tuple[str, ...]
    mode: str  # "steps", "duration", or "steps+duration" (a step-mode trace, then a duration-mode one)
    ranks: int = 1
    needs: tuple[str, ...] = ()
    crash_prone: bool = True
    takes_device: bool = False  # the program has --device (run on CUDA with --device cuda)
    own_profiler: bool = False  # the job runs its own torch.profiler: dynprof may stand back for it


HF = ("transformers", "accelerate")
CASES = [
    # duration-mode trace inside a checkpointing loop (starts and stops can land inside backward)
    Case("ckpt-duration", "checkpoint_program.py", (), "duration", takes_device=True),
    Case("hf-ckpt-duration", "hf_trainer_program.py", ("--grad-ckpt", "--accum", "2"), "duration", needs=HF),
    # step mode with the optimizer stepped from post-accumulate-grad hooks (inside backward)
    Case("optinbwd-steps", "opt_in_backward_program.py", (), "steps"),
    # a job that runs its own torch.profiler
    Case("ownprof-steps", "own_profiler_program.py", (), "steps", takes_device=True, own_profiler=True),
    Case("ownprof-duration", "own_profiler_program.py", (), "duration", takes_device=True, own_profiler=True),
    # FSDP2 on gloo, two ranks
    Case("fsdp2-duration", "dist_program.py", ("--mode", "fsdp2"), "duration", ranks=2),
    # duration mode on the other framework loops: stop pause and requested vs profiled seconds
    Case("hf-duration", "hf_trainer_program.py", (), "duration", needs=HF, crash_prone=False),
    Case(
        "lightning-duration",
        "lightning_program.py",
        ("--accum", "2"),
        "duration",
        needs=("lightning|pytorch_lightning",),
        crash_prone=False,
    ),
    Case("ddp-duration", "dist_program.py", ("--mode", "ddp"), "duration", ranks=2, crash_prone=False),
    Case("amp-duration", "amp_program.py", (), "duration", crash_prone=False),
    # a step-mode trace, then at once a duration-mode trace, in an autocast + GradScaler loop
    Case("amp-steps-duration", "amp_program.py", (), "steps+duration"),
]


@dataclass
class Tally:
    runs: int = 0
    crashes: int = 0
    complete: int = 0
    refused: int = 0
    failed: int = 0
    pauses_ms: list[float] = field(default_factory=list)
    profiled_s: list[float] = field(default_factory=list)
    reasons: Counter[str] = field(default_factory=Counter)
    signals: Counter[str] = field(default_factory=Counter)


class Job:
    """The loop under `dynprof run`, its output collected."""

    def __init__(self, case: Case, env: dict[str, str]) -> None:
        prog = str(PROGRAMS / case.program)
        cmd = [sys.executable, prog, *case.args, "--max-seconds", "900"]
        if case.ranks > 1:
            cmd = [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--standalone",
                "--nproc-per-node",
                str(case.ranks),
                prog,
                *case.args,
                "--max-seconds",
                "900",
            ]
        self.case = case
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "dynprof", "run", "-q", "--", *cmd],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
            cwd=str(ROOT),
            start_new_session=True,
        )
        self.lines: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()
        self.pids: list[int] = []

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))

    def wait_ready(self, timeout: float = 300) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and self.proc.poll() is None:
            ready = [line for line in list(self.lines) if line.startswith("READY ")]
            if len(ready) >= self.case.ranks:
                self.pids = [int(line.split()[1]) for line in ready[: self.case.ranks]]
                return True
            time.sleep(0.05)
        return False

    def dead_signal(self) -> str | None:
        """The signal that killed the job or one of its ranks, if one did; "" if it exited without one."""
        rc = self.proc.poll()
        ranks_gone = [pid for pid in self.pids if not _alive(pid)]
        if rc is None and not ranks_gone:
            return None
        if rc is not None and rc < 0:
            return _signame(-rc)
        text = "\n".join(self.lines[-200:])
        found = re.search(r"Signal (\d+) \((SIG\w+)\)|exitcode\s*:\s*-(\d+)|(SIG(SEGV|ABRT|BUS|FPE|ILL|KILL))", text)
        if found:
            if found.group(2):
                return found.group(2)
            if found.group(3):
                return _signame(int(found.group(3)))
            return found.group(4)
        if "Segmentation fault" in text or "Fatal Python error" in text:
            return "SIGSEGV"
        if rc is None:  # a rank vanished but the launcher has not reported yet
            time.sleep(2)
            return self.dead_signal() if self.proc.poll() is not None else "rank gone"
        return ""

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, 15)
                self.proc.wait(timeout=15)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                try:
                    os.killpg(self.proc.pid, 9)
                except ProcessLookupError:
                    pass
                self.proc.wait(timeout=10)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie is dead
        return Path(f"/proc/{pid}/stat").read_text().split(") ", 1)[1][0] != "Z"
    except (OSError, IndexError):
        return False


def _signame(num: int) -> str:
    import signal

    try:
        return signal.Signals(num).name
    except ValueError:
        return f"signal {num}"


def _installed(spec: str) -> bool:
    return any(importlib.util.find_spec(name) is not None for name in spec.split("|"))


def _short(text: str) -> str:
    text = re.sub(r"\d+", "N", " ".join(text.split()))
    return text[:160]


def _stopped_by(result: dict[str, Any]) -> str:
    if not result.get("artifact"):
        return ""
    try:
        manifest = json.loads((Path(result["artifact"]) / "manifest.json").read_text())
    except (OSError, ValueError):
        return ""
    return f"stopped by {(manifest.get('summary') or {}).get('stopped_by')}"


def _yielded(result: dict[str, Any]) -> bool:
    """dynprof stood back for the job's own profiler and said so (not a failure of its own)."""
    if result.get("status") == "complete":
        return False
    if _stopped_by(result) == "stopped by job-profiler":
        return True
    return _names_a_job_profiler(str(result.get("error") or ""))


def _names_a_job_profiler(text: str) -> bool:
    text = text.lower()
    return "profiler" in text and ("by the job" in text or "job started its own" in text or "job's own" in text)


def trace_once(case: Case, job: Job, env: dict[str, str], duration: float, tally: Tally) -> None:
    sel = ",".join(map(str, job.pids))
    bounds = {
        "steps": [["--steps", "3"]],
        "duration": [["--duration", f"{duration:g}"]],
        "steps+duration": [["--steps", "3"], ["--duration", f"{duration:g}"]],
    }[case.mode]
    tally.runs += 1
    proc: subprocess.CompletedProcess[str] | None = None
    for bound in bounds:  # one after the other; the run's outcome is the first that is not complete
        try:
            proc = subprocess.run(
                [sys.executable, "-m", "dynprof", "start", "--pid", sel, *bound, "--json", "--timeout", "90"],
                capture_output=True,
                text=True,
                env=env,
                cwd=str(ROOT),
                timeout=150,
            )
        except subprocess.TimeoutExpired:
            proc = None
        if proc is None or proc.returncode != 0 or job.proc.poll() is not None:
            break
    time.sleep(0.5)  # a crash at the profiler's stop or export shows a moment after the reply
    sig = job.dead_signal()
    if sig:
        tally.crashes += 1
        tally.signals[sig] += 1
        return
    if sig == "":
        tally.failed += 1
        tally.reasons["the job exited (no signal) during the trace"] += 1
        return
    if proc is None:
        tally.failed += 1
        tally.reasons["dynprof start gave no answer within 150 s"] += 1
        return
    try:
        results = json.loads(proc.stdout)["results"]
    except (ValueError, KeyError, TypeError):
        results = None
    if not case.own_profiler and _names_a_job_profiler(proc.stdout + proc.stderr):
        tally.failed += 1  # this job runs no profiler of its own: dynprof's refusal is wrong
        tally.reasons["failed: claims a job profiler the job does not run: " + _short(proc.stderr or proc.stdout)] += 1
        return
    if results is None:
        if proc.returncode != 0 and "Traceback" not in proc.stderr:
            tally.refused += 1
            tally.reasons["refused: " + _short(proc.stderr)] += 1
        else:
            tally.failed += 1
            tally.reasons["failed: " + _short(proc.stderr or proc.stdout)] += 1
        return
    if {r["status"] for r in results} != {"complete"}:
        why = "; ".join(f"{r['status']} {r.get('error') or _stopped_by(r)}" for r in results)
        if all(_yielded(r) for r in results):
            tally.refused += 1
            tally.reasons["stood back for the job's profiler: " + _short(why)] += 1
        else:
            tally.failed += 1
            tally.reasons["failed: " + _short(why)] += 1
        return
    tally.complete += 1
    for r in results:
        summary = json.loads((Path(r["artifact"]) / "manifest.json").read_text()).get("summary", {})
        if bounds[-1][0] == "--duration":
            tally.pauses_ms.append(float(summary.get("training_thread_pause_ms", float("nan"))))
            tally.profiled_s.append(float(summary.get("profiled_s", float("nan"))))


def run_case(case: Case, runs: int, duration: float, fresh: bool, env: dict[str, str]) -> Tally:
    tally = Tally()
    job: Job | None = None
    try:
        while tally.runs < runs:
            if job is None or fresh or job.proc.poll() is not None:
                if job is not None:
                    job.stop()
                job = Job(case, env)
                if not job.wait_ready():
                    tally.reasons["the job did not start: " + _short(" ".join(job.lines[-5:]))] += 1
                    job.stop()
                    break
                time.sleep(1.0)  # past the first steps
            trace_once(case, job, env, duration, tally)
            print(
                f"  {case.name} run {tally.runs}: crashes {tally.crashes} complete {tally.complete} "
                f"refused {tally.refused} failed {tally.failed}",
                file=sys.stderr,
                flush=True,
            )
    finally:
        if job is not None:
            job.stop()
    return tally


def _stat(values: list[float], fmt: str) -> str:
    vals = [v for v in values if v == v]
    if not vals:
        return "-"
    return f"{fmt.format(statistics.median(vals))} / {fmt.format(max(vals))}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=20, help="traces per case (default 20)")
    parser.add_argument("--cases", default="", help="comma-separated case names (default: all); see --list")
    parser.add_argument("--list", action="store_true", help="list the cases and exit")
    parser.add_argument("--duration", type=float, default=1.0, help="seconds of a duration-mode trace (default 1)")
    parser.add_argument("--fresh", action="store_true", help="a new job for every trace")
    parser.add_argument(
        "--device",
        default="",
        help="run the loops that take a device there (e.g. cuda): the checkpointing and own-profiler cases",
    )
    parser.add_argument("--keep", action="store_true", help="keep the artifact store (its path is printed)")
    parser.add_argument("--json", metavar="FILE", help="also write the table as JSON to FILE")
    args = parser.parse_args(argv)
    if args.list:
        for c in CASES:
            print(f"{c.name:20} {c.mode:9} {c.program} {' '.join(c.args)}{'' if c.crash_prone else '  (timing)'}")
        return 0
    names = [n for n in args.cases.split(",") if n]
    unknown = [n for n in names if n not in {c.name for c in CASES}]
    if unknown:
        parser.error(f"unknown case(s) {', '.join(unknown)}; see --list")
    chosen = [c for c in CASES if not names or c.name in names]
    if args.device:
        chosen = [
            dataclasses.replace(c, name=f"{c.name}-{args.device}", args=(*c.args, "--device", args.device))
            for c in chosen
            if c.takes_device
        ]

    run_dir = Path(tempfile.mkdtemp(prefix="dps-", dir="/tmp"))
    store = Path(tempfile.mkdtemp(prefix="dynprof-stress-"))
    env = dict(os.environ)
    for name in ("DYNPROF", "DYNPROF_HANG_TIMEOUT"):
        env.pop(name, None)
    env.update(
        PYTHONUNBUFFERED="1",
        DYNPROF_RUN_DIR=str(run_dir),
        DYNPROF_ARTIFACT_DIR=str(store),
        DYNPROF_JOB_ID="stress",
        OMP_NUM_THREADS="1",
        TOKENIZERS_PARALLELISM="false",
        HF_HUB_OFFLINE="1",
    )
    rows: list[dict[str, Any]] = []
    try:
        for case in chosen:
            missing = [n for n in case.needs if not _installed(n)]
            if missing:
                print(f"{case.name}: skipped, {', '.join(missing)} not installed", file=sys.stderr)
                continue
            t0 = time.monotonic()
            tally = run_case(case, args.runs, args.duration, args.fresh, env)
            rows.append(
                {
                    "case": case.name,
                    "mode": case.mode,
                    "runs": tally.runs,
                    "crashes": tally.crashes,
                    "complete": tally.complete,
                    "refused": tally.refused,
                    "failed": tally.failed,
                    "signals": dict(tally.signals),
                    "pause_ms": tally.pauses_ms,
                    "profiled_s": tally.profiled_s,
                    "requested_s": args.duration if case.mode.endswith("duration") else None,
                    "reasons": dict(tally.reasons),
                    "wall_s": round(time.monotonic() - t0, 1),
                }
            )
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)
        if not args.keep:
            shutil.rmtree(store, ignore_errors=True)

    head = (
        f"{'case':20} {'runs':>4} {'crash':>5} {'compl':>5} {'refus':>5} {'fail':>4}  "
        f"{'stop pause ms med/max':>22}  {'profiled s med/max (req)':>26}"
    )
    print(head)
    print("-" * len(head))
    for r in rows:
        timing = r["mode"].endswith("duration")
        prof = f"{_stat(r['profiled_s'], '{:.2f}')} ({r['requested_s']:g})" if timing else "-"
        print(
            f"{r['case']:20} {r['runs']:>4} {r['crashes']:>5} {r['complete']:>5} {r['refused']:>5} {r['failed']:>4}  "
            f"{_stat(r['pause_ms'], '{:.1f}') if timing else '-':>22}  {prof:>26}"
        )
    for r in rows:
        for sig, n in r["signals"].items():
            print(f"  {r['case']}: {n} x killed by {sig}")
        for why, n in r["reasons"].items():
            print(f"  {r['case']}: {n} x {why}")
    if args.keep:
        print(f"artifacts kept in {store}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2) + "\n")
    crashed = sum(r["crashes"] for r in rows)
    if crashed:
        print(f"{crashed} crash(es): the job died of a signal", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
