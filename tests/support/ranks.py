"""The environment of one rank of a job that a test starts by hand, as torchrun would set it."""

from __future__ import annotations


def rank_env(rank: int, world_size: int, port: str, **more: str) -> dict[str, str]:
    """``RANK``, ``WORLD_SIZE`` and the rendezvous on this host's ``port``, then ``more``."""
    return {"RANK": str(rank), "WORLD_SIZE": str(world_size), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, **more}
