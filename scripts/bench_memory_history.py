#!/usr/bin/env python3
"""Step-time cost of each CUDA memory-history policy, against no recording, from one run.

Runs training loops on one GPU and, in interleaved rounds (off, A, B, ..., off, A, B, ...),
switches PyTorch's allocator history with dynprof's own code (collectors.memory.policy.apply for
fixed policies; for ``auto``, the agent's controller thread, dynprof.agent._mem_auto), runs
--warmup-seconds of untimed steps, then times --seconds of steps. It prints each policy's MEAN
step time (a windowed policy slows a few steps a lot: a median would hide it) as a ratio to
``off``, and the per-round paired ratios (round i of a policy / round i of off) with their
spread. Then, for each policy, it fills the history and times what a snapshot costs.

    python scripts/bench_memory_history.py                      # all policies, all workloads
    python scripts/bench_memory_history.py --policies off,auto --workloads launch

``off`` is the plain loop: nothing records (the OOM observer, which runs only at an OOM, costs
nothing until then and is not attached here). Workloads: ``launch`` is launch-bound (tiny
layers: ~5 ms steps of kernel launches and ~1 000+ allocator events, the worst case for
recording); ``small`` is allocation-heavy (a 12-layer MLP on a small batch); ``gpu`` is
GPU-bound (a wider model on a bigger batch, tens of ms a step).
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from collectors.memory.policy import apply, parse_policy

WORKLOADS = {
    # name: (layers, width, hidden, batch tokens)
    "launch": (8, 256, 512, 128),
    "small": (12, 1024, 4096, 2048),
    "gpu": (8, 2048, 8192, 8192),
}


def build(workload: str, device: object) -> tuple[object, object, object]:
    import torch

    layers, width, hidden, tokens = WORKLOADS[workload]
    blocks = []
    for _ in range(layers):
        blocks += [
            torch.nn.LayerNorm(width),
            torch.nn.Linear(width, hidden),
            torch.nn.GELU(),
            torch.nn.Linear(hidden, width),
        ]
    model = torch.nn.Sequential(*blocks).to(device=device, dtype=torch.bfloat16)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=False)  # per-parameter steps: more allocations
    x = torch.randn(tokens, width, device=device, dtype=torch.bfloat16)
    return model, opt, x


def run_for(model: object, opt: object, x: object, seconds: float) -> list[float]:
    times: list[float] = []
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        times += run_steps(model, opt, x, 5)
    return times


class Recording:
    """One policy's recording, started and stopped around a round."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.policy = parse_policy(name)
        self.auto: object = None

    def start(self) -> None:
        if self.policy.mode == "auto":
            from dynprof.agent._mem_auto import AutoHistory

            self.auto = AutoHistory(self.policy.budget)
            self.auto.start()  # type: ignore[attr-defined]
        else:
            apply(self.policy, clear=True)

    def stop(self) -> None:
        if self.auto is not None:
            self.auto.stop()  # type: ignore[attr-defined]
        apply(parse_policy("off"))

    def describe(self) -> str:
        if self.auto is not None and getattr(self.auto, "plan", None) is not None:
            plan = self.auto.plan  # type: ignore[attr-defined]
            return f"{plan.recording}, duty {plan.duty * 100:.3g} %, est. full cost {plan.estimated_cost * 100:.3g} %"
        return self.policy.describe()


def run_steps(model: object, opt: object, x: object, n: int) -> list[float]:
    import torch

    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        loss = model(x).float().pow(2).mean()  # type: ignore[operator]
        opt.zero_grad(set_to_none=True)  # type: ignore[attr-defined]
        loss.backward()
        opt.step()  # type: ignore[attr-defined]
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return times


def dump_cost() -> dict[str, float]:
    import torch

    t0 = time.perf_counter()
    snap = torch.cuda.memory._snapshot()
    t1 = time.perf_counter()
    with tempfile.NamedTemporaryFile(suffix=".pickle") as fh:
        pickle.dump(snap, fh, protocol=4)
        fh.flush()
        size = os.path.getsize(fh.name)
    t2 = time.perf_counter()
    events = sum(len(t) for t in snap["device_traces"])
    return {
        "snapshot_s": round(t1 - t0, 3),
        "pickle_s": round(t2 - t1, 3),
        "pickle_mb": round(size / 2**20, 1),
        "events": events,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--policies",
        default="off,auto,window,100000,state",
        help="comma-separated policies (as for --memory-history, plus 'window': auto's recording mode "
        "all the time); off is always the baseline",
    )
    parser.add_argument("--workloads", default="launch,small,gpu")
    parser.add_argument("--seconds", type=float, default=1.5, help="timed seconds per round")
    parser.add_argument("--warmup-seconds", type=float, default=0.6, help="untimed seconds after each switch")
    parser.add_argument(
        "--no-pin", action="store_true", help="do not pin the process to one CPU (pinning steadies launch-bound loops)"
    )
    parser.add_argument("--warmup", type=int, default=8, help="untimed steps before the first round")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--no-dump", action="store_true", help="skip the snapshot-cost measurement")
    parser.add_argument("--json", metavar="FILE", help="also write the figures as JSON")
    args = parser.parse_args(argv)

    import gc

    import torch

    if not args.no_pin and hasattr(os, "sched_setaffinity"):
        cpus = sorted(os.sched_getaffinity(0))
        os.sched_setaffinity(0, {cpus[len(cpus) // 2]})
    gc.freeze()  # the loops' own garbage only; no collection of start-up objects mid-round
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    names = [p.strip() for p in args.policies.split(",") if p.strip()]
    if "off" not in names:
        names.insert(0, "off")
    policies = {n: parse_policy(n) for n in names}
    recordings = {n: Recording(n) for n in names}
    device = torch.device("cuda")
    report: dict[str, object] = {
        "torch": torch.__version__,
        "gpu": torch.cuda.get_device_name(device),
        "seconds": args.seconds,
        "rounds": args.rounds,
        "workloads": {},
    }
    for workload in [w.strip() for w in args.workloads.split(",") if w.strip()]:
        model, opt, x = build(workload, device)
        apply(policies["off"])
        run_steps(model, opt, x, args.warmup)
        # Allocator events per step, counted once with a history large enough to hold a step.
        apply(parse_policy("1000000"), clear=True)
        run_steps(model, opt, x, 1)
        events_per_step = sum(len(t) for t in torch.cuda.memory._snapshot()["device_traces"])
        means: dict[str, list[float]] = {n: [] for n in names}
        plans: dict[str, str] = {}
        for _ in range(args.rounds):
            for name in names:
                rec = recordings[name]
                rec.start()
                try:
                    run_for(model, opt, x, args.warmup_seconds)
                    times = run_for(model, opt, x, args.seconds)
                    plans[name] = rec.describe()
                finally:
                    rec.stop()
                means[name].append(statistics.fmean(times))
        apply(policies["off"])
        base = statistics.median(means["off"])
        rows: dict[str, dict[str, object]] = {}
        print(
            f"\n== workload {workload}: {WORKLOADS[workload]} (layers, width, hidden, tokens); "
            f"{events_per_step} allocator events per step; {torch.cuda.get_device_name(device)}, "
            f"torch {torch.__version__}"
        )
        print(
            f"{'policy':<16} {'mean step ms':>13} {'ratio vs off':>13} {'paired median':>14} "
            f"{'paired IQR':>16} {'paired min-max':>16}   what it recorded"
        )
        for name in names:
            med = statistics.median(means[name])
            paired = [m / b for m, b in zip(means[name], means["off"])]
            rows[name] = {
                "policy": policies[name].describe(),
                "mean_step_ms": round(med * 1000, 4),
                "ratio": round(med / base, 4),
                "paired_ratios": [round(p, 4) for p in paired],
                "round_means_ms": [round(m * 1000, 4) for m in means[name]],
                "recorded": plans.get(name),
            }
            q = statistics.quantiles(paired, n=4) if len(paired) > 1 else [paired[0]] * 3
            rows[name]["paired_median"] = round(statistics.median(paired), 4)
            print(
                f"{name:<16} {med * 1000:>13.3f} {med / base:>13.4f} {statistics.median(paired):>14.4f} "
                f"{q[0]:>7.4f}-{q[2]:<8.4f} {min(paired):>7.4f}-{max(paired):<8.4f}   {plans.get(name)}",
                flush=True,
            )
        if not args.no_dump:
            # What a capture pays with each policy's history full: C++ stacks last (slowest).
            order = sorted(
                (n for n in names if n != "off" and policies[n].mode != "auto"),
                key=lambda n: policies[n].stacks == "all",
            )
            for name in order:
                apply(policies[name], clear=True)
                per_step = max(events_per_step, 1)
                needed = policies[name].max_entries // per_step + 1 if policies[name].mode == "all" else 3
                fill = max(3, min(needed, int(5.0 / max(base, 1e-4))))  # at most ~5 s of steps
                run_steps(model, opt, x, fill)
                d = dump_cost()
                rows[name]["dump"] = d
                print(
                    f"  snapshot with {policies[name].describe():<18} after {fill} steps: _snapshot {d['snapshot_s']} s"
                    f" + pickle {d['pickle_s']} s, {d['pickle_mb']} MB, {d['events']} events",
                    flush=True,
                )
            apply(policies["off"])
        report["workloads"][workload] = {"events_per_step": events_per_step, "policies": rows}  # type: ignore[index]
        del model, opt, x
        torch.cuda.empty_cache()
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
