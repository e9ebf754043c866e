"""What every framework test program shares: its command line, its output lines, its pacing and
its training loop (`Pacer.train`).

A program prints ``READY <pid>`` (one write) once its first optimizer step is done, then one
``LOSS <tag> <value>`` line per loss it computes (``repr`` of the float: bit-exact), and
``DONE <steps>`` when it ends. It stops after ``--stop-after`` steps, when ``--stop-file``
exists, or after ``--max-seconds``; learning-rate schedules are sized by ``--max-steps`` only,
so a run stopped early by the file computes the same losses as one stopped by the count.
"""

from __future__ import annotations

import argparse
import os
import random
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


def parser(description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--max-steps", type=int, default=100_000, help="schedule length (never reached)")
    p.add_argument("--stop-after", type=int, default=0, help="stop after this many optimizer steps")
    p.add_argument("--stop-file", default="", help="stop at the next step once this file exists")
    p.add_argument("--max-seconds", type=float, default=120.0)
    p.add_argument("--step-sleep", type=float, default=0.0, help="extra seconds after each step")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    return p


def emit(line: str) -> None:
    """One write per line: ranks of a torchrun job share the pipe."""
    os.write(1, (line + "\n").encode())


def seed_everything(seed: int, threads: int) -> None:
    import torch

    random.seed(seed)
    torch.manual_seed(seed)
    torch.set_num_threads(threads)


def mlp(width: int) -> torch.nn.Sequential:
    """The small MLP several programs train: width -> 2*width -> width -> 1, ReLUs between."""
    import torch

    return torch.nn.Sequential(
        torch.nn.Linear(width, width * 2),
        torch.nn.ReLU(),
        torch.nn.Linear(width * 2, width),
        torch.nn.ReLU(),
        torch.nn.Linear(width, 1),
    )


def mse_step(
    model: torch.nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor
) -> Callable[[], torch.Tensor]:
    """The plain training iteration several programs run: MSE loss of ``model(x)`` against
    ``y``, ``zero_grad``, ``backward``, the optimizer's step; it returns the loss."""
    import torch

    def step() -> torch.Tensor:
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        return loss

    return step


class Pacer:
    """Called after each optimizer step: READY once, the pause, and whether to stop."""

    def __init__(self, args: argparse.Namespace, rank: int = 0) -> None:
        self.args = args
        self.rank = rank
        self.steps = 0
        self.deadline = time.monotonic() + args.max_seconds
        self._ready = False

    def loss(self, tag: object, value: float) -> None:
        emit(f"LOSS {tag} {value!r}")

    def step_done(self) -> bool:
        """Count one optimizer step; return True when the program should stop."""
        self.steps += 1
        if not self._ready:
            emit(f"READY {os.getpid()}")
            self._ready = True
        if self.args.step_sleep:
            time.sleep(self.args.step_sleep)
        return self.should_stop()

    def should_stop(self) -> bool:
        a = self.args
        if a.stop_after and self.steps >= a.stop_after:
            return True
        if a.stop_file and os.path.exists(a.stop_file):
            return True
        return time.monotonic() >= self.deadline

    def done(self) -> None:
        emit(f"DONE {self.steps}")

    def train(self, step: Callable[[], torch.Tensor], ranks: bool = False) -> None:
        """The training loop: ``step()`` runs one iteration and returns its loss; after each,
        its LOSS line and the pacing, until the program should stop. With ``ranks`` (a job of
        several ranks, its process group up) the tag names the rank, and all ranks stop at the
        same step: the first where any of them would."""
        while True:
            loss = step()
            if ranks:
                self.loss(f"r{self.rank}:{self.steps + 1}", loss.item())
                if self._stop_together(self.step_done()):
                    return
            else:
                self.loss(self.steps + 1, loss.item())
                if self.step_done():
                    return

    def run(self, step: Callable[[], torch.Tensor]) -> int:
        """A one-process program's whole loop: :meth:`train`, then DONE; its exit status."""
        self.train(step)
        self.done()
        return 0

    @staticmethod
    def _stop_together(stop: bool) -> bool:
        import torch
        import torch.distributed as dist

        flag = torch.tensor([1.0 if stop else 0.0])
        dist.all_reduce(flag)
        return flag.item() > 0
