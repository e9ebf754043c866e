"""A training loop started with plain python (no dynprof), for `dynprof attach` tests.

Prints ``READY <pid>`` after its first optimizer step. Each iteration runs inside
``record_function("iteration_<i>")``, so a trace names the loop's own iteration numbers (the
check that ranks traced "at the same step" really traced the same iterations).

--hold sleep|gil  after READY, park the main thread for --hold-seconds: in time.sleep (GIL
                  released), or in a C call that keeps the GIL (libc sleep through
                  ctypes.PyDLL); print ``RETURNED`` after it, then keep training
--release-fifo P  with --hold gil: hold in a C read of FIFO P instead (GIL kept) until the
                  test writes a byte to it, for as long as the test needs
--churn           a second thread that allocates all the time
--gap-ms MS       print ``GAP <ms>`` for every step that took longer than MS (pause measurement)
--dist            join a gloo process group from RANK/WORLD_SIZE and all-reduce the gradients
"""

from __future__ import annotations

import argparse
import ctypes
import os
import sys
import threading
import time

import torch


def churn() -> None:
    while True:
        data = {i: [str(i)] * 3 for i in range(2000)}
        del data


def hold(kind: str, seconds: float, release_fifo: str = "") -> None:
    if kind == "sleep":
        time.sleep(seconds)
    elif kind == "gil" and release_fifo:
        fd = os.open(release_fifo, os.O_RDWR)  # RDWR: opening does not wait for a writer
        ctypes.PyDLL("libc.so.6").read(fd, ctypes.create_string_buffer(1), 1)  # the GIL stays held
        os.close(fd)
    elif kind == "gil":
        ctypes.PyDLL("libc.so.6").sleep(int(seconds))  # PyDLL: the GIL stays held
    os.write(1, b"RETURNED\n")


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--hold", choices=("none", "sleep", "gil"), default="none")
    parser.add_argument("--hold-seconds", type=float, default=10.0)
    parser.add_argument("--release-fifo", default="")
    parser.add_argument("--step-sleep", type=float, default=0.0)
    parser.add_argument("--max-seconds", type=float, default=180.0)
    parser.add_argument("--churn", action="store_true")
    parser.add_argument("--gap-ms", type=float, default=0.0)
    parser.add_argument("--dist", action="store_true")
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()

    if args.dist:
        import torch.distributed as dist

        dist.init_process_group("gloo")
    torch.set_num_threads(1)
    torch.manual_seed(0)
    device = torch.device(args.device)
    model = torch.nn.Sequential(
        torch.nn.Linear(args.width, args.width), torch.nn.ReLU(), torch.nn.Linear(args.width, 1)
    ).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(32, args.width, device=device), torch.randn(32, 1, device=device)
    if args.churn:
        threading.Thread(target=churn, name="churn", daemon=True).start()
    deadline = time.monotonic() + args.max_seconds
    i = 0
    last = 0.0
    while time.monotonic() < deadline:
        i += 1
        with torch.profiler.record_function(f"iteration_{i}"):
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            if args.dist:
                for p in model.parameters():
                    dist.all_reduce(p.grad)
            opt.step()
        now = time.perf_counter()
        if args.gap_ms and last and (now - last) * 1000 > args.gap_ms:
            os.write(1, f"GAP {(now - last) * 1000:.1f} {time.time():.3f}\n".encode())
        last = now
        if i == 1:
            os.write(1, f"READY {os.getpid()}\n".encode())
            if args.hold != "none":
                hold(args.hold, args.hold_seconds, args.release_fifo)
                last = time.perf_counter()
        if args.step_sleep:
            time.sleep(args.step_sleep)
    return 0


if __name__ == "__main__":
    sys.exit(main())
