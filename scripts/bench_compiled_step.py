#!/usr/bin/env python3
"""Benchmark a compiled optimizer step with and without the dynprof agent (CPU).

A function that calls ``opt.step()`` is compiled with ``torch.compile``. The agent is started
in this process (its optimizer step hook registered); blocks of compiled steps then alternate
between the hook registered and removed, so both are measured side by side under the same
machine noise (Dynamo keeps one compiled frame for each, after the warm-up). Printed: the
graph breaks and skipped frames of each variant (``torch._dynamo.utils.counters``), those
that name dynprof, recompiles after the warm-up, and the ratio of step times.

    python scripts/bench_compiled_step.py [--rounds 20] [--block 100] [--width 256]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def _break_counts(counters: dict) -> dict[str, int]:
    breaks = sum(counters["graph_break"].values())
    skipped = sum(counters["unimplemented"].values())
    dynprof = sum(
        n for k, n in [*counters["graph_break"].items(), *counters["unimplemented"].items()] if "dynprof" in k
    )
    frames = counters["frames"]
    return {
        "graph_break": breaks,
        "unimplemented": skipped,
        "naming_dynprof": dynprof,
        "frames_not_ok": frames["total"] - frames["ok"],
        "recompiles": sum(counters["recompiles"].values()),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--block", type=int, default=100)
    parser.add_argument("--width", type=int, default=256)
    args = parser.parse_args(argv)

    import torch
    import torch.optim.optimizer as optmod
    from torch._dynamo.utils import counters

    import dynprof.agent

    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = torch.nn.Sequential(*(torch.nn.Linear(args.width, args.width) for _ in range(3)))
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    for p in model.parameters():
        p.grad = torch.randn_like(p) * 1e-3

    @torch.compile
    def step() -> None:
        opt.step()

    # Without the agent: compile from scratch and count.
    torch._dynamo.reset()
    counters.clear()
    for _ in range(3):
        step()
    without_breaks = _break_counts(counters)

    agent = dynprof.agent.start(activation="bench")
    assert agent is not None and agent.wait_ready()
    assert agent.steps.hook_installed, "the optimizer hook should be installed (torch.optim is imported)"
    hook = optmod._global_optimizer_post_hooks[agent.steps._handle.id]
    torch._dynamo.reset()  # with the agent: compile from scratch too
    counters.clear()
    for _ in range(3):
        step()
    with_breaks = _break_counts(counters)
    first_reasons = [k.splitlines()[0] for k in [*counters["graph_break"], *counters["unimplemented"]]]

    # Warm both variants (the registered hooks are part of the compiled frame's guards).
    handle = agent.steps._handle
    handle.remove()
    for _ in range(3):
        step()
    handle = optmod.register_optimizer_step_post_hook(hook)
    for _ in range(3):
        step()
    counters.clear()
    with_agent: list[float] = []
    without: list[float] = []
    for r in range(args.rounds):
        order = (True, False) if r % 2 == 0 else (False, True)
        for hooked in order:
            if not hooked:
                handle.remove()
            t0 = time.thread_time()
            for _ in range(args.block):
                step()
            dt = (time.thread_time() - t0) / args.block
            if hooked:
                with_agent.append(dt)
            else:
                without.append(dt)
                handle = optmod.register_optimizer_step_post_hook(hook)
    steady = _break_counts(counters)
    agent.steps.fold_compiled()
    counted = agent.steps.step
    agent.steps._handle = handle
    dynprof.agent.shutdown()

    ratios = [a / b for a, b in zip(with_agent, without)]
    print(f"compiled Adam step, 3 x Linear({args.width}), CPU, {args.rounds} rounds x {args.block} steps per variant")
    print(f"  without agent: {without_breaks}")
    print(f"  with agent:    {with_breaks} {first_reasons}")
    print(f"  timed blocks (both variants cached): {steady}")
    print(
        f"  steps counted by the agent: {counted} (compiled steps run with the hook registered: {6 + args.rounds * args.block})"
    )
    print(f"  step time without agent: {statistics.median(without) * 1e3:.4f} ms (median of blocks)")
    print(f"  step time with agent:    {statistics.median(with_agent) * 1e3:.4f} ms")
    print(
        f"  ratio with/without: mean paired {statistics.fmean(ratios):.4f} "
        f"(sem {statistics.stdev(ratios) / len(ratios) ** 0.5:.4f}), median paired {statistics.median(ratios):.4f}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
