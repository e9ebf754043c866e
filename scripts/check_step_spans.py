#!/usr/bin/env python3
"""How exactly dynprof's traces hold the steps asked for: each ProfilerStep# span one
training iteration, no optimizer step straddling a span boundary (CPU, or CUDA with --device cuda).

Three modes, each one training process under ``dynprof run`` traced --traces times in a row:

    with-stack        a plain loop, ``start --steps 3 --with-stack``
    opt-in-backward   one optimizer per parameter stepped from post-accumulate-grad hooks
                      (many optimizer steps per iteration), ``start --steps 3``
    duration          a plain loop, ``start --duration 0.1``

For each trace (collectors.torch_trace.check_step_spans): spans, optimizer steps per span,
optimizer steps straddling a boundary; and the manifest's own word on partial spans. Printed per
mode: how many traces had every span exactly one iteration, how many had a span flagged partial
in the manifest, and the straddles in all.

    python scripts/check_step_spans.py [--traces 20] [--modes with-stack,opt-in-backward,duration] [--device cuda]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from collectors.torch_trace import check_step_spans, read_trace  # noqa: E402

SAFETY = "tests/integration/programs/safety_program.py"
MODES = {
    "with-stack": (
        [SAFETY, "--mode", "plain", "--depth", "2", "--step-sleep", "0.002"],
        ["--steps", "3", "--with-stack"],
    ),
    "opt-in-backward": ([SAFETY, "--mode", "opt-in-backward", "--depth", "2"], ["--steps", "3"]),
    "duration": ([SAFETY, "--mode", "plain", "--depth", "2", "--step-sleep", "0.002"], ["--duration", "0.1"]),
}


def _dynprof(env: dict[str, str], *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    try:
        return subprocess.run(
            [sys.executable, "-m", "dynprof", *args], capture_output=True, text=True, env=env, cwd=ROOT, timeout=timeout
        )
    except subprocess.TimeoutExpired as exc:  # counted as a failed trace, with what the agent says
        return subprocess.CompletedProcess(exc.cmd, 124, "", f"timed out after {timeout:.0f} s")


def _agent_state(env: dict[str, str], pid: int) -> str:
    ps = _dynprof(env, "ps", "--json", timeout=30)
    log = Path(env["DYNPROF_RUN_DIR"]) / "logs" / f"{pid}.log"
    try:
        tail = log.read_text(errors="replace").splitlines()[-15:]
    except OSError as exc:
        tail = [f"(no agent log: {exc})"]
    stacks = _dynprof(env, "stacks", "--pid", str(pid), "--native", "--full", "--no-save", timeout=60)
    return (
        ps.stdout.strip()[:1500]
        + "\n    "
        + "\n    ".join(tail)
        + "\n  stacks of every thread:\n"
        + (stacks.stdout + stacks.stderr)[-12000:]
    )


def run_mode(name: str, traces: int, env: dict[str, str], device: str = "cpu") -> dict[str, int]:
    program, start_args = MODES[name]
    if device != "cpu":
        program = [*program, "--device", device]
        start_args = [*start_args, "--activities", "cpu,cuda"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "dynprof", "run", "-q", "--", sys.executable, *program, "--max-seconds", "300"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        cwd=ROOT,
        start_new_session=True,
    )
    counts = {"traces": 0, "exact": 0, "flagged": 0, "straddling": 0, "failed": 0}
    try:
        assert proc.stdout is not None
        pid = 0
        for line in proc.stdout:
            if line.startswith("READY"):
                pid = int(line.split()[1])
                break
        # The loop writes a line per step: keep reading, or it blocks on a full pipe.
        threading.Thread(target=proc.stdout.read, daemon=True).start()
        for _ in range(traces):
            out = _dynprof(env, "start", "--pid", str(pid), *start_args, "--json", timeout=60)
            try:
                (res,) = json.loads(out.stdout)["results"]
                art = Path(res["artifact"])
                check = check_step_spans(read_trace(art / "trace.json.gz"))
                summary = json.loads((art / "manifest.json").read_text()).get("summary", {})
            except Exception as exc:  # a failed trace is counted, not fatal
                counts["failed"] += 1
                print(f"  {name}: trace failed: {exc}: {out.stderr.strip()[:200]}\n  {_agent_state(env, pid)}")
                continue
            counts["traces"] += 1
            counts["exact"] += int(check["one_each"])
            counts["flagged"] += int(bool(summary.get("first_span_partial") or summary.get("last_span_partial")))
            counts["straddling"] += check["straddling"]
            if not check["one_each"]:
                print(
                    f"  {name}: {check['spans']} spans, optimizer steps per span {check['per_span']}, "
                    f"straddling {check['straddling']}, manifest span={summary.get('span')!r} "
                    f"first/last partial={summary.get('first_span_partial')}/{summary.get('last_span_partial')}"
                )
    finally:
        os.killpg(proc.pid, 15)
        proc.wait(timeout=30)
    return counts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--traces", type=int, default=20)
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--device", default="cpu", help="the training loop's device (cuda: CUDA traces too)")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="dynprof-spans-") as tmp:
        env = dict(os.environ)
        env.update(
            DYNPROF_RUN_DIR=os.path.join(tmp, "run"),
            DYNPROF_ARTIFACT_DIR=os.path.join(tmp, "artifacts"),
            PYTHONUNBUFFERED="1",
        )
        env.setdefault("PYTHONPATH", str(ROOT))
        t0 = time.monotonic()
        results = {name: run_mode(name, args.traces, env, args.device) for name in args.modes.split(",")}
    print(f"\n{'mode':<16} {'traces':>6} {'exact':>6} {'flagged':>8} {'straddling':>10} {'failed':>6}")
    for name, c in results.items():
        print(f"{name:<16} {c['traces']:>6} {c['exact']:>6} {c['flagged']:>8} {c['straddling']:>10} {c['failed']:>6}")
    print(
        f"({time.monotonic() - t0:.0f} s; exact: every span one iteration, the same optimizer steps in each, "
        "none straddling; flagged: the manifest marks a span partial)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
