#!/usr/bin/env python3
"""Link rounds between simulated nodes: false positives, rounds needed, per-pair figures.

    python scripts/bench_links.py                      # 4 nodes, 20 healthy runs, 3 shaped runs
    python scripts/bench_links.py --nodes 6 --healthy 30 --shaped 5 --rate 100mbit

Nodes are `dynprof serve` processes, each in a network namespace of its own behind a bridge
(root, `ip` and `tc`; else on loopback, and the shaped case is skipped). The healthy runs
count false positives (any finding); the shaped runs limit one node's link with tbf (a
different node each run) and count the rounds needed to name it. It prints per-pair wall
times and bus bandwidths, the spread of healthy pairs around their round's median (the
noise the 10 % threshold must clear), and a paper estimate of the link part for 128 and
1024 nodes: rounds run their pairs at once, so a round takes its slowest pair plus the
orchestrator's overhead, whatever the node count (1 round healthy, 2 with one bad node, 3
at most).
"""

from __future__ import annotations

import argparse
import signal
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from dynprof.job.client import SidecarClient  # noqa: E402
from healthcheck.links.rounds import LinkReport, run_link_rounds  # noqa: E402
from tests.support.links import TOKEN, NetnsNodes, SimNodes, netns_usable  # noqa: E402


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))] if values else float("nan")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nodes", type=int, default=4)
    ap.add_argument("--healthy", type=int, default=20)
    ap.add_argument("--shaped", type=int, default=3)
    ap.add_argument("--size", type=int, default=2 << 20)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--rate", default="100mbit")
    ap.add_argument("--limit", type=float, default=90.0)
    ap.add_argument("--threshold", type=float, default=0.10, help="slow: this fraction below the median (default 0.10)")
    ap.add_argument(
        "--start-delay", type=float, default=15.0, help="s after a round starts that its timed iterations begin"
    )
    args = ap.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # still clean up the namespaces

    why_not = netns_usable()
    sims: SimNodes = NetnsNodes(args.nodes, net=214) if why_not is None else SimNodes(args.nodes)
    print(
        f"nodes: {args.nodes} sidecars {'in network namespaces' if why_not is None else 'on loopback (' + why_not + ')'}"
    )
    client = SidecarClient(TOKEN, timeout=10.0)
    pair_walls: list[float] = []
    pair_figures: list[float] = []
    spreads: list[float] = []
    round_walls: list[float] = []
    lates: list[float] = []
    started = time.monotonic()
    try:
        sims.start()

        def one_run() -> LinkReport:
            report = run_link_rounds(
                sims.nodes,
                client,
                backend="gloo",
                size_bytes=args.size,
                iters=args.iters,
                round_limit_s=args.limit,
                start_delay_s=args.start_delay,
                threshold=args.threshold,
            )
            for groups, wall in zip(report.rounds, report.round_wall_s, strict=True):
                round_walls.append(wall)
                lates.extend(s.late_s for g in groups for s in g.sides if s.late_s is not None)
                for g in groups:
                    pair_walls.append(g.wall_s)
                    if g.busbw_gbps is not None and g.status in ("ok", "slow"):
                        pair_figures.append(g.busbw_gbps)
                        if g.reference_gbps:
                            spreads.append(g.busbw_gbps / g.reference_gbps - 1.0)
            return report

        false_positives = 0
        for k in range(args.healthy):
            report = one_run()
            figures = [f"{g.busbw_gbps:.4f}" if g.busbw_gbps is not None else g.status for g in report.rounds[0]]
            bad = [f.host for f in report.findings]
            false_positives += bool(bad)
            print(
                f"healthy run {k + 1}: {len(report.rounds)} round(s), {report.wall_s:.1f} s, GB/s {figures}, named {bad}"
            )
        healthy_spreads = list(spreads)
        shaped_rounds: list[int] = []
        missed = 0
        if isinstance(sims, NetnsNodes):
            for m in range(args.shaped):
                victim = m % args.nodes
                sims.shape(victim, args.rate)
                try:
                    report = one_run()
                finally:
                    sims.unshape(victim)
                named = [f.host for f in report.findings if f.isolated]
                ok = named == [f"node-{victim}"]
                missed += not ok
                shaped_rounds.append(len(report.rounds))
                figs = [
                    [f"{g.busbw_gbps:.4f}" if g.busbw_gbps is not None else g.status for g in r] for r in report.rounds
                ]
                print(
                    f"shaped run {m + 1}: node-{victim} at {args.rate}: named {named} in {len(report.rounds)} round(s), "
                    f"{report.wall_s:.1f} s, GB/s per round {figs}"
                )
        else:
            print("shaped runs: skipped (no network namespaces here)")
    finally:
        sims.close()

    print()
    print(f"healthy runs: {args.healthy}, false positives: {false_positives}")
    if healthy_spreads:
        print(
            "healthy pairs vs the median of the others in their round: "
            f"min {min(healthy_spreads):+.1%}, p10 {pct(healthy_spreads, 0.1):+.1%}, "
            f"median {statistics.median(healthy_spreads):+.1%}, max {max(healthy_spreads):+.1%} "
            f"(slow means below -{args.threshold:.0%})"
        )
    if shaped_rounds:
        print(f"shaped runs: {len(shaped_rounds)}, missed: {missed}, rounds needed per run: {shaped_rounds}")
    if pair_walls:
        print(
            f"per-pair wall (side's child: worker start, torch import, rendezvous, test): "
            f"median {statistics.median(pair_walls):.1f} s, p90 {pct(pair_walls, 0.9):.1f} s, max {max(pair_walls):.1f} s"
        )
        print(
            f"per-round wall (slowest pair + orchestration): median {statistics.median(round_walls):.1f} s, max {max(round_walls):.1f} s"
        )
    if pair_figures:
        print(f"pair bus bandwidth (sendrecv, factor 1): median {statistics.median(pair_figures):.4f} GB/s")
    if round_walls:
        per_round = max(round_walls)
        overhead = per_round - statistics.median(pair_walls)
        print(
            "paper estimate of the link part (rounds run their pairs at once; a round is its slowest pair + overhead):"
        )
        for n in (128, 1024):
            print(
                f"  {n} nodes: {n // 2} pairs per round; healthy 1 round ~{per_round:.0f} s, one bad node 2 rounds "
                f"~{2 * per_round:.0f} s, ties 3 rounds ~{3 * per_round:.0f} s "
                f"(this machine's slowest round {per_round:.1f} s, of which {overhead:.1f} s above the median pair)"
            )
    print(f"sides late to their round's common start: {len(lates)} (max {max(lates, default=0):.1f} s)")
    print(f"bench wall: {time.monotonic() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
