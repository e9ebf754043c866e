"""A small ResNet-style conv net trained under CPU bf16 autocast with the GradScaler pattern
(``scale(loss).backward()``, ``scaler.step(opt)``, ``scaler.update()``) and an LR scheduler."""

from __future__ import annotations

import sys

import torch
from _job import Pacer, parser, seed_everything
from torch import nn


class BasicBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.down = (
            nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))
            if stride != 1 or cin != cout
            else nn.Identity()
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return torch.relu(out + self.down(x))


class TinyResNet(nn.Module):
    def __init__(self, classes: int = 10) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 16, 3, 1, 1, bias=False), nn.BatchNorm2d(16), nn.ReLU())
        self.layers = nn.Sequential(BasicBlock(16, 16, 1), BasicBlock(16, 32, 2), BasicBlock(32, 32, 1))
        self.fc = nn.Linear(32, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.layers(self.stem(x))
        return self.fc(torch.flatten(nn.functional.adaptive_avg_pool2d(x, 1), 1))


def main() -> int:
    p = parser(__doc__ or "")
    p.add_argument("--batch", type=int, default=16)
    args = p.parse_args()
    seed_everything(0, args.threads)
    model = TinyResNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-4)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.05, total_steps=args.max_steps)
    scaler = torch.amp.GradScaler("cpu")
    gen = torch.Generator().manual_seed(1)
    images = torch.randn(8, args.batch, 3, 16, 16, generator=gen)
    labels = torch.randint(0, 10, (8, args.batch), generator=gen)
    pacer = Pacer(args)

    def step() -> torch.Tensor:
        i = pacer.steps % images.shape[0]
        with torch.autocast(device_type="cpu", dtype=torch.bfloat16):
            loss = nn.functional.cross_entropy(model(images[i]), labels[i])
        opt.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        sched.step()
        return loss

    return pacer.run(step)


if __name__ == "__main__":
    sys.exit(main())
