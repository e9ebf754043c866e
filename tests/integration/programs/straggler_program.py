"""A 2-rank training loop where one rank can be made slow, for `dynprof analyze`.

Each rank joins a process group (RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT from the environment,
as torchrun sets them; gloo on CPU, or nccl with --device cuda), then per step: ``load_batch``
(sleeping ``--load-ms`` on the ranks listed in ``--slow-ranks``, ``--base-load-ms`` elsewhere),
``extra_compute`` (``--extra-matmuls`` matmuls of ``--matmul-size`` on the slow ranks only),
forward, backward, one all_reduce per gradient, optimizer step, and ``loss.item()`` (as a
logging loop does, which keeps the CPU in step with the GPU). Prints ``READY <pid>`` after the
first optimizer step.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.distributed as dist


def load_batch(width: int, sleep_s: float, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    if sleep_s:
        time.sleep(sleep_s)
    return torch.randn(32, width, device=device), torch.randn(32, 1, device=device)


def extra_compute(count: int, a: torch.Tensor) -> None:
    for _ in range(count):
        a = torch.mm(a, a)
        a = a / a.norm()


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--slow-ranks", default="", help="comma-separated ranks that are slow")
    parser.add_argument("--load-ms", type=float, default=60.0, help="load_batch time on the slow ranks")
    parser.add_argument("--base-load-ms", type=float, default=1.0, help="load_batch time on the other ranks")
    parser.add_argument("--extra-matmuls", type=int, default=0, help="extra matmuls per step on the slow ranks")
    parser.add_argument("--matmul-size", type=int, default=4096)
    parser.add_argument(
        "--device",
        default="cpu",
        help="cpu (gloo), cuda (nccl, device LOCAL_RANK) or cuda-shared (every rank on cuda:0, gloo between them)",
    )
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--max-seconds", type=float, default=120.0)
    args = parser.parse_args()

    torch.set_num_threads(1)  # two ranks on a small CPU machine: no intra-op threads fighting
    if args.device == "cuda":
        local = int(os.environ.get("LOCAL_RANK", os.environ.get("RANK", "0")))
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
        dist.init_process_group("nccl", device_id=device)
    elif args.device == "cuda-shared":
        # ranks sharing one GPU (NCCL refuses two ranks on one device): gloo all-reduces the
        # CUDA gradients through the host
        device = torch.device("cuda", 0)
        torch.cuda.set_device(0)
        dist.init_process_group("gloo")
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    rank = dist.get_rank()
    slow = {int(r) for r in args.slow_ranks.split(",") if r.strip()}
    sleep_s = (args.load_ms if rank in slow else args.base_load_ms) / 1000.0
    matmuls = args.extra_matmuls if rank in slow else 0
    big = torch.randn(args.matmul_size, args.matmul_size, device=device) if matmuls else None
    torch.manual_seed(rank)
    model = torch.nn.Sequential(
        torch.nn.Linear(args.width, args.width), torch.nn.ReLU(), torch.nn.Linear(args.width, 1)
    ).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    deadline = time.monotonic() + args.max_seconds
    ready = False
    while time.monotonic() < deadline:
        x, y = load_batch(args.width, sleep_s, device)
        if big is not None:
            extra_compute(matmuls, big)
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        for p in model.parameters():
            dist.all_reduce(p.grad)
        opt.step()
        loss.item()
        if not ready:
            os.write(1, f"READY {os.getpid()}\n".encode())  # one write: ranks may share the pipe
            ready = True
    dist.destroy_process_group()
    print("DONE", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
