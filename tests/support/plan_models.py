"""Small models with repeated blocks, and checkpointing them by name, for the memory plan's tests.

``Block`` is Linear(W, 4W) -> GELU -> Linear(4W, W) with a residual (with ``layer_norm``, a
LayerNorm first, as a transformer's MLP); ``Model`` sits ``depth`` of them in a ModuleList
between an input Linear and a head. ``checkpoint_modules`` wraps the named modules the way the
plan's recipe prints it (torch.utils.checkpoint, non-reentrant) and returns what
``restore_forwards`` undoes; ``checkpointed`` does both around a block of code. ``adamw_step``
is a training step of a model under AdamW, taken once so that the optimizer state exists.
``live_peak`` is the live tensor bytes' peak of a step (every tensor alive counted, as the
measurement counts), after a first step that warms it; ``real_peak`` that of a step with
modules checkpointed.
"""

from __future__ import annotations

import gc
from collections.abc import Callable, Collection, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn.functional as F
import torch.utils.checkpoint as cp

from collectors.memory.plan.blocks import live_tensors
from collectors.memory.plan.meter import LiveTensorBytes


class Block(torch.nn.Module):
    def __init__(self, width: int, layer_norm: bool = False) -> None:
        super().__init__()
        self.layer_norm = layer_norm
        if layer_norm:
            self.ln = torch.nn.LayerNorm(width)
        self.up = torch.nn.Linear(width, 4 * width)
        self.down = torch.nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # no local name for the LayerNorm's output: a checkpoint's recompute frees it as soon as
        # ``up`` has run, as a one-line forward does
        if self.layer_norm:
            return x + self.down(F.gelu(self.up(self.ln(x))))
        return x + self.down(F.gelu(self.up(x)))


class Model(torch.nn.Module):
    def __init__(self, width: int = 16, depth: int = 4, layer_norm: bool = False) -> None:
        super().__init__()
        self.embed = torch.nn.Linear(width, width)
        self.blocks = torch.nn.ModuleList([Block(width, layer_norm) for _ in range(depth)])
        self.head = torch.nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def checkpoint_modules(model: torch.nn.Module, names: Collection[str]) -> list[tuple[torch.nn.Module, Any]]:
    """Wrap each module of ``model`` named in ``names`` in a non-reentrant checkpoint; the
    modules and their own forwards, for :func:`restore_forwards`."""
    restore = []
    for name, mod in model.named_modules():
        if name in names:
            fwd = mod.forward
            restore.append((mod, fwd))
            mod.forward = lambda *a, _f=fwd, **k: cp.checkpoint(_f, *a, use_reentrant=False, **k)
    return restore


def restore_forwards(restore: list[tuple[torch.nn.Module, Any]]) -> None:
    for mod, fwd in restore:
        mod.forward = fwd


@contextmanager
def checkpointed(model: torch.nn.Module, names: Collection[str]) -> Iterator[None]:
    """``names`` checkpointed inside the block, the wrapping undone after."""
    restore = checkpoint_modules(model, names)
    try:
        yield
    finally:
        restore_forwards(restore)


def live_peak(step: Callable[[], None]) -> int:
    """The live tensor bytes' peak of ``step``, run once before it is measured."""
    step()
    gc.collect()
    with LiveTensorBytes(live_tensors()) as live:  # every tensor alive, as the measurement counts
        step()
    live.close()
    return live.peak


def real_peak(model: torch.nn.Module, step: Callable[[], None], names: Collection[str]) -> int:
    """The live-bytes peak of a step with ``names`` checkpointed as the plan's recipe says, the
    wrapping undone after."""
    with checkpointed(model, names):
        return live_peak(step)


def adamw_step(model: torch.nn.Module, loss: Callable[[], torch.Tensor], lr: float) -> tuple[Any, Callable[[], None]]:
    """(optimizer, step): ``loss()``'s backward and an AdamW step (foreach, as on CUDA), the
    gradients set to None after; one step already taken, so that the optimizer state exists."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr, foreach=True)

    def step() -> None:
        loss().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()  # the optimizer state exists
    return opt, step
