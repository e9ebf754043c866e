#!/usr/bin/env python3
"""Step-time cost of each CUDA memory-history policy, against no recording, from one run.

Runs one training loop on one GPU and, in interleaved rounds (off, A, B, ..., off, A, B, ...),
switches PyTorch's allocator history with dynprof's own policy code
(collectors._mem_policy.apply), times --steps steps after --warmup steps, and prints each
policy's median step time as a ratio to ``off``. Then, for each policy, it fills the history
and times what a snapshot costs (``_snapshot()`` and writing the pickle): what an OOM capture
pays.

    python scripts/bench_memory_history.py                      # all policies, both workloads
    python scripts/bench_memory_history.py --policies off,100000 --workloads small

Workloads: ``small`` is allocation-heavy (a 12-layer MLP on a small batch: a few ms a step,
hundreds of allocator events a step, the worst case for recording); ``medium`` is a wider
model on a bigger batch (tens of ms a step).
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

from collectors._mem_policy import apply, parse_policy

WORKLOADS = {
    # name: (layers, width, hidden, batch tokens)
    "small": (12, 1024, 4096, 2048),
    "medium": (8, 2048, 8192, 8192),
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
        default="off,100000,state,all-stacks:100000",
        help="comma-separated policies (as for --memory-history); off is always the baseline",
    )
    parser.add_argument("--workloads", default="small,medium")
    parser.add_argument("--steps", type=int, default=30, help="timed steps per round")
    parser.add_argument("--warmup", type=int, default=8, help="untimed steps after each switch")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--no-dump", action="store_true", help="skip the snapshot-cost measurement")
    parser.add_argument("--json", metavar="FILE", help="also write the figures as JSON")
    args = parser.parse_args(argv)

    import torch

    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    names = [p.strip() for p in args.policies.split(",") if p.strip()]
    if "off" not in names:
        names.insert(0, "off")
    policies = {n: parse_policy(n) for n in names}
    device = torch.device("cuda")
    report: dict[str, object] = {
        "torch": torch.__version__,
        "gpu": torch.cuda.get_device_name(device),
        "steps": args.steps,
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
        medians: dict[str, list[float]] = {n: [] for n in names}
        for _ in range(args.rounds):
            for name in names:
                apply(policies[name], clear=True)
                run_steps(model, opt, x, args.warmup)
                medians[name].append(statistics.median(run_steps(model, opt, x, args.steps)))
        apply(policies["off"])
        base = statistics.median(medians["off"])
        rows: dict[str, dict[str, object]] = {}
        print(
            f"\n== workload {workload}: {WORKLOADS[workload]} (layers, width, hidden, tokens); "
            f"{events_per_step} allocator events per step; {torch.cuda.get_device_name(device)}, "
            f"torch {torch.__version__}"
        )
        print(f"{'policy':<22} {'median step ms':>15} {'ratio vs off':>13}   round medians (ms)")
        for name in names:
            med = statistics.median(medians[name])
            rows[name] = {
                "policy": policies[name].describe(),
                "median_step_ms": round(med * 1000, 3),
                "ratio": round(med / base, 4),
                "round_medians_ms": [round(m * 1000, 3) for m in medians[name]],
            }
            print(
                f"{policies[name].describe():<22} {med * 1000:>15.3f} {med / base:>13.4f}   "
                f"{', '.join(f'{m * 1000:.3f}' for m in medians[name])}",
                flush=True,
            )
        if not args.no_dump:
            # What a capture pays with each policy's history full: C++ stacks last (slowest).
            order = sorted((n for n in names if n != "off"), key=lambda n: policies[n].stacks == "all")
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
