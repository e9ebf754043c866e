"""Lightning ``Trainer.fit`` on CPU: a small MLP regressor, synthetic data, an LR scheduler.

With ``--blocks N`` the regressor's middle is N residual blocks (Linear W -> 4W, GELU, Linear
4W -> W) in a ``ModuleList``: the repeated blocks a memory plan checkpoints."""

from __future__ import annotations

import sys
from typing import Any

import torch
from _job import Pacer, parser, seed_everything


def main() -> int:
    p = parser(__doc__ or "")
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--accum", type=int, default=1, help="accumulate_grad_batches")
    p.add_argument("--blocks", type=int, default=0, help="residual blocks between the two layers (0: none)")
    p.add_argument("--batch", type=int, default=16)
    args = p.parse_args()
    seed_everything(0, args.threads)
    try:
        import lightning as L
    except ImportError:
        import pytorch_lightning as L  # type: ignore[no-redef]

    pacer = Pacer(args)

    class Block(torch.nn.Module):
        def __init__(self, width: int) -> None:
            super().__init__()
            self.up = torch.nn.Linear(width, 4 * width)
            self.act = torch.nn.GELU()
            self.down = torch.nn.Linear(4 * width, width)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + self.down(self.act(self.up(x)))

    class Regressor(L.LightningModule):  # type: ignore[misc]
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Sequential(
                torch.nn.Linear(args.width, args.width * 2), torch.nn.ReLU(), torch.nn.Linear(args.width * 2, 1)
            )
            self.blocks = torch.nn.ModuleList([Block(args.width) for _ in range(args.blocks)])

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for block in self.blocks:
                x = block(x)
            out: torch.Tensor = self.net(x)
            return out

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            loss = torch.nn.functional.mse_loss(self(x), y)
            pacer.loss(f"{self.global_step + 1}:{batch_idx}", loss.item())
            return loss

        def configure_optimizers(self) -> Any:
            opt = torch.optim.AdamW(self.parameters(), lr=1e-3)
            sched = torch.optim.lr_scheduler.StepLR(opt, step_size=100, gamma=0.5)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    class Paced(L.Callback):  # type: ignore[misc]
        def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            if (batch_idx + 1) % args.accum == 0 and pacer.step_done():
                trainer.should_stop = True

    gen = torch.Generator().manual_seed(1)
    x = torch.randn(512, args.width, generator=gen)
    y = torch.randn(512, 1, generator=gen)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=args.batch, shuffle=True)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=args.max_steps,
        accumulate_grad_batches=args.accum,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        deterministic=True,
        callbacks=[Paced()],
    )
    trainer.fit(Regressor(), loader)
    pacer.done()
    return 0


if __name__ == "__main__":
    sys.exit(main())
