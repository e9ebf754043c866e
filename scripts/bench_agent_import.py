#!/usr/bin/env python3
"""What starting the dynprof agent costs a job that has imported torch: time, RSS, modules.

Each run is a fresh interpreter that imports torch (the job's own cost, not counted), then
starts the agent as a ``DYNPROF=1`` job does (``dynprof._startup.autostart("pth")``, the call
the package's .pth line makes) and waits until the agent's server thread has loaded its
extensions. It reports, beyond torch:

* ``start``: time on the calling thread, until ``autostart`` returns (what the job waits for);
* ``ready``: time until the agent is ready (its extensions imported and installed, on the
  agent's own thread, while the job goes on);
* ``rss``: resident memory added, read once the agent's threads have settled;
* the dynprof modules (``dynprof.*``, ``collectors.*``, ``healthcheck.*``) it loaded, and how
  many other modules came with them.

Several runs per checkout, interleaved (A, B, A, B, ...) so both see the same machine noise;
the figures are medians. Give ``--repo DIR`` once per checkout to compare them side by side
(DIR goes first on the child's ``sys.path``)::

    python scripts/bench_agent_import.py --repo /path/to/before --repo . [--runs 7]

The agents run with a private run and artifact directory and are stopped at the end of each
run; a run whose ``dynprof`` module is not the named checkout's is reported as an error.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent

CHILD = r"""
import json, os, sys, time
repo = sys.argv[1]
settle = float(sys.argv[2])
sys.path.insert(0, repo)


def rss():
    with open("/proc/self/statm", "rb") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


import torch  # noqa: F401  (the job's own import)

before = set(sys.modules)
rss0 = rss()
os.environ["DYNPROF"] = "1"
t0 = time.perf_counter()
from dynprof import _startup

_startup.autostart("pth")
t_start = time.perf_counter() - t0
import dynprof.agent

agent = dynprof.agent.get()
ready = bool(agent is not None and agent.wait_ready(120))
t_ready = time.perf_counter() - t0
time.sleep(settle)  # the agent's threads (the host-memory watch) finish their start-up imports
rss1 = rss()
new = set(sys.modules) - before
ours = sorted(m for m in new if m.split(".")[0] in ("dynprof", "collectors", "healthcheck"))
print(json.dumps({
    "dynprof_file": sys.modules["dynprof"].__file__,
    "agent": agent is not None,
    "ready": ready,
    "start_s": t_start,
    "ready_s": t_ready,
    "rss_bytes": rss1 - rss0,
    "modules": ours,
    "other_modules": len(new) - len(ours),
}))
dynprof.agent.shutdown()
"""


def one_run(repo: Path, settle: float, scratch: Path) -> dict[str, Any]:
    env = {k: v for k, v in os.environ.items() if k not in ("DYNPROF", "PYTHONPATH") and not k.startswith("DYNPROF_")}
    env["DYNPROF_RUN_DIR"] = str(scratch / "run")
    env["DYNPROF_ARTIFACT_DIR"] = str(scratch / "artifacts")
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, str(repo), str(settle)],
        env=env,
        cwd=str(scratch),
        capture_output=True,
        text=True,
        timeout=300,
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        return {"error": f"exit {proc.returncode}: {proc.stderr.strip()[-2000:]}"}
    doc: dict[str, Any] = json.loads(lines[-1])
    if not str(doc["dynprof_file"]).startswith(str(repo) + os.sep):
        return {"error": f"dynprof came from {doc['dynprof_file']}, not from {repo}"}
    if not doc["ready"]:
        return {"error": "the agent did not become ready"}
    return doc


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--repo",
        action="append",
        type=Path,
        help="a dynprof checkout to measure (repeat to compare; default: this one)",
    )
    parser.add_argument("--runs", type=int, default=5, help="fresh interpreters per checkout (default 5)")
    parser.add_argument("--settle", type=float, default=0.5, help="seconds to wait after ready before RSS (0.5)")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    args = parser.parse_args()
    repos = [p.resolve() for p in (args.repo or [ROOT])]
    runs: dict[Path, list[dict[str, Any]]] = {r: [] for r in repos}
    with tempfile.TemporaryDirectory(prefix="dynprof-bench-import-") as tmp:
        for i in range(args.runs):
            for repo in repos:
                scratch = Path(tmp) / f"{i}-{len(runs[repo])}-{repos.index(repo)}"
                scratch.mkdir()
                runs[repo].append(one_run(repo, args.settle, scratch))
    figures = {}
    for repo, rs in runs.items():
        good = [r for r in rs if "error" not in r]
        errors = [r["error"] for r in rs if "error" in r]
        if not good:
            figures[str(repo)] = {"errors": errors}
            continue
        figures[str(repo)] = {
            "runs": len(good),
            "errors": errors,
            "start_ms": round(statistics.median(r["start_s"] for r in good) * 1000, 1),
            "ready_ms": round(statistics.median(r["ready_s"] for r in good) * 1000, 1),
            "rss_mib": round(statistics.median(r["rss_bytes"] for r in good) / 2**20, 1),
            "modules": good[-1]["modules"],
            "other_modules": good[-1]["other_modules"],
        }
    if args.json:
        print(json.dumps(figures, indent=2))
        return 0 if all("runs" in f for f in figures.values()) else 1
    print(
        f"agent start after `import torch`, median of {args.runs} fresh interpreters each (Python {sys.version.split()[0]})"
    )
    names = [str(r) for r in repos]
    width = max(len(n) for n in names) + 2
    print(
        f"{'checkout':<{width}} {'start ms':>9} {'ready ms':>9} {'RSS MiB':>8} {'dynprof mods':>12} {'other mods':>10}"
    )
    for name in names:
        f = figures[name]
        if "runs" not in f:
            print(f"{name:<{width}} failed: {f['errors'][0]}")
            continue
        print(
            f"{name:<{width}} {f['start_ms']:>9} {f['ready_ms']:>9} {f['rss_mib']:>8} "
            f"{len(f['modules']):>12} {f['other_modules']:>10}"
        )
        for e in f["errors"]:
            print(f"  (a run failed: {e})")
    loaded = [set(figures[n].get("modules", [])) for n in names]
    everywhere = set.intersection(*loaded) if loaded else set()
    for name, mods in zip(names, loaded):
        only = sorted(mods - everywhere)
        print(f"\nloaded by {name}: {len(mods)} dynprof modules")
        memory = sorted(m for m in mods if "mem" in m)
        print("  memory: " + (", ".join(memory) or "(none)"))
        if len(names) > 1:
            print("  not loaded by every other checkout: " + (", ".join(only) or "(none)"))
        else:
            print("  all: " + ", ".join(sorted(mods)))
    if len(names) > 1:
        print("\nloaded by all: " + ", ".join(sorted(everywhere)))
    return 0 if all("runs" in f for f in figures.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
