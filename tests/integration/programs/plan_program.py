"""A small training loop whose model has repeated blocks, for `dynprof memory plan`'s tests.

Prints ``READY <pid>`` after its first optimizer step and trains until --max-seconds. Each
block is Linear(W, 4W) -> GELU -> Linear(4W, W) with a residual; the blocks sit in a ModuleList
between an input Linear and a head. With --ddp, one rank of a gloo job (RANK, WORLD_SIZE,
MASTER_ADDR and MASTER_PORT from the environment, as torchrun sets them), the model wrapped in
DistributedDataParallel, each rank on its own data of the same shapes.
"""

from __future__ import annotations

import argparse
import os
import time

import torch


class Block(torch.nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.up = torch.nn.Linear(width, 4 * width)
        self.act = torch.nn.GELU()
        self.down = torch.nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(self.act(self.up(x)))


class Model(torch.nn.Module):
    def __init__(self, width: int, depth: int) -> None:
        super().__init__()
        self.embed = torch.nn.Linear(width, width)
        self.blocks = torch.nn.ModuleList([Block(width) for _ in range(depth)])
        self.head = torch.nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--max-seconds", type=float, default=120.0)
    parser.add_argument("--width", type=int, default=32)
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--step-sleep", type=float, default=0.01)
    parser.add_argument(
        "--probe-file",
        default="",
        help="once this file exists, print the hooks left on the model and autograd's saved-tensor hooks",
    )
    parser.add_argument(
        "--compile",
        choices=("none", "model", "blocks"),
        default="none",
        help="compile in place: the whole model (model.compile()) or each block (the regional recipe)",
    )
    parser.add_argument("--compile-backend", default="eager")
    parser.add_argument("--device", default="cpu", help="cpu, cuda (the model and its data on that device)")
    parser.add_argument("--ddp", action="store_true", help="one rank of a gloo job, the model in DDP")
    parser.add_argument("--steps", type=int, default=0, help="stop training after this many steps (0: --max-seconds)")
    parser.add_argument("--losses", action="store_true", help="print each step's loss, exactly (LOSS i float.hex)")
    parser.add_argument(
        "--eval-when-measured",
        action="store_true",
        help="stop training as soon as a measurement's hooks are on the blocks, and evaluate (forwards "
        "without grad) until --max-seconds: the measured step never comes",
    )
    parser.add_argument(
        "--report-wrapped",
        action="store_true",
        help="after each step, print how many blocks run a forward put on the instance (WRAPPED i n)",
    )
    args = parser.parse_args()
    torch.manual_seed(0)
    if args.losses:  # losses compared bit for bit between runs
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
    model: torch.nn.Module = Model(args.width, args.depth).to(args.device)
    rank = 0
    if args.ddp:
        import torch.distributed as dist
        from torch.nn.parallel import DistributedDataParallel

        torch.set_num_threads(1)  # ranks on a small CPU machine: no intra-op threads fighting
        dist.init_process_group("gloo")
        rank = dist.get_rank()
        model = DistributedDataParallel(model)
        torch.manual_seed(100 + rank)  # each rank's own data, of the same shapes
    if args.compile == "model":
        model.compile(backend=args.compile_backend)
    elif args.compile == "blocks":
        for block in blocks_of(model):
            block.compile(backend=args.compile_backend)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    x = torch.randn(args.batch, args.width, device=args.device)
    y = torch.randn(args.batch, 1, device=args.device)
    deadline = time.monotonic() + args.max_seconds
    ready = False
    step = 0
    while time.monotonic() < deadline:
        if args.steps and step >= args.steps:
            os.write(1, b"DONE\n")
            break
        if args.eval_when_measured and any(b._forward_pre_hooks for b in blocks_of(model)):
            evaluate(model, x, deadline)
            break
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        step += 1
        if args.losses:
            os.write(1, f"LOSS {step} {loss.item().hex()}\n".encode())
        if args.report_wrapped:
            n = sum(1 for b in blocks_of(model) if "forward" in b.__dict__)
            os.write(1, f"WRAPPED {step} {n}\n".encode())
        if not ready:
            os.write(1, f"READY {os.getpid()}\n".encode())
            ready = True
        if args.probe_file and os.path.exists(args.probe_file):
            os.write(1, f"HOOKS {hooks_state(model)}\n".encode())
            args.probe_file = ""
        time.sleep(args.step_sleep)
    return 0


def blocks_of(model: torch.nn.Module) -> torch.nn.ModuleList:
    inner = model.module if isinstance(model, torch.nn.parallel.DistributedDataParallel) else model
    blocks = inner.blocks
    assert isinstance(blocks, torch.nn.ModuleList)
    return blocks


def hooks_state(model: torch.nn.Module) -> str:
    """What a measurement could have left: forward hooks, saved-tensor hooks, a dispatch mode."""
    from torch.utils._python_dispatch import _get_current_dispatch_mode

    hooks = sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())
    saved = torch._C._autograd._top_saved_tensors_default_hooks(False)
    mode = _get_current_dispatch_mode()
    return f"forward={hooks} saved_tensors={saved is not None} grad={torch.is_grad_enabled()} mode={mode is not None}"


def evaluate(model: torch.nn.Module, x: torch.Tensor, deadline: float) -> None:
    """Forwards without grad until ``deadline``, as an evaluation after the job's last optimizer
    step; after the 50th, what is left on the model (EVAL ...)."""
    n = 0
    with torch.no_grad():
        while time.monotonic() < deadline:
            model(x)
            n += 1
            if n == 50:
                os.write(1, f"EVAL {hooks_state(model)}\n".encode())
            time.sleep(0.01)


if __name__ == "__main__":
    raise SystemExit(main())
