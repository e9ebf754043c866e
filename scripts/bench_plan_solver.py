#!/usr/bin/env python3
"""The memory plan's solver on crafted measurements: time and memory of one render, bounded.

A ``memory-plan`` artifact (``plan.json``: a measurement and the budget asked) may come from a
hostile node (``dynprof ls --fetch``); ``dynprof show`` and the sidecar's page re-plan it. This
crafts, for 20, 400 and 4 096 blocks, the worst measurement the decoder
(:func:`collectors.memory.plan.measurement.from_json`) lets through for the search and for the predicted
peak:

- a chain of blocks (the shape on which the search is exact, so it runs to the end), each
  freeing a different 40-bit byte count with a recompute time in proportion (no set beats
  another: more bytes cost more time) and autocast casts that differ from it (the two kinds of
  bytes freed do not go together), the budget three quarters of what all free off the
  peak, nothing asked of the first blocks alone (no state is dropped for freeing too little);
- every segment the decoder allows (``MAX_SEGMENTS``), and the most ``late_freeable`` and
  ``kept_inputs`` entries it allows (``MAX_LATE``, ``MAX_KEPT`` per block, ``MAX_ENTRIES`` in
  all): each predicted peak walks those of the blocks it checkpoints.

and one honest-looking measurement of 4 096 alike blocks (a deep stack of equal layers) for
comparison. For each it prints the seconds of one render as ``dynprof show`` does it
(:func:`collectors.memory.plan.render.render_artifact`: the plan with its runners-up, the floor, the
text), whether the search was exact, the plan's blocks, and the peak of Python's memory
(tracemalloc, a second run). With ``--baseline DIR`` it runs the same in a child process with
the ``collectors`` package of another checkout (killed after ``--baseline-timeout`` seconds).

    python3 scripts/bench_plan_solver.py
    python3 scripts/bench_plan_solver.py --baseline /path/to/older/checkout --baseline-timeout 60
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time
import tracemalloc
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


def craft(n: int, seed: int = 48, alike: bool = False) -> dict[str, Any]:
    """``plan.json`` of ``n`` blocks: adversarial (see the module's text), or ``alike``."""
    from collectors.memory.plan import measurement as plan

    MAX_KEPT, MAX_LATE, MAX_SEGMENTS = plan.MAX_KEPT, plan.MAX_LATE, plan.MAX_SEGMENTS
    # (a checkout from before the bound on entries in all gets the same file)
    MAX_ENTRIES = getattr(plan, "MAX_ENTRIES", 8 * plan.MAX_BLOCKS)

    rng = random.Random(seed)
    segments = min(MAX_SEGMENTS, 5 * n + 64)
    first_backward = segments - n
    late = min(MAX_LATE, MAX_ENTRIES // (2 * n))
    kept = min(MAX_KEPT, MAX_ENTRIES // (2 * n))
    if alike:
        freeable = [1 << 30] * n
        casts = [1 << 27] * n
        seconds = [0.01] * n
    else:
        freeable = [rng.randint(1 << 40, 1 << 41) for _ in range(n)]
        casts = [rng.randint(0, f // 2) for f in freeable]
        # the time of a set is the same sum of its two kinds of bytes: none frees as much of
        # both as another for less time, so no state of the search is dropped as beaten
        seconds = [(2 * f - c) / (1 << 41) for f, c in zip(freeable, casts)]
    static = 1 << 42
    peak = static + sum(freeable)
    cached_peak = static + sum(f - c for f, c in zip(freeable, casts))
    timeline = []
    for i in range(segments):
        if i <= n:  # forward: no constraint on the first blocks alone (none prunes a state)
            timeline.append([static, 0])
        elif i < first_backward:  # the loss, every block held
            timeline.append([peak, cached_peak if i % 2 else 0])
        else:
            timeline.append([static, 0])
    blocks = []
    for j in range(n):
        fe, bs = 1 + j, first_backward + (n - 1 - j)
        blocks.append(
            {
                "name": f"layers.{j}",
                "class": "Layer",
                "saved_bytes": freeable[j],
                "freeable_bytes": freeable[j],
                "cast_bytes": casts[j],
                "forward_s": seconds[j],
                "recompute_s": seconds[j],
                "recompute_bytes": 0,
                "forward_end": fe,
                "backward_start": bs,
                "backward_start_bytes": 0,
                "late_freeable": [
                    [rng.randint(fe, bs - 1), 4096 if alike else rng.randint(1, 4096)] for _ in range(late)
                ],
                "kept_inputs": [[fe, 64 if alike else rng.randint(1, 64), j * MAX_KEPT + k] for k in range(kept)],
                "calls": 1,
                "parameter_bytes": 1 << 20,
                "checkpointed": False,
            }
        )
    measurement = {
        "schema": 2,
        "device": "cuda:0",
        "blocks": blocks,
        "timeline": timeline,
        "untracked_bytes": 0,
        "drift_bytes": 0,
        "peak_bytes": peak,
        "peak_source": "torch.cuda.max_memory_allocated",
        "activation_bytes": sum(freeable),
        "unrecomputable_activation_bytes": 0,
        "parameter_bytes": static // 4,
        "gradient_bytes": static // 4,
        "optimizer_state_bytes": static // 2,
        "temporary_bytes": 0,
        "step_s": float(sum(seconds)) * 3,
        "typical_step_s": None,
        "peak_includes_gradients": False,
        "notes": [],
        "error": "",
    }
    # three quarters of what all free: few sets free that much, so few states reach the cap
    need = sum(freeable) * 3 // 4
    return {"schema": 1, "measurement": measurement, "asked": {"budget_bytes": peak - need}}


class _Stored:
    """An artifact as render_artifact reads it: its plan.json."""

    def __init__(self, doc: dict[str, Any]) -> None:
        self.text = json.dumps(doc)

    def read_json(self, name: str, limit: int) -> Any:
        assert len(self.text) <= limit
        return json.loads(self.text)


def measure(doc: dict[str, Any]) -> dict[str, Any]:
    """One render of ``doc`` as `dynprof show` does it: seconds, then tracemalloc's peak."""
    from collectors.memory.plan.render import render_artifact

    art = _Stored(doc)
    start = time.perf_counter()
    summary, text = render_artifact(art)
    seconds = time.perf_counter() - start
    tracemalloc.start()
    render_artifact(art)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    return {
        "seconds": seconds,
        "peak_mib": peak / (1 << 20),
        "status": summary["status"],
        "modules": len(summary["modules"]),
        "exact": "not exact" not in text,
        "file_kib": len(art.text) / 1024,
    }


CASES = [("adversarial", 20, False), ("adversarial", 400, False), ("adversarial", 4096, False), ("alike", 4096, True)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--baseline", type=Path, help="another checkout, run the same in a child with its collectors")
    parser.add_argument("--baseline-timeout", type=float, default=60.0)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:  # one case, in a child: its figures as JSON
        kind, n = args.child.split(":")
        print(json.dumps(measure(craft(int(n), alike=kind == "alike"))))
        return 0
    sys.path.insert(0, str(ROOT))
    print(f"{'case':<12} {'blocks':>6} {'file':>9} {'render s':>9} {'peak MiB':>9} {'status':<12} {'chosen':>6} exact")
    for kind, n, alike in CASES:
        got = measure(craft(n, alike=alike))
        print(
            f"{kind:<12} {n:>6} {got['file_kib']:>7.0f}KB {got['seconds']:>9.3f} {got['peak_mib']:>9.1f} "
            f"{got['status']:<12} {got['modules']:>6} {got['exact']}"
        )
    if args.baseline:
        print(f"baseline: {args.baseline} (each case in a child, killed after {args.baseline_timeout:g} s)")
        env = {**os.environ, "PYTHONPATH": str(args.baseline.resolve())}
        for kind, n, _ in CASES:
            cmd = [sys.executable, str(Path(__file__).resolve()), "--child", f"{kind}:{n}"]
            start = time.perf_counter()
            try:
                out = subprocess.run(
                    cmd, env=env, capture_output=True, text=True, timeout=args.baseline_timeout, check=True
                )
                got = json.loads(out.stdout)
                print(
                    f"{kind:<12} {n:>6} {got['file_kib']:>7.0f}KB {got['seconds']:>9.3f} {got['peak_mib']:>9.1f} "
                    f"{got['status']:<12} {got['modules']:>6} {got['exact']}"
                )
            except subprocess.TimeoutExpired:
                print(f"{kind:<12} {n:>6} {'':>9} > {time.perf_counter() - start:.0f} s (killed)")
            except subprocess.CalledProcessError as exc:
                print(f"{kind:<12} {n:>6} failed: {exc.stderr.strip().splitlines()[-1:]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
