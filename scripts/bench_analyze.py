"""Benchmark `dynprof analyze` against HolisticTraceAnalysis (HTA) on the same trace files.

The traces are SYNTHETIC: generated here in the schema torch.profiler / Kineto writes (CPU
operators with nested aten ops and cudaLaunchKernel calls on the training thread, compute
kernels on one stream, NCCL kernels on another, memcpy, ProfilerStep spans, distributedInfo),
because a GPU machine is needed to record real ones of that size.

Two cases:
  large   one rank, one trace of >= --large-mb MB uncompressed (default 200)
  ranks   --ranks trace files (default 64) of --rank-mb MB each (default 3)

For each case it reports wall time, CPU time (user + system, the child and its worker
processes) and peak memory (the largest summed RSS of the child process that runs the tool and
its worker processes, sampled every 50 ms) for:
  dynprof   collectors.trace_analysis: rank.analyze_ranks + job.combine (the work of `dynprof analyze`)
  hta       hta.TraceAnalysis(trace_dir=...) + get_temporal_breakdown + get_comm_comp_overlap
            + get_gpu_kernel_breakdown (visualize=False)
HTA is optional (`pip install HolisticTraceAnalysis`; it is not a dynprof dependency); without
it, only dynprof's figures are printed.

    PYTHONPATH=. python scripts/bench_analyze.py [--large-mb 200] [--ranks 64] [--rank-mb 3]
        [--workdir DIR] [--skip-hta] [--workers N]
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


# -- synthetic traces -----------------------------------------------------------------------------
def write_trace(path: Path, rank: int, world: int, target_bytes: int, slow: bool = False) -> int:
    """Write a gzipped synthetic Kineto trace of about ``target_bytes`` uncompressed; returns
    the uncompressed size."""
    pid, tid = 1000 + rank, 1000 + rank
    corr = 0
    written = 0
    t = 1_700_000_000_000.0
    step = 0
    with gzip.open(path, "wt", compresslevel=1) as fh:
        head = {
            "schemaVersion": 1,
            "deviceProperties": [{"id": 0, "name": "NVIDIA H200 (synthetic)", "totalGlobalMem": 150754820096}],
            "distributedInfo": {"backend": "nccl", "rank": rank, "world_size": world},
            "displayTimeUnit": "ms",
            "baseTimeNanoseconds": 1700000000000000000,
        }
        text = json.dumps(head)[:-1] + ', "traceEvents": [\n'
        fh.write(text)
        written += len(text)
        first = True

        def emit(e: dict) -> None:
            nonlocal written, first
            s = ("" if first else ",\n") + "  " + json.dumps(e)
            first = False
            fh.write(s)
            written += len(s)

        emit({"ph": "M", "name": "process_name", "pid": pid, "tid": 0, "args": {"name": "python"}})
        emit({"ph": "M", "name": "process_name", "pid": 0, "tid": 0, "args": {"name": "GPU 0"}})
        while written < target_bytes:
            step_start = t
            body: list[dict] = []
            cpu_t = t + 50
            gpu_t = t + 200
            layers = 40
            extra = 1.5 if slow else 1.0
            for layer in range(layers):
                for op, kname, kdur in (
                    ("aten::linear", "ampere_sgemm_128x64_tn", 180 * extra),
                    ("aten::gelu", "vectorized_elementwise_kernel<gelu>", 25 * extra),
                    ("aten::layer_norm", "vectorized_layer_norm_kernel", 20 * extra),
                ):
                    corr += 1
                    body.append(
                        {"ph": "X", "cat": "cpu_op", "name": op, "pid": pid, "tid": tid, "ts": cpu_t, "dur": 30.0,
                         "args": {"External id": corr, "Sequence number": layer, "Fwd thread id": 0}}
                    )  # fmt: skip
                    inner = "aten::addmm" if op == "aten::linear" else op + "_out"
                    body.append(
                        {"ph": "X", "cat": "cpu_op", "name": inner, "pid": pid, "tid": tid, "ts": cpu_t + 5, "dur": 20.0,
                         "args": {"External id": corr}}
                    )  # fmt: skip
                    body.append(
                        {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": pid, "tid": tid,
                         "ts": cpu_t + 10, "dur": 8.0, "args": {"External id": corr, "correlation": corr, "cbid": 211}}
                    )  # fmt: skip
                    body.append(
                        {"ph": "X", "cat": "kernel", "name": kname, "pid": 0, "tid": 7, "ts": gpu_t, "dur": kdur,
                         "args": {"External id": corr, "queued": 0, "device": 0, "context": 1, "stream": 7,
                                  "correlation": corr, "registers per thread": 128, "shared memory": 0,
                                  "blocks per SM": 2.0, "warps per SM": 16.0, "grid": [512, 1, 1],
                                  "block": [256, 1, 1], "est. achieved occupancy %": 50}}
                    )  # fmt: skip
                    body.append(
                        {
                            "ph": "f",
                            "id": corr,
                            "pid": 0,
                            "tid": 7,
                            "ts": gpu_t,
                            "cat": "ac2g",
                            "name": "ac2g",
                            "bp": "e",
                        }
                    )
                    body.append(
                        {"ph": "s", "id": corr, "pid": pid, "tid": tid, "ts": cpu_t + 10, "cat": "ac2g", "name": "ac2g"}
                    )
                    cpu_t += 40
                    gpu_t += kdur + 2
                if layer % 4 == 3:  # a gradient bucket's all-reduce overlapping the next layers
                    corr += 1
                    body.append(
                        {"ph": "X", "cat": "cpu_op", "name": "record_param_comms", "pid": pid, "tid": tid,
                         "ts": cpu_t, "dur": 15.0, "args": {"External id": corr, "Collective name": "allreduce"}}
                    )  # fmt: skip
                    body.append(
                        {"ph": "X", "cat": "kernel", "name": "ncclDevKernel_AllReduce_Sum_bf16_RING_LL", "pid": 0,
                         "tid": 20, "ts": gpu_t - 100, "dur": 400.0,
                         "args": {"External id": corr, "device": 0, "stream": 20, "correlation": corr}}
                    )  # fmt: skip
                    cpu_t += 20
            corr += 1
            body.append(
                {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy DtoH (Device -> Pinned)", "pid": 0, "tid": 21,
                 "ts": gpu_t + 10, "dur": 30.0, "args": {"device": 0, "stream": 21, "correlation": corr, "bytes": 4}}
            )  # fmt: skip
            step_end = max(cpu_t, gpu_t + 50) + 100
            body.insert(
                0,
                {"ph": "X", "cat": "user_annotation", "name": f"ProfilerStep#{step}", "pid": pid, "tid": tid,
                 "ts": step_start, "dur": step_end - step_start, "args": {"External id": 0}},
            )  # fmt: skip
            body.insert(
                1,
                {"ph": "X", "cat": "gpu_user_annotation", "name": f"ProfilerStep#{step}", "pid": 0, "tid": 7,
                 "ts": step_start + 200, "dur": step_end - step_start - 200, "args": {"External id": 0}},
            )  # fmt: skip
            for e in body:
                emit(e)
            t = step_end + 10
            step += 1
        tail = '\n], "traceName": "synthetic"}\n'
        fh.write(tail)
        written += len(tail)
    return written


# -- running each tool in a child, measuring it ----------------------------------------------------
DYNPROF_CHILD = """
import json, sys, time
from collectors.trace_analysis.job import combine
from collectors.trace_analysis.rank import RankInput, analyze_ranks
paths = json.loads(sys.argv[1]); workers = int(sys.argv[2]) or None
t0 = time.perf_counter()
out = combine(analyze_ranks([RankInput(p, max_bytes=8 * 1024**3) for p in paths], workers=workers))
dt = time.perf_counter() - t0
g = out["ranks"][0]["gpu"]
print(json.dumps({"seconds": dt, "ranks": len(out["ranks"]), "steps": len(out["common_steps"]),
                  "rank0_gpu_ms_per_step": g, "errors": out["errors"][:2]}))
"""

HTA_CHILD = """
import json, logging, sys, time
logging.disable(logging.WARNING)
from hta.trace_analysis import TraceAnalysis
trace_dir = sys.argv[1]
t0 = time.perf_counter()
a = TraceAnalysis(trace_dir=trace_dir)
t1 = time.perf_counter()
tb = a.get_temporal_breakdown(visualize=False)
ov = a.get_comm_comp_overlap(visualize=False)
kb = a.get_gpu_kernel_breakdown(visualize=False)
dt = time.perf_counter() - t0
print(json.dumps({"seconds": dt, "parse_seconds": t1 - t0, "ranks": len(tb),
                  "temporal_rank0": {k: (float(v) if isinstance(v, (int, float)) else str(v))
                                     for k, v in tb.iloc[0].to_dict().items()}}))
"""


def run_child(code: str, args: list[str]) -> dict:
    """Run ``code`` in a child; wall time, CPU time (user + system of the child and its worker
    processes: the fairer figure on a shared machine), and the peak of the summed RSS of the
    child and its descendants, sampled every 50 ms."""
    import resource

    import psutil

    usage0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    t0 = time.perf_counter()
    proc = subprocess.Popen(
        [sys.executable, "-c", code, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
    )
    peak = 0
    root = psutil.Process(proc.pid)
    while proc.poll() is None:
        total = 0
        try:
            for p in [root, *root.children(recursive=True)]:
                try:
                    total += p.memory_info().rss
                except psutil.Error:
                    pass
        except psutil.Error:
            pass
        peak = max(peak, total)
        time.sleep(0.05)
    stdout, stderr = proc.communicate()
    wall = time.perf_counter() - t0
    usage1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (usage1.ru_utime - usage0.ru_utime) + (usage1.ru_stime - usage0.ru_stime)
    if proc.returncode != 0:
        return {"error": stderr.strip().splitlines()[-1] if stderr.strip() else f"exit {proc.returncode}"}
    out = json.loads(stdout.strip().splitlines()[-1])
    out["wall_seconds"] = wall
    out["cpu_seconds"] = cpu  # user + system of the child and its worker processes
    out["peak_rss_mb"] = peak / 1e6
    return out


def peak_note(r: dict) -> str:
    return f"{r['peak_rss_mb']:.0f} MB"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--large-mb", type=float, default=200)
    parser.add_argument("--ranks", type=int, default=64)
    parser.add_argument("--rank-mb", type=float, default=3)
    parser.add_argument("--workdir", help="where to write the traces (default: a temporary directory)")
    parser.add_argument("--skip-hta", action="store_true")
    parser.add_argument("--workers", type=int, default=0, help="dynprof worker processes (default: CPUs)")
    parser.add_argument("--only", choices=["large", "ranks"], help="run one case only")
    args = parser.parse_args()

    work = Path(args.workdir or tempfile.mkdtemp(prefix="bench-analyze-"))
    have_hta = False
    if not args.skip_hta:
        try:
            import hta  # noqa: F401

            have_hta = True
        except ImportError:
            print("HTA is not installed (pip install HolisticTraceAnalysis): dynprof only")
    print(f"traces: SYNTHETIC, Kineto schema, in {work}; {os.cpu_count()} CPUs")
    cases = []
    if args.only in (None, "ranks"):
        d = work / f"ranks{args.ranks}"
        if not d.exists():
            d.mkdir(parents=True)
            sizes = [
                write_trace(d / f"rank{r}.pt.trace.json.gz", r, args.ranks, int(args.rank_mb * 1e6), slow=(r == 3))
                for r in range(args.ranks)
            ]
            print(f"wrote {args.ranks} traces, {sum(sizes) / 1e6:.0f} MB uncompressed in all")
        cases.append((f"{args.ranks} ranks x {args.rank_mb:g} MB", d))
    if args.only in (None, "large"):
        d = work / "large"
        if not d.exists():
            d.mkdir(parents=True)
            size = write_trace(d / "rank0.pt.trace.json.gz", 0, 1, int(args.large_mb * 1e6))
            print(f"wrote one trace of {size / 1e6:.0f} MB uncompressed")
        cases.append((f"1 trace x {args.large_mb:g} MB", d))
    rows = []
    for label, d in cases:
        paths = sorted(str(p) for p in d.glob("*.json.gz"))
        gz = sum(os.path.getsize(p) for p in paths) / 1e6
        dp = run_child(DYNPROF_CHILD, [json.dumps(paths), str(args.workers)])
        print(f"\n[{label}] ({gz:.0f} MB gzipped)\n  dynprof: {json.dumps(dp)}")
        hta_r = run_child(HTA_CHILD, [str(d)]) if have_hta else None
        if hta_r is not None:
            print(f"  hta:     {json.dumps(hta_r)}")
        rows.append((label, dp, hta_r))
    print("\ncase                      tool      wall s    CPU s   peak RSS   x faster (wall, CPU)")
    for label, dp, hta_r in rows:
        if "error" in dp:
            print(f"{label:<25} dynprof failed: {dp['error']}")
            continue
        print(f"{label:<25} dynprof {dp['wall_seconds']:>8.2f} {dp['cpu_seconds']:>8.2f}   {peak_note(dp):>8}")
        if hta_r is not None:
            if "error" in hta_r:
                print(f"{'':<25} hta     failed: {hta_r['error']}")
            else:
                w = hta_r["wall_seconds"] / dp["wall_seconds"]
                c = hta_r["cpu_seconds"] / dp["cpu_seconds"]
                print(
                    f"{'':<25} hta     {hta_r['wall_seconds']:>8.2f} {hta_r['cpu_seconds']:>8.2f}   "
                    f"{peak_note(hta_r):>8}   {w:>5.1f}, {c:>4.1f}"
                )
    return 0


if __name__ == "__main__":
    sys.exit(main())
