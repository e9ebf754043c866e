"""The functional checks: one row each, the one list the runner, the launcher and the worker read.

A row (:class:`Check`) says everything about a functional check: its name, the levels it runs
at, its parameters and its time limit at each of them, where it runs (on each device, on all
the devices together, on the host's CPU) and the function that runs it in a worker. Adding a
check is a row in :data:`CHECKS` and its run function; the worker dispatches by the row
(:func:`check_named`), the launcher takes the sizes and limits of a level from the rows
(``launcher.level_plan``), and the runner's lists of check names are read from them.

This module imports no torch: the runner (which must run where torch is missing) reads the
rows, and each run function imports its benchmark when the worker calls it.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from healthcheck.functional.measurement import Measurement

if TYPE_CHECKING:
    import torch

# The levels that measure (``quick`` is passive only).
MEASURING_LEVELS = ("standard", "full")


class Scope(str, enum.Enum):
    """Where a check runs."""

    # In every device's worker, each measuring its own device; judged against the SKU's
    # baseline and the device's peers.
    DEVICE = "device"
    # In every device's worker at once, the workers joined in one process group (run only where
    # there are two devices or more); one result for the node, taken from the first worker. Its
    # run function is given ``init_timeout_s``: its time limit, for the rendezvous.
    NODE = "node"
    # In one worker on the host's CPU, on every node (with or without accelerators).
    HOST = "host"


class Sampler(Protocol):
    """What the worker reads of its device while a check runs (NVML; nothing on the CPU)."""

    def clocks(self) -> dict[str, Any]: ...

    def pcie(self) -> dict[str, Any]: ...


@dataclass(frozen=True)
class Target:
    """What a check's run function is given in the worker: its device and the sampler of it."""

    device: torch.device
    sampler: Sampler


RunFunction = Callable[[Target, dict[str, Any]], list[Measurement]]


@dataclass(frozen=True)
class Check:
    """One functional check.

    ``name`` is the worker's name for it (the launcher's spec, the worker's events, a time
    limit's message); ``results`` the names its measurements' results carry, when they are not
    ``name`` (the host transfer measures ``h2d_bandwidth`` and ``d2h_bandwidth``): each can be
    skipped with ``--skip``, and each is ``unknown`` when the check does not run to its end.
    ``under_load`` names the checks the runner judges from the device's readings taken while
    this one runs (they are listed with the functional checks, after its results).
    ``one_at_a_time``: the devices' workers take turns (a lock file), as host transfers do
    so that devices sharing a PCIe switch or host memory do not distort each other."""

    name: str
    levels: tuple[str, ...]
    params_by_level: Mapping[str, Mapping[str, Any]]
    timeout_by_level: Mapping[str, float]
    run: RunFunction
    scope: Scope = Scope.DEVICE
    results: tuple[str, ...] = ()
    under_load: tuple[str, ...] = ()
    one_at_a_time: bool = False

    @property
    def result_names(self) -> tuple[str, ...]:
        return self.results or (self.name,)

    def params(self, level: str) -> dict[str, Any]:
        """A copy of the parameters at ``level`` (the worker's run function may change it)."""
        return dict(self.params_by_level[level])

    def timeout(self, level: str) -> float:
        return self.timeout_by_level[level]


# -- the run functions (in the worker: each imports its benchmark, and with it torch) -------------
def _gemm(on: Target, params: dict[str, Any]) -> list[Measurement]:
    from healthcheck.functional.bench import gemm

    return [gemm(on.device, sample=on.sampler.clocks, **params)]


def _memory_bandwidth(on: Target, params: dict[str, Any]) -> list[Measurement]:
    from healthcheck.functional.bench import memory_bandwidth

    return [memory_bandwidth(on.device, **params)]


def _host_transfer(on: Target, params: dict[str, Any]) -> list[Measurement]:
    from healthcheck.functional.bench import host_transfer

    return host_transfer(on.device, sample=on.sampler.pcie, **params)


def _memory_pattern(on: Target, params: dict[str, Any]) -> list[Measurement]:
    from healthcheck.functional.bench import memory_pattern

    return [memory_pattern(on.device, **params)]


def _allreduce(on: Target, params: dict[str, Any]) -> list[Measurement]:
    import torch.distributed as dist

    from healthcheck.allreduce import allreduce_busbw, init_process_group

    init_process_group(on.device, params.pop("init_timeout_s", 120))
    try:
        return [allreduce_busbw(on.device, **params)]
    finally:
        dist.destroy_process_group()


def _host_gemm(on: Target, params: dict[str, Any]) -> list[Measurement]:
    from healthcheck.functional.cpu import host_gemm

    return [host_gemm(**params)]


def _host_memory_bandwidth(on: Target, params: dict[str, Any]) -> list[Measurement]:
    from healthcheck.functional.cpu import host_memory_bandwidth

    return [host_memory_bandwidth(**params)]


# -- the rows, in the order the workers run them and the report lists them -------------------------
CHECKS: tuple[Check, ...] = (
    Check(
        "gemm_bf16",
        MEASURING_LEVELS,
        params_by_level={
            "standard": {"n": 8192, "warmup_s": 1.0, "measure_s": 2.0, "repeats": 3},
            "full": {"n": 8192, "warmup_s": 5.0, "measure_s": 20.0, "repeats": 5},
        },
        timeout_by_level={"standard": 60, "full": 180},
        run=_gemm,
        under_load=("clocks_under_load",),
    ),
    Check(
        "memory_bandwidth",
        MEASURING_LEVELS,
        params_by_level={
            "standard": {"size_bytes": 2 * 1024**3, "warmup_s": 0.2, "iters": 100},
            "full": {"size_bytes": 4 * 1024**3, "warmup_s": 1.0, "iters": 400},
        },
        timeout_by_level={"standard": 30, "full": 120},
        run=_memory_bandwidth,
    ),
    Check(
        "host_transfer",
        MEASURING_LEVELS,
        params_by_level={
            "standard": {"size_bytes": 512 * 1024**2, "iters": 20},
            "full": {"size_bytes": 1024**3, "iters": 20},
        },
        timeout_by_level={"standard": 30, "full": 120},
        run=_host_transfer,
        results=("h2d_bandwidth", "d2h_bandwidth"),
        one_at_a_time=True,
    ),
    Check(
        "memory_pattern",
        MEASURING_LEVELS,
        params_by_level={"standard": {"fraction": 0.5}, "full": {"fraction": 0.9}},
        timeout_by_level={"standard": 60, "full": 300},
        run=_memory_pattern,
    ),
    Check(
        "allreduce",
        MEASURING_LEVELS,
        params_by_level={
            "standard": {"size_bytes": 256 * 1024**2, "warmup": 5, "iters": 20},
            # The same message size as standard, so the baseline applies; more iterations.
            "full": {"size_bytes": 256 * 1024**2, "warmup": 5, "iters": 100},
        },
        timeout_by_level={"standard": 120, "full": 300},
        run=_allreduce,
        scope=Scope.NODE,
    ),
    # The host's own figures (healthcheck.functional.cpu): no shipped baseline, the job-wide
    # peer comparison uses them.
    Check(
        "host_gemm_fp32",
        MEASURING_LEVELS,
        params_by_level={
            "standard": {"n": 1024, "measure_s": 1.0, "repeats": 5},
            "full": {"n": 1024, "measure_s": 2.0, "repeats": 5},
        },
        timeout_by_level={"standard": 30, "full": 60},
        run=_host_gemm,
        scope=Scope.HOST,
    ),
    Check(
        "host_memory_bandwidth",
        MEASURING_LEVELS,
        params_by_level={
            "standard": {"size_bytes": 128 * 1024**2, "iters": 2, "repeats": 5},
            "full": {"size_bytes": 256 * 1024**2, "iters": 8, "repeats": 5},
        },
        timeout_by_level={"standard": 30, "full": 60},
        run=_host_memory_bandwidth,
        scope=Scope.HOST,
    ),
)

_BY_NAME: dict[str, Check] = {c.name: c for c in CHECKS}


def check_named(name: str) -> Check:
    """The row of check ``name``; a name no row has is a ``ValueError`` naming it."""
    try:
        return _BY_NAME[name]
    except KeyError:
        raise ValueError(f"unknown check {name!r}") from None


def find(name: str) -> Check | None:
    """The row of check ``name``, or None."""
    return _BY_NAME.get(name)


def checks_of(scope: Scope, level: str | None = None) -> list[Check]:
    """The rows of ``scope`` (at ``level``, if given), in table order."""
    return [c for c in CHECKS if c.scope is scope and (level is None or level in c.levels)]


def result_names(*scopes: Scope) -> tuple[str, ...]:
    """The names the results of the rows of ``scopes`` carry, with the checks judged under their
    load, in table order: the report's names of the functional checks."""
    return tuple(name for c in CHECKS if c.scope in scopes for name in (*c.result_names, *c.under_load))


def row_of_result(name: str) -> Check | None:
    """The row whose measurements carry result ``name`` (``h2d_bandwidth`` -> the host transfer)."""
    for c in CHECKS:
        if name in c.result_names:
            return c
    return None


# The per-device checks, each device's worker runs them in this order.
PER_DEVICE_CHECKS = tuple(c.name for c in checks_of(Scope.DEVICE))
# The host's own figures, at standard and full: one worker on the CPU device, on every node.
HOST_FUNCTIONAL_CHECKS = tuple(c.name for c in checks_of(Scope.HOST))
