"""A training loop fed by a DataLoader whose workers are started with "spawn".

Prints ``READY <pid>`` after its first optimizer step, then ``WORKERS <pid> <pid>...`` naming
its live DataLoader workers, then trains until --seconds. --persistent keeps the workers for
the whole run; without it, each epoch (a few batches) starts new workers that exit at its end.
With --dist it joins a gloo group from RANK/WORLD_SIZE (torchrun).

With DATALOADER_IMPORT_GATE=DIR in its environment, each spawned worker, as it imports this
file (as ``__mp_main__``, before it knows it is a worker), creates ``DIR/waiting-<pid>`` and
waits there until ``DIR/open`` exists: a slow import on a loaded machine, made deterministic.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
from torch.utils.data import DataLoader, TensorDataset

_GATE = os.environ.get("DATALOADER_IMPORT_GATE")
if __name__ == "__mp_main__" and _GATE:
    open(os.path.join(_GATE, f"waiting-{os.getpid()}"), "w").close()
    while not os.path.exists(os.path.join(_GATE, "open")):
        time.sleep(0.05)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--persistent", action="store_true")
    parser.add_argument("--dist", action="store_true")
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--step-sleep", type=float, default=0.01)
    args = parser.parse_args()
    if args.dist:
        import torch.distributed as dist

        dist.init_process_group("gloo")
    data = TensorDataset(torch.randn(64, 8), torch.randn(64, 1))
    loader = DataLoader(
        data,
        batch_size=8,
        num_workers=args.workers,
        multiprocessing_context="spawn",
        persistent_workers=args.persistent,
    )
    model = torch.nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    deadline = time.monotonic() + args.seconds
    said = False
    while time.monotonic() < deadline:
        for x, y in loader:
            loss = torch.nn.functional.mse_loss(model(x), y)
            opt.zero_grad()
            loss.backward()
            if args.dist:
                import torch.distributed as dist

                for p in model.parameters():
                    dist.all_reduce(p.grad)
            opt.step()
            if not said:
                import multiprocessing

                workers = " ".join(str(c.pid) for c in multiprocessing.active_children())
                os.write(1, f"READY {os.getpid()}\nWORKERS {workers}\n".encode())
                said = True
            time.sleep(args.step_sleep)
            if time.monotonic() >= deadline:
                break
    return 0


if __name__ == "__main__":
    sys.exit(main())
