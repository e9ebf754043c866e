"""Who this process is within its job: rank, local rank, world size, job id, host.

Read from the launcher's environment: torchrun / torch.distributed.elastic, Slurm, Open MPI,
and dynprof's own overrides (``DYNPROF_RANK``, ``DYNPROF_JOB_ID``...). Nothing here imports
torch or touches the network. The environment is untrusted: a value that is not UTF-8 is read
as text with its bad bytes escaped (``\\xff``), never as an error.
"""

from __future__ import annotations

import socket
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

from dynprof import _settings
from dynprof.safetext import valid_text


def _first_int(env: Mapping[str, str], *names: str) -> int | None:
    for name in names:
        value = env.get(name)
        if value is None or value == "":
            continue
        try:
            return int(value)
        except ValueError:
            continue
    return None


def _first_str(env: Mapping[str, str], *names: str) -> str | None:
    """The first of ``names`` set to a non-empty value, as valid text: bytes of the environment
    that are not UTF-8 (``DYNPROF_JOB_ID=$'bad\\xff'``) become ``\\xff``, the same on every read,
    so that the id can be encoded on the wire and in every record and page."""
    for name in names:
        value = env.get(name)
        if value:
            return valid_text(value)
    return None


@dataclass(frozen=True)
class Identity:
    host: str
    rank: int | None
    local_rank: int | None
    world_size: int | None
    job_id: str | None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def detect(env: Mapping[str, str] | None = None) -> Identity:
    env = _settings.environ() if env is None else env
    rank = _first_int(env, "DYNPROF_RANK", "RANK", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK", "PMI_RANK")
    local_rank = _first_int(env, "DYNPROF_LOCAL_RANK", "LOCAL_RANK", "SLURM_LOCALID", "OMPI_COMM_WORLD_LOCAL_RANK")
    world_size = _first_int(env, "DYNPROF_WORLD_SIZE", "WORLD_SIZE", "SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE")
    job_id = _first_str(env, "DYNPROF_JOB_ID", "TORCHELASTIC_RUN_ID", "SLURM_JOB_ID")
    if job_id == "none":  # torchrun's default run id when --rdzv-id is not given
        job_id = _first_str(env, "DYNPROF_JOB_ID", "SLURM_JOB_ID")
    host = valid_text(env.get("DYNPROF_HOST") or socket.gethostname())
    return Identity(host=host, rank=rank, local_rank=local_rank, world_size=world_size, job_id=job_id)
