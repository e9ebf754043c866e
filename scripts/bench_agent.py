#!/usr/bin/env python3
"""Benchmark the dynprof agent: idle step-time overhead and request-to-trace latency.

1. Idle overhead. A CPU training loop of ~1 ms steps runs in this process with the agent
   started (server thread blocked in accept, optimizer-step hook). Blocks of steps alternate
   between the hook registered and removed, so both are measured side by side under the same
   machine noise; the ratio is median(step time with agent) / median(step time without).
   The hook's own cost per call is also timed directly.
2. Request -> trace active. A training process is started under `dynprof run`; the time from
   sending `start` to the profiler running is measured in step mode (next step boundary) and
   in duration mode (main thread's pending-call queue), over several trials.
3. Training thread paused to stop a trace (``--pause-pairs``). In the same process, pairs of a
   step-mode trace (``--steps 3``) and a duration-mode trace (``--duration 1``) are taken one
   after the other; from their manifests: the stop pause per recorded step in each mode and its
   ratio (duration / step mode, target about 1: duration mode costs what step mode costs), and
   how far past its duration a duration-mode trace ran, in steps of the job (target: at most
   the one step in progress). The test suite checks the load-proof side of this (events per
   step, the stop's wait within its step); these are the figures.

    python scripts/bench_agent.py [--rounds 40] [--block 200] [--trials 10] [--pause-pairs 5]
    python scripts/bench_agent.py --only-pause [--pause-pairs 5]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import timeit
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


def calibrate_width(target_s: float = 0.001) -> int:
    width = 64
    while width < 4096:
        step = make_loop(width)
        for _ in range(20):
            step()
        t0 = time.perf_counter()
        for _ in range(50):
            step()
        if (time.perf_counter() - t0) / 50 >= target_s:
            return width
        width = int(width * 1.25)
    return width


def idle_overhead(rounds: int, block: int) -> dict[str, float]:
    import dynprof.agent

    width = calibrate_width()
    step = make_loop(width)
    agent = dynprof.agent.start(activation="bench")
    assert agent is not None and agent.wait_ready()
    assert agent.steps.hook_installed, "the optimizer hook should be installed (torch.optim is imported)"
    import torch.optim.optimizer as optmod

    for _ in range(200):
        step()
    with_agent: list[float] = []
    without: list[float] = []
    for r in range(rounds):
        order = (True, False) if r % 2 == 0 else (False, True)
        for hooked in order:
            if hooked:
                agent.steps._handle = optmod.register_optimizer_step_post_hook(agent.steps._hook)
            t0 = time.thread_time()  # CPU time of this thread: immune to being descheduled
            for _ in range(block):
                step()
            dt = (time.thread_time() - t0) / block
            if hooked:
                agent.steps._handle.remove()
                with_agent.append(dt)
            else:
                without.append(dt)
    agent.steps._handle = optmod.register_optimizer_step_post_hook(agent.steps._hook)
    steps_counted = agent.steps.step
    # The hook alone, called directly.
    opt = object()
    n = 200_000
    hook_s = timeit.timeit(lambda: agent.steps._hook(opt, (), {}), number=n) / n
    call_s = timeit.timeit(lambda: None, number=n) / n
    dynprof.agent.shutdown()
    ratios = [a / b for a, b in zip(with_agent, without)]
    # Standard error of the mean paired ratio: the resolution of this measurement.
    sem = statistics.stdev(ratios) / len(ratios) ** 0.5
    return {
        "mean_paired_ratio": statistics.fmean(ratios),
        "sem": sem,
        "width": width,
        "step_ms_without": statistics.median(without) * 1e3,
        "step_ms_with": statistics.median(with_agent) * 1e3,
        "ratio_of_medians": statistics.median(with_agent) / statistics.median(without),
        "median_paired_ratio": statistics.median(ratios),
        "paired_ratio_p25": statistics.quantiles(ratios, n=4)[0],
        "paired_ratio_p75": statistics.quantiles(ratios, n=4)[2],
        "hook_us": (hook_s - call_s) * 1e6,
        "hook_fraction_of_step": (hook_s - call_s) / statistics.median(without),
        "steps_counted": steps_counted,
    }


def pth_hook_cost() -> float:
    """Seconds to run the installed .pth line in a process without DYNPROF set."""
    line = (ROOT / "dynprof" / "dynprof-agent.pth").read_text().strip()
    code = compile(line, "dynprof-agent.pth", "exec")
    saved = os.environ.pop("DYNPROF", None)
    try:
        n = 100_000
        return timeit.timeit(lambda: exec(code, {}), number=n) / n
    finally:
        if saved is not None:
            os.environ["DYNPROF"] = saved


def latency(trials: int) -> dict[str, list[float]]:
    from dynprof.client import AgentClient
    from dynprof.proto import pb

    proc, pid = _start_job(step_sleep=0.02)
    out: dict[str, list[float]] = {"step_mode_s": [], "step_time_s": [], "duration_mode_s": []}
    try:
        client = AgentClient.for_pid(pid)
        time.sleep(1.0)
        for mode in ("steps", "duration"):
            for _ in range(trials):
                req = pb.StartTraceRequest(steps=1) if mode == "steps" else pb.StartTraceRequest(duration_s=0.05)
                t0 = time.time()
                client.request(start_trace=req)
                while True:
                    st = client.status()
                    if st.trace.active_since:
                        break
                    if st.trace.state == "idle" and st.trace.last_artifact:
                        break
                    time.sleep(0.001)
                active = st.trace.active_since
                if mode == "steps":
                    out["step_mode_s"].append(active - t0)
                    out["step_time_s"].append(st.step_time_s)
                else:
                    out["duration_mode_s"].append(active - t0)
                while client.status().trace.state != "idle":
                    time.sleep(0.01)
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    return out


def _start_job(step_sleep: float) -> tuple[subprocess.Popen[str], int]:
    """train_program.py under `dynprof run` in private directories; returns it and its pid."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    run_dir = tempfile.mkdtemp(prefix="dpb-", dir="/tmp")
    env["DYNPROF_RUN_DIR"] = run_dir
    env["DYNPROF_ARTIFACT_DIR"] = tempfile.mkdtemp(prefix="dpb-art-")
    os.environ.update(DYNPROF_RUN_DIR=run_dir, DYNPROF_ARTIFACT_DIR=env["DYNPROF_ARTIFACT_DIR"])
    program = ROOT / "tests" / "integration" / "programs" / "train_program.py"
    job = [sys.executable, str(program), "--step-sleep", str(step_sleep), "--max-seconds", "600"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "dynprof", "run", "-q", "--", *job],
        stdout=subprocess.PIPE,
        text=True,
        env=env,
        cwd=str(ROOT),
    )
    assert proc.stdout is not None
    return proc, int(proc.stdout.readline().split()[1])


def trace_pause(pairs: int, duration_s: float = 1.0, steps: int = 3) -> dict[str, list[float]]:
    """Per pair: stop pause per recorded step in step and duration mode, and the duration
    trace's overshoot past its request in steps of the job (from the manifests)."""
    from dynprof.client import AgentClient
    from dynprof.proto import pb

    proc, pid = _start_job(step_sleep=0.005)
    out: dict[str, list[float]] = {"step_ms": [], "duration_ms": [], "ratio": [], "pause_ms": [], "overshoot": []}
    try:
        client = AgentClient.for_pid(pid)
        time.sleep(1.0)

        def summary_of(req: object) -> dict[str, float]:
            client.request(start_trace=req)
            while True:
                st = client.status()
                if st.trace.state == "idle" and st.trace.last_artifact:
                    break
                time.sleep(0.01)
            manifest = json.loads((Path(st.trace.last_artifact) / "manifest.json").read_text())
            summary: dict[str, float] = manifest["summary"]
            return summary

        for _ in range(pairs):
            s = summary_of(pb.StartTraceRequest(steps=steps))
            d = summary_of(pb.StartTraceRequest(duration_s=duration_s))
            per_step = s["training_thread_pause_ms"] / max(1, s["steps_captured"])
            per_step_d = d["training_thread_pause_ms"] / max(1, d["steps_captured"])
            step_s = d["profiled_s"] / max(1, d["steps_captured"])
            out["step_ms"].append(per_step)
            out["duration_ms"].append(per_step_d)
            out["ratio"].append(per_step_d / per_step if per_step else float("nan"))
            out["pause_ms"].append(d["training_thread_pause_ms"])
            out["overshoot"].append((d["profiled_s"] - duration_s) / step_s if step_s else float("nan"))
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    return out


def print_trace_pause(pairs: int) -> None:
    p = trace_pause(pairs)
    med = statistics.median
    print("== training thread paused to stop a trace (same job, step mode then duration mode) ==")
    print(f"pairs: {pairs}; step-mode traces of 3 steps, duration-mode traces of 1 s")
    print(f"stop pause per recorded step, step mode:     median {med(p['step_ms']):.3f} ms")
    print(f"stop pause per recorded step, duration mode: median {med(p['duration_ms']):.3f} ms")
    print(
        f"ratio duration / step mode (target ~1):      median {med(p['ratio']):.2f}, "
        f"min {min(p['ratio']):.2f}, max {max(p['ratio']):.2f}"
    )
    print(f"duration-mode stop pause: median {med(p['pause_ms']):.1f} ms, max {max(p['pause_ms']):.1f} ms")
    print(
        f"duration-mode overshoot past 1 s, in steps (target <= 1): median {med(p['overshoot']):.2f}, "
        f"max {max(p['overshoot']):.2f}"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=200)
    parser.add_argument("--block", type=int, default=50)
    parser.add_argument("--trials", type=int, default=10)
    parser.add_argument("--pause-pairs", type=int, default=5, help="step/duration trace pairs for the stop pause")
    parser.add_argument("--only-pause", action="store_true", help="measure only the stop pause (section 3)")
    args = parser.parse_args()
    if args.only_pause:
        os.environ.setdefault("DYNPROF_RUN_DIR", tempfile.mkdtemp(prefix="dpb-", dir="/tmp"))
        print_trace_pause(args.pause_pairs)
        return 0

    os.environ.setdefault("DYNPROF_RUN_DIR", tempfile.mkdtemp(prefix="dpb-", dir="/tmp"))
    o = idle_overhead(args.rounds, args.block)
    print("== idle agent, step-time overhead (target ratio <= 1.002) ==")
    print(f"loop: MLP width {o['width']}, {args.rounds} rounds x 2 blocks x {args.block} steps, alternating")
    print(f"median step without agent (thread CPU time): {o['step_ms_without']:.4f} ms")
    print(f"median step with agent (thread CPU time):    {o['step_ms_with']:.4f} ms")
    print(f"ratio of medians:               {o['ratio_of_medians']:.4f}")
    print(
        f"median paired ratio:            {o['median_paired_ratio']:.4f}  "
        f"(IQR {o['paired_ratio_p25']:.4f} .. {o['paired_ratio_p75']:.4f})"
    )
    print(f"mean paired ratio:              {o['mean_paired_ratio']:.4f} +/- {o['sem']:.4f} (standard error)")
    print(
        f"hook cost per step, timed alone: {o['hook_us']:.3f} us = {o['hook_fraction_of_step'] * 100:.4f} % of a step"
    )

    print(f"start-up hook (.pth) without DYNPROF set: {pth_hook_cost() * 1e6:.2f} us per process (target < 1 ms)")

    lat = latency(args.trials)
    st = statistics.median(lat["step_time_s"])
    print()
    print("== request -> trace active ==")
    print(
        f"step mode (target: next step boundary), step time {st * 1e3:.1f} ms: "
        f"median {statistics.median(lat['step_mode_s']) * 1e3:.1f} ms, max {max(lat['step_mode_s']) * 1e3:.1f} ms "
        f"= {max(lat['step_mode_s']) / st:.2f} steps"
    )
    print(
        f"duration mode (target <= 100 ms): median {statistics.median(lat['duration_mode_s']) * 1e3:.1f} ms, "
        f"max {max(lat['duration_mode_s']) * 1e3:.1f} ms"
    )
    if args.pause_pairs:
        print()
        print_trace_pause(args.pause_pairs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
