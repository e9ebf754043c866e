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


def main() -> int:
    p = parser(__doc__ or "")
    p.add_argument("--zero", type=int, choices=[0, 1, 2], default=2)
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--local_rank", type=int, default=0)  # DeepSpeed's launcher passes it
    args = p.parse_args()
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo")
    rank = dist.get_rank()
    seed_everything(0, args.threads)
    model = mlp(args.width)
    config = {
        "train_micro_batch_size_per_gpu": 32,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": args.zero},
        "steps_per_print": 1 << 30,
        "wall_clock_breakdown": False,
    }
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    engine, _opt, _loader, _sched = deepspeed.initialize(model=model, optimizer=opt, config=config)
    gen = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(32, args.width, generator=gen)
    y = torch.randn(32, 1, generator=gen)
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
