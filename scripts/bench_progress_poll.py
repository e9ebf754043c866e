#!/usr/bin/env python3
"""What the sidecar's progress poller costs a training rank (target: at most 0.1 % step time).

A CPU training loop runs in this process with its agent. A second process is the node's
sidecar side: a :class:`dynprof.sidecar.progress.ProgressBook` that reads this rank's progress
(the agent's status request, and psutil's look at the process) every ``--every`` seconds, as
``dynprof serve`` does. Within ONE run, windows of ``--window`` seconds alternate between the
poller on and off (the order flips every round), so both sides see the same machine noise:

1. Step time, wall clock per step (what a poll can cost: the agent's thread takes the GIL for
   its answer), mean and median, poller on vs off, and their ratios; the spread of the ratio
   between off windows alone (odd vs even rounds) is the resolution of this measurement.
2. A direct bound: the poller child sends ``--burst`` reads as fast as it can while this
   process's main thread waits; the process's CPU time spent meanwhile (the agent thread's
   answers, nothing else runs) divided by the reads is the agent-side cost of one poll. One poll
   every ``--every`` seconds then costs at most that CPU time per ``--every`` seconds of the
   training thread's time, if every answer took the GIL for all of it.

    python scripts/bench_progress_poll.py [--rounds 10] [--window 3] [--every 1] [--burst 500]
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def make_loop(width: int):
    import torch

    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.ReLU(), torch.nn.Linear(width, width))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randn(64, width)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        model(x).square().mean().backward()
        opt.step()

    return step


def calibrate_width(target_s: float) -> int:
    width = 64
    while width < 4096:
        step = make_loop(width)
        for _ in range(10):
            step()
        t0 = time.thread_time()  # CPU time: a loaded machine does not fool the calibration
        for _ in range(30):
            step()
        if (time.thread_time() - t0) / 30 >= target_s:
            return width
        width = int(width * 1.25)
    return width


def child(args: argparse.Namespace) -> int:
    """The sidecar side: poll the parent's agent every --every s while the flag file exists;
    with --burst N, N polls back to back, then exit."""
    from dynprof.identity import detect
    from dynprof.registry import list_records
    from dynprof.sidecar.progress import ProgressBook

    parent = os.getppid()
    book = ProgressBook(detect().host, args.every, records=lambda: [r for r in list_records() if r.pid == parent])
    if args.child_burst:
        for _ in range(args.child_burst):
            book.poll()
        view = book.view()
        steps = [e.row.step for e in view.entries.values()]
        print(f"burst done: {view.polls} polls, rank steps {steps}", flush=True)
        return 0
    polls = 0
    while os.path.exists(args.child_flag + ".run"):
        began = time.monotonic()
        if os.path.exists(args.child_flag):
            book.poll()
            polls += 1
        time.sleep(max(0.0, args.every - (time.monotonic() - began)))
    view = book.view()
    ups = sum(1 for e in view.entries.values() if e.row.agent == "up")
    print(f"poller done: {polls} polls, {ups} rank(s) up at the last", flush=True)
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=10, help="on/off window pairs (default 10)")
    parser.add_argument("--window", type=float, default=3.0, help="seconds per window (default 3)")
    parser.add_argument("--every", type=float, default=1.0, help="poll interval in seconds (default 1)")
    parser.add_argument("--step-ms", type=float, default=5.0, help="target step time of the loop (default 5 ms)")
    parser.add_argument("--burst", type=int, default=500, help="back-to-back polls for the direct bound")
    parser.add_argument("--child-flag", help=argparse.SUPPRESS)
    parser.add_argument("--child-burst", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child_flag or args.child_burst:
        return child(args)

    run_dir = tempfile.mkdtemp(prefix="dp-bench-poll-", dir="/tmp")
    os.environ.update({"DYNPROF_RUN_DIR": run_dir, "DYNPROF_JOB_ID": "bench-poll", "RANK": "0", "WORLD_SIZE": "1"})
    os.environ.pop("DYNPROF", None)
    import dynprof.agent
    from dynprof.registry import list_records

    width = calibrate_width(args.step_ms / 1e3)
    step = make_loop(width)
    agent = dynprof.agent.start(activation="bench")
    assert agent is not None and agent.wait_ready()
    for _ in range(50):
        step()
    assert any(r.pid == os.getpid() for r in list_records()), "the agent did not register"

    flag = os.path.join(run_dir, "poll-on")
    Path(flag + ".run").touch()
    me = [sys.executable, str(Path(__file__).resolve())]
    poller = subprocess.Popen(
        [*me, "--child-flag", flag, "--every", str(args.every)], stdout=subprocess.PIPE, text=True
    )
    windows: dict[bool, list[list[float]]] = {True: [], False: []}
    cpu_per_step: dict[bool, list[float]] = {True: [], False: []}  # the training thread's CPU time
    try:
        time.sleep(1.0)  # the child imports dynprof
        for r in range(args.rounds):
            for on in (True, False) if r % 2 == 0 else (False, True):
                if on:
                    Path(flag).touch()
                elif os.path.exists(flag):
                    os.unlink(flag)
                times: list[float] = []
                end = time.perf_counter() + args.window
                t = time.perf_counter()
                cpu0 = time.thread_time()
                while t < end:
                    step()
                    now = time.perf_counter()
                    times.append(now - t)
                    t = now
                cpu_per_step[on].append((time.thread_time() - cpu0) / len(times))
                windows[on].append(times)
    finally:
        if os.path.exists(flag):
            os.unlink(flag)
        os.unlink(flag + ".run")
        out, _ = poller.communicate(timeout=60)
    print(out.strip())

    # The direct bound: CPU time of this process while the child polls back to back and the
    # main thread only waits for it.
    def others_cpu(run: object) -> tuple[float, float, object]:
        """(CPU seconds of every thread but this one, wall seconds) while ``run()`` runs."""
        cpu0, main0, t0 = time.clock_gettime(time.CLOCK_PROCESS_CPUTIME_ID), time.thread_time(), time.perf_counter()
        value = run()  # type: ignore[operator]
        cpu = (time.clock_gettime(time.CLOCK_PROCESS_CPUTIME_ID) - cpu0) - (time.thread_time() - main0)
        return cpu, time.perf_counter() - t0, value

    children0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    idle_cpu, idle_wall, _ = others_cpu(lambda: time.sleep(5.0))  # the agent's threads, unasked
    busy_cpu, wall, burst = others_cpu(
        lambda: subprocess.run([*me, "--child-burst", str(args.burst)], capture_output=True, text=True, timeout=600)
    )
    agent_cpu = max(0.0, busy_cpu - idle_cpu / idle_wall * wall)
    children1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    sidecar_cpu = (children1.ru_utime + children1.ru_stime) - (children0.ru_utime + children0.ru_stime)
    print(burst.stdout.strip() or burst.stderr.strip()[-2000:])  # type: ignore[attr-defined]
    dynprof.agent.shutdown()

    on_all = [x for w in windows[True] for x in w]
    off_all = [x for w in windows[False] for x in w]
    on_w = [statistics.median(w) for w in windows[True]]
    off_w = [statistics.median(w) for w in windows[False]]
    step_s = statistics.median(off_all)
    # Resolution: the standard error of the mean paired (same round) ratio of window medians.
    paired = [a / b for a, b in zip(on_w, off_w)]
    sem = statistics.stdev(paired) / len(paired) ** 0.5 if len(paired) > 1 else float("nan")
    per_poll_cpu = agent_cpu / args.burst
    print()
    print(f"loop: width {width}, {len(off_all) + len(on_all)} steps in {2 * args.rounds} windows of {args.window:g} s")
    print(f"poller {args.every:g} s   steps  mean ms  median ms")
    print(
        f"  on             {len(on_all):6d}  {statistics.fmean(on_all) * 1e3:7.3f}  {statistics.median(on_all) * 1e3:9.3f}"
    )
    print(
        f"  off            {len(off_all):6d}  {statistics.fmean(off_all) * 1e3:7.3f}  {statistics.median(off_all) * 1e3:9.3f}"
    )
    print(
        f"ratio on/off: mean {statistics.fmean(on_all) / statistics.fmean(off_all):.4f}, "
        f"median {statistics.median(on_all) / statistics.median(off_all):.4f}, "
        f"median of window medians {statistics.median(on_w) / statistics.median(off_w):.4f}"
    )
    cpu_on, cpu_off = statistics.fmean(cpu_per_step[True]), statistics.fmean(cpu_per_step[False])
    print(
        f"training thread CPU per step: on {cpu_on * 1e3:.3f} ms, off {cpu_off * 1e3:.3f} ms, "
        f"ratio {cpu_on / cpu_off:.4f} (no GIL waits in it: the bound below covers those)"
    )
    print(
        f"paired ratio (window medians, same round): mean {statistics.fmean(paired):.4f} "
        f"± {sem:.4f} (standard error: the resolution of this measurement, {sem * 100:.2f} %)"
    )
    print(
        f"direct bound: {args.burst} polls back to back in {wall:.2f} s; this process spent "
        f"{agent_cpu * 1e3:.1f} ms CPU answering them (idle threads' {idle_cpu / idle_wall * 1e3:.2f} ms/s taken off): {per_poll_cpu * 1e6:.1f} us per poll"
    )
    print(
        f"the poller's own side (another process: the sidecar): {sidecar_cpu / args.burst * 1e3:.2f} ms CPU per poll "
        "(its imports included)"
    )
    print(
        f"  = {per_poll_cpu / step_s * 100:.3f} % of one {step_s * 1e3:.2f} ms step per poll; one poll every "
        f"{args.every:g} s costs at most {per_poll_cpu / args.every * 100:.4f} % of the training thread's time"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
