"""All-reduce bus bandwidth through torch.distributed, as training does it.

Used by the node healthcheck (one process per local device) and on its own across nodes::

    torchrun --nnodes 4 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint HEAD:29500 \\
        -m healthcheck.allreduce --min-busbw-gbps 300

Rank 0 prints one JSON object; every rank exits 0 (passed), 2 (wrong results or slower than
``--min-busbw-gbps``) or 3 (could not run).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from healthcheck.functional.bench import synchronize
from healthcheck.functional.measurement import Measurement

ALLREDUCE_SCHEMA = "dynprof.healthcheck.allreduce"


def bus_factor(world_size: int) -> float:
    """nccl-tests' bus-bandwidth factor for all-reduce: 2 (n - 1) / n."""
    return 2 * (world_size - 1) / world_size


def allreduce_busbw(
    device: torch.device, size_bytes: int = 256 * 1024**2, warmup: int = 5, iters: int = 20
) -> Measurement:
    """Time ``iters`` all-reduces of ``size_bytes`` (float32) in the default process group.

    Every rank first checks the sum of rank-dependent values. The time is the slowest rank's,
    so every rank reports the same figure.
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    n = size_bytes // 4
    data = torch.full((n,), float(rank + 1), dtype=torch.float32, device=device)
    dist.all_reduce(data)
    synchronize(device)
    expected = world * (world + 1) / 2
    ok = bool(data[0].item() == expected and data[-1].item() == expected and data[n // 2].item() == expected)
    for _ in range(warmup):
        dist.all_reduce(data)
    synchronize(device)
    dist.barrier()
    start = time.perf_counter()
    for _ in range(iters):
        dist.all_reduce(data)
    synchronize(device)
    elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64, device=device)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    per_iter = float(elapsed.item()) / iters
    algbw = n * 4 / per_iter / 1e9
    busbw = algbw * bus_factor(world)
    return Measurement(
        "allreduce",
        f"allreduce_busbw_gbps_{world}gpu",
        busbw,
        "GB/s",
        ok,
        "" if ok else "all-reduce returned a wrong sum",
        {
            "world_size": world,
            "bytes": n * 4,
            "iterations": iters,
            "algbw_gbps": round(algbw, 2),
            "backend": dist.get_backend(),
            "nvls": os.environ.get("NCCL_NVLS_ENABLE"),
        },
    )


def init_process_group(device: torch.device, timeout_s: float) -> None:
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend=backend, timeout=timedelta(seconds=timeout_s))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m healthcheck.allreduce",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--size-mb", type=int, default=256, help="message size in MiB (default 256)")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--min-busbw-gbps", type=float, default=None, help="fail below this bus bandwidth")
    parser.add_argument("--timeout", type=float, default=300, help="process-group timeout in seconds")
    parser.add_argument("--cpu", action="store_true", help="use gloo on the CPU (for testing the launcher)")
    args = parser.parse_args(argv)
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if args.cpu:
        device = torch.device("cpu")
    else:
        if not torch.cuda.is_available():
            print(json.dumps({"schema": ALLREDUCE_SCHEMA, "error": "no CUDA device visible"}))
            return 3
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    try:
        init_process_group(device, args.timeout)
        result = allreduce_busbw(device, args.size_mb * 1024**2, iters=args.iters)
        hosts = gather_hostnames(device)
    except Exception as exc:  # NCCL / rendezvous failures: report, do not hang
        print(
            json.dumps({"schema": ALLREDUCE_SCHEMA, "rank": os.environ.get("RANK"), "error": str(exc)}), file=sys.stderr
        )
        return 3
    slow = args.min_busbw_gbps is not None and result.value < args.min_busbw_gbps
    code = 0 if result.ok and not slow else 2
    if dist.get_rank() == 0:
        print(
            json.dumps(
                {
                    "schema": ALLREDUCE_SCHEMA,
                    "schema_version": 1,
                    "ok": result.ok and not slow,
                    "busbw_gbps": round(result.value, 2),
                    "min_busbw_gbps": args.min_busbw_gbps,
                    "nodes": sorted({h for h in hosts if h}),
                    "reason": result.reason or ("slow" if slow else ""),
                    **result.details,
                }
            )
        )
    dist.destroy_process_group()
    return code


HOSTNAME_BYTES = 256


def gather_hostnames(device: Any) -> list[str]:
    """Every rank's host name, gathered as fixed-size byte tensors.

    ``all_gather_object`` would pickle through numpy, which a node need not have.
    """
    name = socket.gethostname().encode()[:HOSTNAME_BYTES]
    mine = torch.zeros(HOSTNAME_BYTES, dtype=torch.uint8, device=device)
    mine[: len(name)] = torch.tensor(list(name), dtype=torch.uint8)
    gathered = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, mine)
    return [bytes(t.cpu().tolist()).rstrip(b"\0").decode(errors="replace") for t in gathered]


if __name__ == "__main__":
    sys.exit(main())
