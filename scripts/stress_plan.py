"""Ask one training job for memory plans, traces and memory snapshots at once, many times, with
a sidecar polling the node, and count what happens to the job.

    PYTHONPATH=. python scripts/stress_plan.py                          # CPU, 1000 plans, the machine loaded
    PYTHONPATH=. python scripts/stress_plan.py --device cuda --plans 2000
    PYTHONPATH=. python scripts/stress_plan.py --plans 40 --traces 10 --snapshots 10 --load 0   # quick

The job is tests/integration/programs/plan_program.py under `dynprof run`. CLIENTS threads each
loop over a shuffled list of requests (plans with budgets from 0 up, saves, traces of 1-3 steps,
memory snapshots) until the counts asked for are done; a `dynprof serve` sidecar runs beside it
and one more thread polls its progress, agents and metrics endpoints and asks it for a plan now
and then. With --load N, N busy processes keep the cores loaded. A job that dies (a signal, or
an exit before the end) is a death: it is counted, its last lines and the kernel's word on it
(dmesg, where readable) are printed, and a new job is started. Every answer is sorted into
ok, refused (a clear error: non-zero exit, no traceback) and failed (a traceback, no answer).

The table at the end: requests of each kind sent, ok, refused, failed; deaths; sidecar polls.
Exits 1 when a job died or a request failed.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROGRAM = ROOT / "tests" / "integration" / "programs" / "plan_program.py"
BUDGETS = ("0", "1", "10%", "50%", "90%", "99%", "1K", "1G")


class Job:
    """plan_program.py under `dynprof run`, its output collected."""

    def __init__(self, env: dict[str, str], device: str, width: int, depth: int) -> None:
        cmd = [sys.executable, str(PROGRAM), "--device", device, "--width", str(width), "--depth", str(depth)]
        cmd += ["--max-seconds", "3600", "--step-sleep", "0.005"]
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
        self.pid = 0
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))
            if line.startswith("READY ") and not self.pid:
                self.pid = int(line.split()[1])

    def wait_ready(self, timeout: float = 300) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and not self.pid and self.proc.poll() is None:
            time.sleep(0.05)
        return bool(self.pid)

    def death(self) -> str | None:
        """Why the job is gone (None while it runs)."""
        code = self.proc.poll()
        if code is None:
            return None
        if code < 0:
            return f"killed by {signal.Signals(-code).name}"
        return f"exited with {code}"

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(timeout=20)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


class Tally:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.counts: Counter[tuple[str, str]] = Counter()
        self.examples: dict[tuple[str, str], str] = {}
        self.deaths: list[str] = []
        self.polls = Counter[str]()
        self.reasons: Counter[str] = Counter()
        self.reason_examples: dict[str, str] = {}  # one answer per reason a request was refused for

    def add(self, kind: str, outcome: str, detail: str = "") -> None:
        with self.lock:
            self.counts[(kind, outcome)] += 1
            if outcome == "refused":
                code = re.search(r"\[([A-Z_]+)\]", detail)
                reason = f"{kind} {code.group(1) if code else 'other'}"
                self.reasons[reason] += 1
                if detail and reason not in self.reason_examples:
                    self.reason_examples[reason] = detail[-600:]
            if detail and (kind, outcome) not in self.examples:
                self.examples[(kind, outcome)] = detail[-600:]


def _cli(args: list[str], env: dict[str, str], timeout: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "dynprof", *args],
        capture_output=True,
        text=True,
        env=env,
        cwd=str(ROOT),
        timeout=timeout,
        stdin=subprocess.DEVNULL,
    )


def _outcome(res: subprocess.CompletedProcess[str]) -> str:
    if "Traceback (most recent call last)" in res.stderr + res.stdout:
        return "failed"
    return "ok" if res.returncode == 0 else "refused"


def request(kind: str, pid: int, env: dict[str, str], rng: random.Random) -> tuple[str, str]:
    if kind == "plan":
        flag, value = rng.choice(("--budget", "--save")), rng.choice(BUDGETS)
        args = ["memory", "plan", "--pid", str(pid), flag, value, "--timeout", "120", "--json"]
    elif kind == "trace":
        args = ["start", "--pid", str(pid), "--steps", str(rng.randint(1, 3)), "--json"]
    else:
        args = ["memory", "--pid", str(pid), "--timeout", "60", "--json"]
    try:
        res = _cli(args, env, timeout=300)
    except subprocess.TimeoutExpired:
        return "failed", f"{' '.join(args)}: no answer in 300 s"
    return _outcome(res), f"{' '.join(args)} -> {res.returncode}\n{res.stderr[-600:] or res.stdout[-600:]}"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def poll_sidecar(port: int, token: str, stop: threading.Event, tally: Tally, rng: random.Random) -> None:
    base = f"http://127.0.0.1:{port}"
    paths = ["/api/v1/progress?fresh=1", "/api/v1/agents", "/metrics", "/api/v1/artifacts?limit=20"]
    while not stop.is_set():
        path = rng.choice(paths)
        req = urllib.request.Request(base + path, headers={"Authorization": f"Bearer {token}"})
        if rng.random() < 0.05:  # now and then a plan through the sidecar's action
            body = json.dumps({"options": {"all": True, "budget": rng.choice(BUDGETS), "timeout": 60}}).encode()
            req = urllib.request.Request(
                base + "/api/v1/actions/memory-plan",
                data=body,
                method="POST",
                headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"},
            )
            path = "memory-plan action"
        try:
            with urllib.request.urlopen(req, timeout=120) as resp:
                resp.read(1 << 22)
                tally.polls[f"{path.split('?')[0]} {resp.status}"] += 1
        except urllib.error.HTTPError as exc:
            tally.polls[f"{path.split('?')[0]} {exc.code}"] += 1
        except OSError as exc:
            tally.polls[f"{path.split('?')[0]} {type(exc).__name__}"] += 1
        stop.wait(0.1)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--plans", type=int, default=1000)
    parser.add_argument("--traces", type=int, default=200)
    parser.add_argument("--snapshots", type=int, default=200, help="memory snapshots (refused on the CPU: no CUDA)")
    parser.add_argument("--clients", type=int, default=4, help="requests in flight at once")
    parser.add_argument("--load", type=int, default=os.cpu_count() or 2, help="busy processes loading the cores")
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--depth", type=int, default=6)
    parser.add_argument("--no-sidecar", action="store_true")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--keep", action="store_true", help="keep the run directory (agent logs) and the store")
    args = parser.parse_args(argv)

    work = Path(tempfile.mkdtemp(prefix="dp-stress-"))
    env = dict(os.environ)
    env.update(
        DYNPROF_RUN_DIR=str(work / "run"),
        DYNPROF_ARTIFACT_DIR=str(work / "artifacts"),
        PYTHONPATH=str(ROOT),
        OMP_NUM_THREADS="1",
    )
    env.pop("DYNPROF", None)
    tally = Tally()
    todo = ["plan"] * args.plans + ["trace"] * args.traces + ["snapshot"] * args.snapshots
    rng = random.Random(args.seed)
    rng.shuffle(todo)
    queue_lock = threading.Lock()
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.load)]
    sidecar = None
    stop = threading.Event()
    job = Job(env, args.device, args.width, args.depth)
    job_lock = threading.Lock()
    started = time.monotonic()
    try:
        if not job.wait_ready():
            print("the job did not start:\n" + "\n".join(job.lines[-30:]), file=sys.stderr)
            return 1
        if not args.no_sidecar:
            token = secrets.token_hex(16)
            token_file = work / "token"
            token_file.write_text(token)
            token_file.chmod(0o600)
            port = _free_port()
            sidecar_log = open(work / "sidecar.log", "w")
            sidecar = subprocess.Popen(
                [sys.executable, "-m", "dynprof", "serve", "--port", str(port), "--token-file", str(token_file)],
                env=env,
                cwd=str(ROOT),
                stdout=sidecar_log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
            threading.Thread(
                target=poll_sidecar, args=(port, token, stop, tally, random.Random(args.seed + 1)), daemon=True
            ).start()

        def current_pid() -> int:
            nonlocal job
            with job_lock:
                why = job.death()
                if why is not None:
                    tally.deaths.append(f"pid {job.pid}: {why}; its last lines:\n  " + "\n  ".join(job.lines[-15:]))
                    print(f"DEATH: pid {job.pid} {why}", flush=True)
                    job = Job(env, args.device, args.width, args.depth)
                    job.wait_ready()
                return job.pid

        def client(n: int) -> None:
            crng = random.Random(args.seed * 1000 + n)
            while True:
                with queue_lock:
                    if not todo:
                        return
                    kind = todo.pop()
                    left = len(todo)
                outcome, detail = request(kind, current_pid(), env, crng)
                tally.add(kind, outcome, detail)
                if left % 50 == 0:
                    print(
                        f"{left} requests left, {len(tally.deaths)} death(s), {time.monotonic() - started:.0f} s",
                        flush=True,
                    )

        threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(args.clients)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        current_pid()  # a death at the very end counts too
    finally:
        stop.set()
        job.stop()
        for p in spinners:
            p.kill()
            p.wait()
        sidecar_output = ""
        if sidecar is not None:
            sidecar.terminate()
            try:
                sidecar.wait(timeout=20)
            except subprocess.TimeoutExpired:
                sidecar.kill()
            sidecar_output = (work / "sidecar.log").read_text(errors="replace")
        if args.keep:
            print(f"kept: {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)

    elapsed = time.monotonic() - started
    print(f"\ndevice {args.device}, {args.clients} clients, {args.load} busy processes, {elapsed:.0f} s")
    print(f"{'kind':<10}{'sent':>7}{'ok':>7}{'refused':>9}{'failed':>8}")
    for kind in ("plan", "trace", "snapshot"):
        row = [tally.counts[(kind, o)] for o in ("ok", "refused", "failed")]
        print(f"{kind:<10}{sum(row):>7}{row[0]:>7}{row[1]:>9}{row[2]:>8}")
    print("refused, by reason: " + (", ".join(f"{k} x{v}" for k, v in sorted(tally.reasons.items())) or "none"))
    print(f"deaths of the job: {len(tally.deaths)}")
    print("sidecar polls: " + (", ".join(f"{k} x{v}" for k, v in sorted(tally.polls.items())) or "none"))
    if sidecar is not None and not any(k.endswith(" 200") for k in tally.polls):
        print("the sidecar answered no poll; its output:\n" + sidecar_output[-2000:])
    for (kind, outcome), text in sorted(tally.examples.items()):
        if outcome == "failed":
            print(f"\nan example of {kind} {outcome}:\n{text}")
    for reason, text in sorted(tally.reason_examples.items()):
        print(f"\nan example of {reason} (refused):\n{text}")
    for death in tally.deaths:
        print(f"\n{death}")
    failed = sum(v for (k, o), v in tally.counts.items() if o == "failed")
    return 1 if tally.deaths or failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
