"""What the programs that follow their own dynprof trace share; they import it from this folder.

``trace_state()`` is the state of the agent's trace controller in this process (``idle`` without
an agent); ``mse_step`` one plain training step; ``after_step`` the ``READY <pid>`` line, in one
write, after the first.
"""

from __future__ import annotations

import os

import torch

import dynprof.agent


def trace_state() -> str:
    agent = dynprof.agent.get()
    controller = agent.extensions.get("dynprof.agent._ext_trace") if agent is not None else None
    return str(getattr(controller, "state", "idle"))


def mse_step(model: torch.nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor) -> None:
    loss = torch.nn.functional.mse_loss(model(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()


def after_step(step: int) -> None:
    if step == 1:
        os.write(1, f"READY {os.getpid()}\n".encode())
