"""What the memory plan's unit tests share: the small models they measure (blocks in a
ModuleList, a step of them), and random chains of candidates with the brute force over them."""

from __future__ import annotations

import itertools
from typing import Any

import torch

from collectors.memory.plan.predict import Candidates, peak_with


class Block(torch.nn.Module):
    def __init__(self, d: int = 4, h: int = 8) -> None:
        super().__init__()
        self.a = torch.nn.Linear(d, h)
        self.b = torch.nn.Linear(h, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x)))


class Stack(torch.nn.Module):
    """Blocks in a ModuleList, run in ``order`` (each index as often as it appears)."""

    def __init__(self, n: int = 3, order: list[int] | None = None) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList([Block() for _ in range(n)])
        self.head = torch.nn.Linear(4, 2)
        self.order = order if order is not None else list(range(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i in self.order:
            x = self.layers[i](x)
        return self.head(x)


def step_of(model: torch.nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor) -> Any:
    def step() -> None:
        model(x).square().sum().backward()
        opt.step()
        opt.zero_grad()

    return step


def names(blocks: list[tuple[str, Any]]) -> list[str]:
    return [name for name, _ in blocks]


def chain(rng, n, kept=False, shared=False):
    """A random measurement-like problem of n blocks in a chain: segment 0 before the blocks,
    then each block's forward and the segment after it, the loss, then each block's backward
    in reverse; block j is held from its forward end to its backward start. With ``kept``,
    about half the blocks' checkpoints keep an input that died at their forward end or in the
    next segment; with ``shared``, some of those inputs are one storage of two blocks."""
    fe = [2 + 2 * j for j in range(n)]
    mid = 2 * n + 1
    bs = [mid + 1 + (n - 1 - j) for j in range(n)]
    segments = mid + n + 2
    timeline = [(rng.randint(50, 400), rng.choice([0, rng.randint(50, 400)])) for _ in range(segments)]
    freeable = [rng.randint(0, 60) for _ in range(n)]
    casts = [rng.randint(0, f) for f in freeable]
    inputs = [[] for _ in range(n)]
    if kept:
        for j in range(n):
            if rng.random() < 0.5 and freeable[j] > casts[j]:
                inputs[j].append((fe[j] + rng.randint(0, 1), rng.randint(1, freeable[j] - casts[j]), j))
        if shared:
            for j in range(1, n):
                if inputs[j - 1] and rng.random() < 0.5:
                    inputs[j].append(inputs[j - 1][0])
    return Candidates(
        index=list(range(n)),
        freeable=freeable,
        casts=casts,
        seconds=[round(rng.uniform(0.01, 3.0), 3) for _ in range(n)],
        forward_end=fe,
        backward_start=bs,
        recompute_peak=[rng.randint(100, 450) for _ in range(n)],
        late=[[] for _ in range(n)],
        timeline=timeline,
        untracked=rng.choice([0, 5]),
        static=rng.randint(0, 60),
        kept=inputs,
    )


def brute_force(c, target):
    """Every subset's cost whose predicted peak is at most ``target``, by peak_with itself."""
    out = []
    n = len(c.freeable)
    for r in range(n + 1):
        for subset in itertools.combinations(range(n), r):
            if peak_with(c, subset) <= target:
                out.append(sum(c.seconds[i] for i in subset))
    return sorted(out)
