#!/usr/bin/env python3
"""What one sampled straggler trace of the watch costs a CPU gloo job, and the duty cycle at the
default ``--sample-every``; and what a cheaper continuous signal (a job-wide stacks sample)
costs.

It starts two simulated nodes (each a `dynprof serve` with its own run and artifact
directories) and a 2-rank gloo job (this script's own rank loop: a sleep standing for data
loading, a small model's forward and backward, one all_reduce per gradient, the optimizer
step), one rank per node, each under `dynprof run`; every rank writes the end time of each of
its steps. In ONE run it then takes ``--rounds`` straggler samples
(:func:`dynprof.watch.straggler.sampler.sample_stragglers` over the nodes' sidecars: arming at one step, the trace of
``--steps`` steps with Python stacks, the profiler's start and stop, the fetch, the analysis)
and ``--stacks`` job-wide stacks samples per round (the nodes' ``stacks`` action), with
untraced gaps between them.

From the step end times: the untraced step time (the median of the steps outside every
sample), and per sample the training time it cost the ranks (the steps that ended during it,
or within a second after, less as many untraced steps: slowed steps while tracing, the
profiler's start and stop, and whatever the fetch and the analysis took from the ranks' CPUs
on this machine). Printed: the medians and spreads, the duty cycle at the default interval
(``SAMPLE_EVERY_S``) and the interval that 0.5 % allows, and for one stacks sample every 5 s
the duty cycle against the 0.3 % of a continuous signal.

    python scripts/bench_watch_sampling.py                  # 4 rounds, about 90 s
    python scripts/bench_watch_sampling.py --rounds 8 --gap 10

The machine is shared: a loaded machine makes single samples noisy; the spread is printed with
the medians.
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import itertools
import json
import os
import secrets
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from dynprof.job.client import SidecarClient  # noqa: E402
from dynprof.job.discovery import parse_node  # noqa: E402
from dynprof.watch.sources import SidecarSource  # noqa: E402
from dynprof.watch.straggler.sampler import SAMPLE_EVERY_S, sample_stragglers  # noqa: E402

JOB = "bench-watch-sampling"
BUDGET_SAMPLED = 0.005
BUDGET_CONTINUOUS = 0.003
STACKS_EVERY_S = 5.0


def rank_main(load_ms: float, out: str) -> int:
    """A rank of the benchmark's job: per step ``load_ms`` of loading, a small model's forward
    and backward, one all_reduce per gradient, the optimizer step; each step's end time (unix
    seconds, 8 bytes) appended to ``out``, written every 50 steps."""
    import struct

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    fd = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    ends: list[float] = []
    while True:
        time.sleep(load_ms / 1000)
        x, y = torch.randn(32, 64), torch.randn(32, 1)
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        for p in model.parameters():
            dist.all_reduce(p.grad)
        opt.step()
        ends.append(time.time())
        if len(ends) >= 50:
            os.write(fd, struct.pack(f"{len(ends)}d", *ends))
            ends.clear()


def step_ends(path: Path) -> list[float]:
    import struct

    data = path.read_bytes() if path.exists() else b""
    n = len(data) // 8
    return list(struct.unpack(f"{n}d", data[: n * 8]))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Harness:
    def __init__(self, load_ms: float) -> None:
        self.root = Path(tempfile.mkdtemp(prefix="dpw-", dir="/tmp"))
        self.root.chmod(0o700)
        self.token = secrets.token_urlsafe(24)
        self.token_file = self.root / "token"
        fd = os.open(self.token_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as fh:
            fh.write(self.token + "\n")
        self.procs: list[subprocess.Popen[bytes]] = []
        self.nodes: list[dict[str, Any]] = []
        self.load_ms = load_ms

    def env(self, i: int) -> dict[str, str]:
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])
        for name in ("DYNPROF", "DYNPROF_JOB_ID", "DYNPROF_TOKEN_FILE"):
            env.pop(name, None)
        env.update(
            DYNPROF_RUN_DIR=str(self.root / f"n{i}" / "r"),
            DYNPROF_ARTIFACT_DIR=str(self.root / f"n{i}" / "a"),
            DYNPROF_HOST=f"node-{i}",
        )
        return env

    def start(self) -> None:
        master = str(free_port())
        for i in range(2):
            (self.root / f"n{i}" / "r").mkdir(parents=True, mode=0o700)
            (self.root / f"n{i}" / "a").mkdir(parents=True, mode=0o700)
            port = free_port()
            self.nodes.append({"address": f"127.0.0.1:{port}", "port": port})
            cmd = [sys.executable, "-m", "dynprof", "serve", "--port", str(port), "--token-file", str(self.token_file)]
            log = open(self.root / f"serve{i}.log", "wb")
            self.procs.append(
                subprocess.Popen(cmd, env=self.env(i), cwd=str(ROOT), stdout=subprocess.DEVNULL, stderr=log)
            )
        for i in range(2):
            env = {**self.env(i), "RANK": str(i), "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1"}
            env.update(MASTER_PORT=master, DYNPROF_JOB_ID=JOB, LOCAL_RANK="0")
            cmd = [sys.executable, "-m", "dynprof", "run", "-q", "--", sys.executable, str(Path(__file__).resolve())]
            cmd += ["--rank-main", str(self.root / f"steps{i}.bin"), "--load-ms", str(self.load_ms)]
            log = open(self.root / f"rank{i}.log", "wb")
            self.procs.append(
                subprocess.Popen(
                    cmd, env=env, cwd=str(ROOT), stdout=subprocess.DEVNULL, stderr=log, start_new_session=True
                )
            )
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            steps = self.steps()
            if steps is not None and steps > 5:
                return
            time.sleep(0.5)
        raise RuntimeError("the job did not start stepping on both nodes in 180 s")

    def progress(self, node: dict[str, Any]) -> dict[str, Any] | None:
        try:
            conn = http.client.HTTPConnection("127.0.0.1", node["port"], timeout=5)
            conn.request("GET", f"/api/v1/progress?job={JOB}", headers={"Authorization": f"Bearer {self.token}"})
            resp = conn.getresponse()
            body = resp.read()
            conn.close()
            doc = json.loads(body) if resp.status == 200 else None
            return doc if isinstance(doc, dict) else None
        except (OSError, ValueError):
            return None

    def steps(self) -> int | None:
        """The job's step (the least of its ranks'), or None when a rank is not read."""
        found = []
        for node in self.nodes:
            doc = self.progress(node)
            ranks = doc.get("ranks") if doc else None
            if not ranks:
                return None
            found += [int(r.get("step") or 0) for r in ranks]
        return min(found) if len(found) == 2 else None

    def stop(self) -> None:
        for p in reversed(self.procs):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGTERM) if p.args[2:4] == ["dynprof", "run"] else p.terminate()
        for p in self.procs:
            try:
                p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGKILL)
                p.kill()
                p.wait(timeout=5)
        shutil.rmtree(self.root, ignore_errors=True)


def lost_in(ends: list[float], spans: list[tuple[float, float]], margin: float) -> tuple[float, list[float], float]:
    """(the untraced step time: the median step outside every span and its margin; per span,
    the training time lost in it: the steps that end inside it (or up to ``margin`` after) less
    as many untraced steps; the number of steps per span, on average)."""
    durs = [(b, b - a) for a, b in itertools.pairwise(ends)]
    inside = [[d for t, d in durs if s0 <= t <= s1 + margin] for s0, s1 in spans]
    outside = [d for t, d in durs if not any(s0 - margin <= t <= s1 + margin for s0, s1 in spans)]
    base = statistics.median(outside) if outside else 0.0
    return base, [sum(d - base for d in ds) for ds in inside], statistics.fmean(len(ds) for ds in inside)


def traced_step_ms(keep: Path) -> float | None:
    """The mean step time in the sampled traces (every rank's)."""
    from collectors.torch_trace import TRACE_FILE
    from collectors.trace_analysis.rank import RankInput, analyze_ranks

    items = [RankInput(path=str(p)) for p in keep.rglob(TRACE_FILE)]
    ranks = [r for r in analyze_ranks(items, workers=1) if "error" not in r]
    times = [s["step_ms"] for r in ranks for s in r["steps"]]
    return statistics.fmean(times) if times else None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--gap", type=float, default=6.0, help="untraced seconds between samples (default 6)")
    parser.add_argument("--steps", type=int, default=2, help="steps per sampled trace (default 2, the watch's)")
    parser.add_argument("--load-ms", type=float, default=20.0, help="each rank's load per step (default 20)")
    parser.add_argument("--stacks", type=int, default=4, help="job-wide stacks samples per round (default 4)")
    parser.add_argument("--rank-main", metavar="FILE", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank_main:
        return rank_main(args.load_ms, args.rank_main)
    h = Harness(args.load_ms)
    client = SidecarClient(h.token, timeout=20.0)
    samples: list[tuple[float, float]] = []
    stacks: list[tuple[float, float]] = []
    costs: list[float] = []
    traced: list[float] = []
    notes: list[str] = []
    try:
        print(f"starting 2 nodes, a 2-rank gloo job ({args.load_ms:g} ms load per step) on {os.cpu_count()} CPUs")
        h.start()
        addresses = [n["address"] for n in h.nodes]
        nodes = [parse_node(a) for a in addresses]
        time.sleep(args.gap)
        for i in range(args.rounds):
            keep = h.root / f"keep{i}"
            t0 = time.time()
            source = SidecarSource(client, nodes, keep_traces=keep)
            report = sample_stragglers(source, JOB, steps=args.steps)
            samples.append((t0, time.time()))
            costs.append(report.cost_s)
            traced_ms = traced_step_ms(keep)
            if traced_ms is not None:
                traced.append(traced_ms)
            if not report.note.startswith(("no straggler", "straggler")):
                notes.append(report.note[:200])
            time.sleep(args.gap)
            for _ in range(args.stacks):
                t0 = time.time()
                client.action_all(nodes, "stacks", {"job": JOB, "no_save": True}, timeout=15.0)
                stacks.append((t0, time.time()))
                time.sleep(1.5)
            time.sleep(args.gap)
            print(
                f"round {i + 1}/{args.rounds}: sample {report.cost_s:.2f} s, {args.stacks} stacks samples", flush=True
            )
    except KeyboardInterrupt:
        return 130
    finally:
        ends = [step_ends(h.root / f"steps{i}.bin") for i in range(2)]
        h.stop()
    for n in notes:
        print(f"note: {n}")
    # Rank 0's steps (both ranks step together: all_reduce every step).
    base, lost, _per = lost_in(ends[0], samples + stacks, margin=1.0)
    s_lost, k_lost = lost[: len(samples)], lost[len(samples) :]
    if not s_lost:
        return 1
    med = max(0.0, statistics.median(s_lost))
    k_med = max(0.0, statistics.median(k_lost)) if k_lost else 0.0
    print(
        f"\nuntraced step {base * 1000:.1f} ms (median of {len(ends[0])} steps outside the samples, same run); "
        f"traced steps {statistics.fmean(traced) if traced else float('nan'):.1f} ms (in the traces)"
    )
    print(
        f"sampled trace of {args.steps} steps: the ranks lose {med:.3f} s of training per sample, median of "
        f"{len(s_lost)} [{min(s_lost):.3f} .. {max(s_lost):.3f}] = {med / base if base else 0:.1f} untraced steps; "
        f"the sample takes {statistics.median(costs):.2f} s of wall time on the watch (arm, trace, fetch, analysis)"
    )
    duty = med / SAMPLE_EVERY_S
    verdict = "within" if duty <= BUDGET_SAMPLED else "OVER"
    print(
        f"default --sample-every {SAMPLE_EVERY_S:g} s: duty cycle {duty * 100:.3f} % ({verdict} the "
        f"{BUDGET_SAMPLED * 100:g} % budget); the budget allows one sample every {med / BUDGET_SAMPLED:.0f} s"
    )
    if k_lost:
        k_duty = k_med / STACKS_EVERY_S
        k_verdict = "within" if k_duty <= BUDGET_CONTINUOUS else "OVER"
        print(
            f"job-wide stacks sample: {k_med * 1000:.1f} ms lost per sample, median of {len(k_lost)} "
            f"[{min(k_lost) * 1000:.1f} .. {max(k_lost) * 1000:.1f}]; one every {STACKS_EVERY_S:g} s: "
            f"{k_duty * 100:.3f} % ({k_verdict} the {BUDGET_CONTINUOUS * 100:g} % budget of a continuous signal)"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
