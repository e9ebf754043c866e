#!/usr/bin/env python3
"""What starting the dynprof agent costs a job that has imported torch: time, RSS, modules.

Each run is a fresh interpreter that imports torch (the job's own cost, not counted), then
starts the agent as a ``DYNPROF=1`` job does (``dynprof._startup.autostart("pth")``, the call
the package's .pth line makes) and waits until the agent's server thread has loaded its
extensions. It reports, beyond torch:

* ``start``: time on the calling thread, until ``autostart`` returns (what the job waits for);
* ``ready``: time until the agent is ready (its extensions imported and installed, on the
  agent's own thread, while the job goes on);
* ``cpu``: CPU time of the whole process (all threads) until ready: less moved by other
  processes on a busy machine than the wall-clock times;
* for the memory modules among them, the time Python spent executing each (``-X importtime``'s
  self time; it times modules that an ``import`` statement loads, so not the agent's extension
  modules themselves, which the agent loads with ``importlib``);
* ``rss``: resident memory added, read once the agent's threads have settled;
* the dynprof modules (``dynprof.*``, ``collectors.*``, ``healthcheck.*``) it loaded, and how
  many other modules came with them.

With several checkouts, the modules that not all of them load are then imported alone, on one
thread, after torch and the modules all of them load: their time, CPU time, RSS and Python heap
(tracemalloc), without the agent's threads around them.

Each checkout's packages are copied to a temporary directory and compiled to bytecode there
first, so that every checkout is read from .pyc files (as an installed dynprof is) and none is
written to. Several runs per checkout, interleaved (A, B, A, B, ...) so both see the same
machine noise, after one run each that is not counted; the figures are medians. Give
``--repo DIR`` once per checkout to compare them side by side (its copy goes first on the
child's ``sys.path``)::

    python scripts/bench_agent_import.py --repo /path/to/before --repo . [--runs 7]

The agents run with a private run and artifact directory and are stopped at the end of each
run; a run whose ``dynprof`` module is not the named checkout's is reported as an error.
"""

from __future__ import annotations

import argparse
import compileall
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("dynprof", "collectors", "healthcheck")
STAGED: dict[Path, Path] = {}  # checkout -> its packages copied and compiled (see stage)

MARK = "-- dynprof bench: torch imported --"

CHILD = r"""
import json, os, sys, time
MARK = sys.argv[3]
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
sys.stderr.write("\n" + MARK + "\n")
sys.stderr.flush()
c0 = time.process_time()
t0 = time.perf_counter()
from dynprof import _startup

_startup.autostart("pth")
t_start = time.perf_counter() - t0
import dynprof.agent

agent = dynprof.agent.get()
ready = bool(agent is not None and agent.wait_ready(120))
t_ready = time.perf_counter() - t0
c_ready = time.process_time() - c0
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
    "cpu_s": c_ready,
    "rss_bytes": rss1 - rss0,
    "modules": ours,
    "other_modules": len(new) - len(ours),
}))
dynprof.agent.shutdown()
"""


ALONE = r"""
import importlib, json, os, sys, time
repo = sys.argv[1]
sys.path.insert(0, repo)
common, extra, trace = json.loads(sys.argv[2]), json.loads(sys.argv[3]), sys.argv[4] == "trace"


def rss():
    with open("/proc/self/statm", "rb") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


import torch  # noqa: F401

for name in common:
    importlib.import_module(name)
if trace:
    import tracemalloc

    tracemalloc.start()
rss0 = rss()
c0, t0 = time.process_time(), time.perf_counter()
for name in extra:
    importlib.import_module(name)
t, c = time.perf_counter() - t0, time.process_time() - c0
heap = tracemalloc.get_traced_memory()[0] if trace else None
print(json.dumps({"import_s": t, "cpu_s": c, "rss_bytes": rss() - rss0, "heap_bytes": heap,
                  "dynprof_file": sys.modules["dynprof"].__file__}))
"""


def alone_run(repo: Path, common: list[str], extra: list[str], scratch: Path, trace: bool) -> dict[str, Any]:
    """In a fresh interpreter with torch and ``common`` imported, on one thread: what importing
    ``extra`` costs (with ``trace``, the Python heap it adds, by tracemalloc, which slows it)."""
    env = _env(scratch)
    src = STAGED.get(repo, repo)
    proc = subprocess.run(
        [sys.executable, "-c", ALONE, str(src), json.dumps(common), json.dumps(extra), "trace" if trace else "-"],
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
    if not str(doc["dynprof_file"]).startswith(str(src) + os.sep):
        return {"error": f"dynprof came from {doc['dynprof_file']}, not from {src} (a copy of {repo})"}
    return doc


def stage(repos: list[Path], root: Path) -> None:
    """Copy each checkout's packages under ``root`` and compile their bytecode there, as an
    installation has it: every checkout is then read from .pyc files, whatever
    PYTHONDONTWRITEBYTECODE or stale caches say, and no checkout is written to."""
    for i, repo in enumerate(repos):
        target = root / f"src-{i}"
        for name in PACKAGES:
            if (repo / name).is_dir():
                shutil.copytree(repo / name, target / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        compileall.compile_dir(str(target), quiet=1)
        STAGED[repo] = target


def _env(scratch: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("DYNPROF", "PYTHONPATH") and not k.startswith("DYNPROF_")}
    env["DYNPROF_RUN_DIR"] = str(scratch / "run")
    env["DYNPROF_ARTIFACT_DIR"] = str(scratch / "artifacts")
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    return env


def one_run(repo: Path, settle: float, scratch: Path) -> dict[str, Any]:
    env = _env(scratch)
    src = STAGED.get(repo, repo)
    proc = subprocess.run(
        [sys.executable, "-X", "importtime", "-c", CHILD, str(src), str(settle), MARK],
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
    if not str(doc["dynprof_file"]).startswith(str(src) + os.sep):
        return {"error": f"dynprof came from {doc['dynprof_file']}, not from {src} (a copy of {repo})"}
    if not doc["ready"]:
        return {"error": "the agent did not become ready"}
    doc["import_self_us"] = import_times(proc.stderr)
    return doc


def import_times(stderr: str) -> dict[str, int]:
    """``-X importtime``'s self time (us) of each module imported after the mark."""
    _, found, after = stderr.partition(MARK)
    out: dict[str, int] = {}
    for line in after.splitlines() if found else []:
        _, sep, rest = line.partition("import time:")
        parts = rest.split("|")
        if not sep or len(parts) != 3 or not parts[0].strip().isdigit():
            continue
        out[parts[2].strip()] = out.get(parts[2].strip(), 0) + int(parts[0])
    return out


def _ms(us: int | None) -> str:
    return f"{us / 1000:.2f} ms" if us else "(not timed)"


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
    with tempfile.TemporaryDirectory(prefix="dynprof-bench-import-") as staging:
        stage(repos, Path(staging))
        return measure(args, repos)


def measure(args: argparse.Namespace, repos: list[Path]) -> int:
    runs: dict[Path, list[dict[str, Any]]] = {r: [] for r in repos}
    with tempfile.TemporaryDirectory(prefix="dynprof-bench-import-") as tmp:
        for repo in repos:  # files cached: not counted
            warm = Path(tmp) / f"warm-{repos.index(repo)}"
            warm.mkdir()
            one_run(repo, args.settle, warm)
        for i in range(args.runs):
            for repo in repos:
                scratch = Path(tmp) / f"{i}-{len(runs[repo])}-{repos.index(repo)}"
                scratch.mkdir()
                runs[repo].append(one_run(repo, args.settle, scratch))
    figures: dict[str, dict[str, Any]] = {}
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
            "cpu_ms": round(statistics.median(r["cpu_s"] for r in good) * 1000, 1),
            "module_import_us": {
                m: int(statistics.median(r["import_self_us"].get(m, 0) for r in good))
                for m in good[-1]["modules"]
                if m in good[-1]["import_self_us"]
            },
            "rss_mib": round(statistics.median(r["rss_bytes"] for r in good) / 2**20, 1),
            "modules": good[-1]["modules"],
            "other_modules": good[-1]["other_modules"],
        }
    if args.json:
        print(json.dumps(figures, indent=2))
        return 0 if all("runs" in f for f in figures.values()) else 1
    print(
        f"agent start after `import torch`, median of {args.runs} fresh interpreters each "
        f"(Python {sys.version.split()[0]}, under -X importtime)"
    )
    names = [str(r) for r in repos]
    width = max(len(n) for n in names) + 2
    columns = (
        ("start ms", "start_ms"),
        ("ready ms", "ready_ms"),
        ("CPU ms", "cpu_ms"),
        ("RSS MiB", "rss_mib"),
    )
    print(f"{'checkout':<{width}} " + " ".join(f"{title:>{len(title)}}" for title, _ in columns) + "  modules")
    for name in names:
        f = figures[name]
        if "runs" not in f:
            print(f"{name:<{width}} failed: {f['errors'][0]}")
            continue
        cells = " ".join(f"{f[key]:>{len(title)}}" for title, key in columns)
        print(f"{name:<{width}} {cells}  {len(f['modules'])} dynprof + {f['other_modules']} others")
        for e in f["errors"]:
            print(f"  (a run failed: {e})")
    loaded = [set(figures[n].get("modules", [])) for n in names]
    everywhere = set.intersection(*loaded) if loaded else set()
    for name, mods in zip(names, loaded):
        times = figures[name].get("module_import_us", {})
        print(f"\nloaded by {name}: {len(mods)} dynprof modules")
        memory = sorted(m for m in mods if "mem" in m)
        print("  memory (import self time): " + (", ".join(f"{m} {_ms(times.get(m))}" for m in memory) or "(none)"))
        if len(names) > 1:
            print("  not loaded by every other checkout: " + (", ".join(sorted(mods - everywhere)) or "(none)"))
        else:
            print("  all: " + ", ".join(sorted(mods)))
    if len(names) > 1:
        print("\nloaded by all: " + ", ".join(sorted(everywhere)))
        differing(repos, figures, everywhere, args.runs)
    return 0 if all("runs" in f for f in figures.values()) else 1


def differing(repos: list[Path], figures: dict[str, Any], everywhere: set[str], runs: int) -> None:
    """The modules that only some checkouts load, imported alone on one thread after torch and
    the modules all of them load (but the agent's): the difference without the agent's threads
    around it."""
    print(f"\nthe modules not loaded by every checkout, imported alone (one thread), median of {runs}:")
    # Not the agent's own modules: they are what imports the differing ones.
    common = sorted((m for m in everywhere if not m.startswith("dynprof.agent")), key=lambda m: (m.count("."), m))
    with tempfile.TemporaryDirectory(prefix="dynprof-bench-import-") as tmp:
        results: dict[Path, list[dict[str, Any]]] = {r: [] for r in repos}
        heap: dict[Path, Any] = {}
        extras = {r: sorted(set(figures[str(r)].get("modules", [])) - everywhere) for r in repos}
        for i in range(runs + 1):  # the first round warms the caches and weighs the heap: not timed
            for repo in repos:
                scratch = Path(tmp) / f"{i}-{repos.index(repo)}"
                scratch.mkdir()
                result = alone_run(repo, common, extras[repo], scratch, trace=not i)
                if i:
                    results[repo].append(result)
                else:
                    heap[repo] = result.get("heap_bytes")
    for repo in repos:
        good = [r for r in results[repo] if "error" not in r]
        if not good:
            print(f"  {repo}: failed: {results[repo][0].get('error') if results[repo] else '?'}")
            continue
        t = statistics.median(r["import_s"] for r in good) * 1000
        c = statistics.median(r["cpu_s"] for r in good) * 1000
        m = statistics.median(r["rss_bytes"] for r in good) / 1024
        h = f"{heap[repo] / 1024:.0f} KiB" if isinstance(heap.get(repo), int) else "?"
        print(
            f"  {repo}: {t:.2f} ms ({c:.2f} ms CPU), RSS +{m:.0f} KiB, Python heap +{h}: "
            f"{', '.join(extras[repo]) or '(none)'}"
        )


if __name__ == "__main__":
    sys.exit(main())
