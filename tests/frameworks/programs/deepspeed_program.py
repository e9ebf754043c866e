"""DeepSpeed's engine (ZeRO stage 1 or 2, its own AdamW wrapped) on gloo and the CPU, launched
by torchrun (or DeepSpeed's launcher): ``deepspeed.initialize``, then ``engine.backward`` and
``engine.step`` each step.

Each rank prints ``LOSS r<rank>:<step> <value>``. The ranks agree on when to stop (an
all-reduce of the stop flag), so a stop file seen by one rank first cannot hang the other."""

from __future__ import annotations

import os
import sys

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import torch
import torch.distributed as dist
from _job import Pacer, mlp, parser, seed_everything


class Block(torch.nn.Module):
    """x + W2 gelu(W1 x): activations four times the width, the blocks a plan recomputes."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.up = torch.nn.Linear(width, 4 * width)
        self.down = torch.nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.nn.functional.gelu(self.up(x)))


class Residual(torch.nn.Module):
    def __init__(self, width: int, blocks: int) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(Block(width) for _ in range(blocks))
        self.head = torch.nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def residual(width: int, blocks: int) -> torch.nn.Module:
    return Residual(width, blocks)


def main() -> int:
    p = parser(__doc__ or "")
    p.add_argument("--zero", type=int, choices=[0, 1, 2], default=2)
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--blocks", type=int, default=0, help="a stack of this many residual blocks, not the MLP")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--local_rank", type=int, default=0)  # DeepSpeed's launcher passes it
    args = p.parse_args()
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo")
    rank = dist.get_rank()
    seed_everything(0, args.threads)
    model = residual(args.width, args.blocks) if args.blocks else mlp(args.width)
    config = {
        "train_micro_batch_size_per_gpu": args.batch,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": args.zero},
        "steps_per_print": 1 << 30,
        "wall_clock_breakdown": False,
    }
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    engine, _opt, _loader, _sched = deepspeed.initialize(model=model, optimizer=opt, config=config)
    gen = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(args.batch, args.width, generator=gen)
    y = torch.randn(args.batch, 1, generator=gen)
    pacer = Pacer(args, rank)

    def step() -> torch.Tensor:
        loss = torch.nn.functional.mse_loss(engine(x), y)
        engine.backward(loss)
        engine.step()
        return loss

    pacer.train(step, ranks=True)
    pacer.done()
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
