"""DDP or FSDP2 (``torch.distributed.fsdp.fully_shard``) on gloo, launched by torchrun.

Each rank prints ``LOSS r<rank>:<step> <value>``. The ranks agree on when to stop (an
all-reduce of the stop flag), so a stop file seen by one rank first cannot hang the other."""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
from _job import Pacer, mlp, mse_step, parser, seed_everything


def main() -> int:
    p = parser(__doc__ or "")
    p.add_argument("--mode", choices=["ddp", "fsdp2"], required=True)
    p.add_argument("--width", type=int, default=64)
    args = p.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    seed_everything(0, args.threads)
    model = mlp(args.width)
    if args.mode == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        model = DistributedDataParallel(model)
    else:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        for layer in model:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(32, args.width, generator=gen)
    y = torch.randn(32, 1, generator=gen)
    pacer = Pacer(args, rank)
    pacer.train(mse_step(model, opt, x, y), ranks=True)
    pacer.done()
    dist.barrier()  # both ranks are done with their collectives before gloo is torn down
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
