"""One side of a link test: a torch.distributed process that exchanges a buffer with its peers.

Run as ``python -m healthcheck.links.worker --rank R --world W --store-host H --store-port P``
(by :func:`healthcheck.links.side.run_side`, in a process group of its own that is killed past
the side's time limit). Rank 0 hosts the rendezvous, a ``TCPStore`` on ``--store-port`` of its
own node (``--store-host`` is its address as the other nodes reach it); the others connect to
it. Then ``init_process_group`` with gloo (CPU) or NCCL (GPU 0 of the node), as training does.

Patterns (``--pattern``), ``--warmup`` untimed iterations, then ``--iters`` timed ones, which
begin at ``--start-at`` (epoch seconds) when it is given: all tests of a round then load the
network at the same time, so no pair is measured alone while the others are still starting
(a side that arrives late starts at once and reports ``late_s``):

- ``sendrecv`` (default): every rank sends the buffer to the next rank and receives one from
  the previous, at once (``batch_isend_irecv``); with 2 ranks that is send/recv both ways, with
  3 a ring, and each node's NIC carries one buffer each way per iteration either way.
  busbw = algbw = size / time (nccl-tests' sendrecv factor, 1).
- ``allreduce``: ``all_reduce`` of the buffer; busbw = algbw * 2 (n - 1) / n (nccl-tests).

An exchange is sent in pieces of at most ``CHUNK_BYTES`` (64 MiB), one after the other, so a
side holds at most one send and one receive piece whatever the size. With ``--bind``, rank 0's
rendezvous listens on that address only (the sidecar's own), not on every address.

Each iteration's time is the slowest rank's (a MAX all-reduce of the per-iteration seconds),
so all ranks report the same figure; the figure is the median iteration's (algbw = size /
median time), so a moment of contention on one side does not make the link look slow. Prints one JSON object on stdout; exit 0, or 3 with the reason on stderr.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import socket
import statistics
import struct
import sys
import time
from datetime import timedelta
from typing import Any

LINK_SIDE_SCHEMA = "dynprof.healthcheck.link_side"
SIOCGIFADDR = 0x8915
CHUNK_BYTES = 64 * 1024 * 1024  # the buffer is exchanged in pieces of at most this: memory is bounded


def chunks(elements: int, chunk: int) -> list[int]:
    """The piece sizes (elements) of one exchange of ``elements``, each at most ``chunk``."""
    out = [chunk] * (elements // chunk)
    if elements % chunk:
        out.append(elements % chunk)
    return out


def listen_socket(bind: str, port: int) -> socket.socket:
    """A listening socket on ``bind``:``port`` only (the sidecar's own address), for rank 0's
    rendezvous: the store never listens on addresses the sidecar does not serve."""
    family, kind, proto, _, address = socket.getaddrinfo(
        bind.strip("[]"), port, socket.AF_UNSPEC, socket.SOCK_STREAM, 0, socket.AI_PASSIVE
    )[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(128)
    except OSError:
        sock.close()
        raise
    return sock


def interface_of(address: str) -> str | None:
    """The name of the local interface that holds IPv4 ``address`` (None: none, or not IPv4)."""
    try:
        packed = socket.inet_aton(address)
    except OSError:
        return None
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:
                raw = fcntl.ioctl(s.fileno(), SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
            except OSError:
                continue
            if raw[20:24] == packed:
                return name
    return None


def local_address_towards(host: str, port: int) -> str | None:
    """The local address the kernel would use to reach ``host`` (no packet is sent)."""
    try:
        infos = socket.getaddrinfo(host, port, socket.AF_INET, socket.SOCK_DGRAM)
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(infos[0][4])
            return str(s.getsockname()[0])
    except (OSError, IndexError):
        return None


def pick_interface(store_host: str, store_port: int) -> str | None:
    """The interface toward the rendezvous host: what gloo and NCCL's bootstrap should use
    (``GLOO_SOCKET_IFNAME`` / ``NCCL_SOCKET_IFNAME``) unless the environment names one."""
    address = local_address_towards(store_host, store_port)
    return interface_of(address) if address else None


def _wait_until(start_at: float) -> float | None:
    """Sleep until ``start_at`` (epoch seconds; 0: no common start); how late this side was
    when it got there (None: on time or no common start)."""
    if start_at <= 0:
        return None
    now = time.time()
    if now >= start_at:
        return round(now - start_at, 3)
    time.sleep(min(start_at - now, 3600.0))
    return None


def die_with_parent() -> None:
    """Linux: SIGKILL this worker when the side that started it dies (a sidecar's child killed
    past its limit must not leave a worker behind in another session)."""
    try:
        import ctypes
        import signal

        libc = ctypes.CDLL(None, use_errno=True)
        parent = os.getppid()
        libc.prctl(1, int(signal.SIGKILL), 0, 0, 0)  # PR_SET_PDEATHSIG
        if os.getppid() != parent:  # the parent died before the call
            os._exit(3)
    except (OSError, AttributeError):
        pass


def bus_factor(pattern: str, world: int) -> float:
    return 1.0 if pattern == "sendrecv" else 2 * (world - 1) / world


def run(args: argparse.Namespace) -> dict[str, Any]:
    ifname = pick_interface(args.store_host, args.store_port)
    if ifname:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", ifname)
        os.environ.setdefault("NCCL_SOCKET_IFNAME", ifname)

    import torch
    import torch.distributed as dist
    from torch.distributed import TCPStore  # type: ignore[attr-defined]

    backend = args.backend
    if backend == "auto":
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    device = torch.device("cuda", 0) if backend == "nccl" else torch.device("cpu")
    if backend == "nccl":
        torch.cuda.set_device(device)
    timeout = timedelta(seconds=args.timeout)
    started = time.monotonic()
    listener = listen_socket(args.bind, args.store_port) if args.rank == 0 and args.bind else None
    store = TCPStore(
        args.store_host,
        args.store_port,
        world_size=args.world,
        is_master=args.rank == 0,
        timeout=timeout,
        wait_for_workers=False,
        master_listen_fd=listener.fileno() if listener is not None else None,
    )
    dist.init_process_group(backend, store=store, rank=args.rank, world_size=args.world, timeout=timeout)
    joined_s = time.monotonic() - started

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    n = max(1, args.size // 4)
    # one exchange is the whole size, in pieces of at most CHUNK_BYTES: each side holds a send
    # piece (and a receive piece for sendrecv), never the whole size twice over
    pieces = chunks(n, max(1, CHUNK_BYTES // 4))
    send = torch.full((pieces[0],), float(args.rank + 1), dtype=torch.float32, device=device)
    recv = torch.empty_like(send) if args.pattern == "sendrecv" else send
    nxt, prev = (args.rank + 1) % args.world, (args.rank - 1) % args.world

    def once() -> None:
        for piece in pieces:
            if args.pattern == "sendrecv":
                ops = [dist.P2POp(dist.isend, send[:piece], nxt), dist.P2POp(dist.irecv, recv[:piece], prev)]
                for req in dist.batch_isend_irecv(ops):
                    req.wait()
            else:
                dist.all_reduce(send[:piece])

    for _ in range(args.warmup):
        once()
    sync()
    if args.pattern == "sendrecv" and args.warmup and float(recv[0].item()) != float(prev + 1):
        raise RuntimeError(f"rank {args.rank} received {float(recv[0].item())} from rank {prev}, not {prev + 1}")
    dist.barrier()
    late_s = _wait_until(args.start_at)
    dist.barrier()  # the two sides' clocks may differ by a little: start together
    times = []
    for _ in range(args.iters):
        t0 = time.perf_counter()
        once()
        sync()
        times.append(time.perf_counter() - t0)
    # the slowest rank's time of each iteration; the figure is the median iteration's, so a
    # moment of CPU contention on one side does not make the link look slow
    slowest = torch.tensor(times, dtype=torch.float64, device=device)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    per_iter = sorted(float(t) for t in slowest.tolist())
    seconds = statistics.median(per_iter)
    dist.destroy_process_group()
    size = n * 4
    algbw = size / seconds / 1e9 if seconds > 0 else 0.0
    factor = bus_factor(args.pattern, args.world)
    return {
        "schema": LINK_SIDE_SCHEMA,
        "schema_version": 1,
        "rank": args.rank,
        "world": args.world,
        "backend": backend,
        "pattern": args.pattern,
        "interface": ifname,
        "size_bytes": size,
        "iters": args.iters,
        "warmup": args.warmup,
        "joined_s": round(joined_s, 4),
        "seconds": seconds,
        "late_s": late_s,
        "seconds_min": per_iter[0],
        "seconds_max": per_iter[-1],
        "algbw_gbps": algbw,
        "bus_factor": factor,
        "busbw_gbps": algbw * factor,
    }


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m healthcheck.links.worker")
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world", type=int, required=True)
    p.add_argument("--store-host", required=True)
    p.add_argument("--store-port", type=int, required=True)
    p.add_argument("--bind", default=None, help="rank 0: the rendezvous listens on this address only")
    p.add_argument("--backend", choices=("auto", "gloo", "nccl"), default="auto")
    p.add_argument("--pattern", choices=("sendrecv", "allreduce"), default="sendrecv")
    p.add_argument("--size", type=int, default=64 * 1024 * 1024)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--timeout", type=float, default=60.0)
    p.add_argument("--start-at", type=float, default=0.0, help="epoch s: begin the timed iterations then")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    die_with_parent()
    try:
        doc = run(args)
    except Exception as exc:  # any failure is this side's answer, never a traceback
        print(f"link test failed: {type(exc).__name__}: {str(exc)[:2000]}", file=sys.stderr)
        return 3
    print(json.dumps(doc), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
