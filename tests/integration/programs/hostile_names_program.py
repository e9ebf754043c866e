"""A training loop whose text is hostile: the function that runs its steps is named with a
newline, a right-to-left override, markup and an escape sequence (as a node's frames could be),
and it trains inside a ``dynprof.phase`` named the same way. Its job id and host come from the
environment (``DYNPROF_JOB_ID``, ``DYNPROF_HOST``) as the test sets them.

Prints ``READY <pid>`` once inside the phase, after its first optimizer step; trains for at most
``--seconds``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

import dynprof

FUNCTION = (
    'load_batch\nrank 0 is fine\u202e<script>window.__pwned=1</script><img src=x onerror="window.__pwned=2">\x1b[2J'
)
PHASE = "eval\nrank 0 is fine\u202e<b>bold</b>\x1b[2J"


def train(seconds: float) -> None:
    model = torch.nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(4, 8)
    deadline = time.monotonic() + seconds
    ready = False
    while time.monotonic() < deadline:
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        if not ready:
            os.write(1, f"READY {os.getpid()}\n".encode())
            ready = True
        time.sleep(0.01)


train.__code__ = train.__code__.replace(co_name=FUNCTION, co_qualname=FUNCTION)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seconds", type=float, default=120.0)
    args = parser.parse_args()
    with dynprof.phase(PHASE):
        train(args.seconds)
    return 0


if __name__ == "__main__":
    sys.exit(main())
