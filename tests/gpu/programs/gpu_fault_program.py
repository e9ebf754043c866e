"""A CUDA training job of ``WORLD_SIZE`` ranks sharing one GPU, whose rank ``--fault-rank`` does
one thing wrong from step ``--at-step`` on, for the GPU fault suite (tests/gpu/test_gpu_faults.py).

The gradients are copied to the CPU and all-reduced with gloo (two ranks cannot share one GPU
in NCCL), so the ranks that do not fault wait for the faulty one in ``all_reduce``.

Faults that block the rank behind a GPU kernel that spins for minutes (``torch.cuda._sleep``):
every idiom of scripts/enumerate_gpu_waits.py's ``IDIOMS`` (``--fault NAME``: ``item``, ``cpu``,
``nonzero``, ``launch-queue-full``, ...), the table the enumeration checks against torch's own
sync debug mode; an idiom that ``needs`` NCCL runs in the rank's own one-member NCCL group (two
ranks cannot share a GPU in one NCCL communicator; one each can), waited for with
``TORCH_NCCL_BLOCKING_WAIT=1`` set, so the host waits inside PyTorch's NCCL work.
Stragglers, every step: ``gpu-compute`` (extra matmuls), ``host-launch`` (thousands of tiny
kernels), ``h2d-input`` (a large pageable batch copied in), ``data-loading`` (a slow loader),
``input-pipeline`` (Python work outside operators), ``launch-and-data`` (tiny kernels and a
slower loader); ``noise`` (every rank up to 1 ms slower a step, at random) is an even job.
Busy phases that are not hangs (on every rank): ``checkpoint`` (CUDA tensors saved for
``--busy-seconds``), ``eval`` (an evaluation loop of that length), ``compile`` (the first step of
a deeper model under ``torch.compile(mode="max-autotune-no-cudagraphs")``, Inductor's caches off:
tens of seconds of compiling and autotuning on the GPU; READY is said before it begins).
``--fault-rank -1``: every rank does the fault (every rank blocked behind its own endless kernel). ``none``: an even job. The GPU's side of a hang (the step's CUDA event):
``step-behind-kernel`` (the endless kernel is queued before the optimizer step, whose work then
never finishes, and ``.item()`` waits for it), ``host-sleep`` (the step's work finished and
synchronized, then the rank sleeps on the host).

Each rank prints ``READY <pid>`` when it is where the test wants it: at the fault (blocking
faults), or after ``--at-step`` steady steps (the others)."""

from __future__ import annotations

import argparse
import os
import random
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # the checkout: its scripts/ holds the idioms
from scripts.enumerate_gpu_waits import IDIOMS, Context, idiom

BLOCKING = tuple(i.name for i in IDIOMS)
GPU_SIDE = ("step-behind-kernel", "host-sleep")
SPIN_CYCLES = int(4e12)  # torch.cuda._sleep: tens of minutes on any GPU of today


def ready() -> None:
    print(f"READY {os.getpid()}", flush=True)


def block_behind_kernel(fault: str, model: torch.nn.Module, device: torch.device, own: object = None) -> None:
    """Queue an endless kernel, then wait for the GPU in the way the idiom ``fault`` does
    (``own``: the rank's own NCCL group, for an idiom that needs one)."""
    way = idiom(fault)
    assert way is not None, fault
    c = Context(device=device, probe=torch.ones(4, device=device), model=model, opt=None, own=own)
    c.opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    torch.cuda._sleep(SPIN_CYCLES)
    ready()
    way.run(c)


def stuck_after_step(fault: str, opt: torch.optim.Optimizer, device: torch.device, seconds: float) -> None:
    """Step, then stop: behind an endless kernel queued before the step (``.item()`` waits for
    it), or on the host after the step's work finished (``time.sleep``)."""
    probe = torch.ones(4, device=device)
    if fault == "step-behind-kernel":
        torch.cuda._sleep(SPIN_CYCLES)
        opt.step()
        ready()
        probe.sum().item()
    else:
        opt.step()
        torch.cuda.synchronize(device)
        ready()
        time.sleep(seconds)


def augment(width: int) -> float:
    """Python work on the host, outside any operator (an input pipeline's augmentation)."""
    total = 0.0
    for i in range(600_000):  # tens of ms: well over the straggler rule's noise threshold
        total += (i % width) * 1e-9
    return total


def reduce_gradients(model: torch.nn.Module) -> None:
    for p in model.parameters():
        if p.grad is None:
            continue
        g = p.grad.detach().cpu()
        dist.all_reduce(g)
        p.grad.copy_(g.to(p.grad.device))


class SlowData(torch.utils.data.Dataset):  # type: ignore[type-arg]
    def __init__(self, n: int, width: int, delay_s: float) -> None:
        self.n, self.width, self.delay_s = n, width, delay_s

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        if self.delay_s:
            time.sleep(self.delay_s)
        return torch.full((self.width,), float(i % 7))


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--fault", default="none")
    parser.add_argument("--fault-rank", type=int, default=1)
    parser.add_argument("--at-step", type=int, default=20)
    parser.add_argument("--busy-seconds", type=float, default=30.0)
    parser.add_argument("--max-seconds", type=float, default=600.0)
    parser.add_argument("--width", type=int, default=1024)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    faulty = args.fault_rank < 0 or rank == args.fault_rank
    own = None
    way = idiom(args.fault)
    if way is not None and way.needs == "nccl":  # every rank makes every group, in order; each uses its own
        for r in range(dist.get_world_size()):
            group = dist.new_group([r], backend="nccl")
            if r == rank:
                own = group
        warm = torch.ones(4, device=device)
        dist.all_reduce(warm, group=own)  # the communicator is made now, not behind the kernel
        torch.cuda.synchronize(device)
    w = args.width
    layers: list[torch.nn.Module] = [torch.nn.Linear(w, w), torch.nn.ReLU(), torch.nn.Linear(w, w)]
    if args.fault == "compile":  # a deeper model, so that compiling and autotuning it takes a while
        for _ in range(12):
            layers += [torch.nn.LayerNorm(w), torch.nn.Linear(w, 2 * w), torch.nn.GELU(), torch.nn.Linear(2 * w, w)]
    model = torch.nn.Sequential(*layers).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    step_fn = model
    if args.fault == "compile":
        step_fn = torch.compile(model, mode="max-autotune-no-cudagraphs")  # type: ignore[assignment]
        ready()  # before the first step: the warm-up is what the watch looks at
    delay = 0.03 if (args.fault == "data-loading" and faulty) else 0.0
    delay = 0.01 if (args.fault == "launch-and-data" and faulty) else delay
    jitter = random.Random(rank)
    loader = torch.utils.data.DataLoader(SlowData(1 << 30, w, delay), batch_size=1, num_workers=0)
    batches = iter(loader)
    # 256 MiB, pageable, copied in at every step. (It read `64 << 20 // 4` before: `//` binds
    # tighter than `<<`, so that was 2048 floats, 8 KiB, and no straggler at all.)
    big_host = torch.randn((256 << 20) // 4) if (args.fault == "h2d-input" and faulty) else None
    heavy = torch.randn(2048, 2048, device=device) if args.fault == "gpu-compute" else None
    tiny = torch.zeros(8, device=device)
    x = torch.randn(64, w, device=device)
    started = time.monotonic()
    step = 0
    while time.monotonic() - started < args.max_seconds:
        batch = next(batches).to(device)
        inp = x + batch.mean()
        if big_host is not None:
            inp = inp + big_host.to(device).mean()
        if heavy is not None and faulty and step >= args.at_step // 2:
            for _ in range(60):
                heavy = torch.mm(heavy, heavy).clamp_(-1, 1)
        if args.fault in ("host-launch", "launch-and-data") and faulty:
            for _ in range(3000):
                tiny.add_(1.0)
        if args.fault == "input-pipeline" and faulty:
            inp = inp + augment(w)
        if args.fault == "noise":  # every rank: up to 1 ms more or less a step, at random
            time.sleep(jitter.uniform(0.0, 0.001))
        opt.zero_grad(set_to_none=True)
        step_fn(inp).square().mean().backward()
        if step == args.at_step and args.fault in GPU_SIDE:
            if faulty:
                stuck_after_step(args.fault, opt, device, args.max_seconds)  # says READY itself
            else:
                ready()
        elif step == args.at_step:
            if args.fault in BLOCKING:
                if faulty:
                    block_behind_kernel(args.fault, model, device, own)
                else:
                    ready()
            elif args.fault == "checkpoint":
                ready()
                path = f"/tmp/dynprof-gpu-ckpt-{os.getpid()}.pt"
                until = time.monotonic() + args.busy_seconds
                while time.monotonic() < until:
                    torch.save({k: v for k, v in model.state_dict().items()}, path)
                os.unlink(path)
            elif args.fault == "eval":
                ready()
                until = time.monotonic() + args.busy_seconds
                with torch.no_grad():
                    while time.monotonic() < until:
                        model(x).sum().item()
            elif args.fault != "compile":
                ready()
        reduce_gradients(model)
        opt.step()
        step += 1
    dist.destroy_process_group()
    print("DONE", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
