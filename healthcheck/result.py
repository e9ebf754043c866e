"""What a check says: a status per check and device, and the exit code of a whole run.

Exit codes are a stable contract (documented in docs/healthcheck.md):

====  =====================================================================
 0    healthy: every check passed (or was skipped as not applicable)
 1    warning: a check warned, or a non-critical check could not be run
 2    unhealthy: a check failed; drain the node (or reset the named device)
 3    could not run: a critical check (accelerator discovery, device count,
      a functional benchmark) could not be run and nothing failed
====  =====================================================================
"""

from __future__ import annotations

import enum
from dataclasses import asdict, dataclass, field
from typing import Any

EXIT_HEALTHY = 0
EXIT_WARNING = 1
EXIT_UNHEALTHY = 2
EXIT_COULD_NOT_RUN = 3


class Status(str, enum.Enum):
    PASS = "pass"
    WARN = "warn"
    FAIL = "fail"
    # The check could not be run or its reading is not available: never counted as a pass.
    UNKNOWN = "unknown"
    # The check does not apply (the device has no such feature, the level excludes it, --skip).
    SKIPPED = "skipped"


# What a failing check asks the scheduler to do with the node or device.
ACTIONS = ("drain", "reset", "warn")


@dataclass
class CheckResult:
    """One check's verdict on one device (``device`` is its index) or on the node (``None``)."""

    name: str
    status: Status
    reason: str
    device: int | None = None
    value: float | int | str | None = None
    expected: str | None = None
    unit: str | None = None
    # For throughput checks: the key under which baselines store this measurement.
    metric: str | None = None
    # "drain", "reset" or "warn" where the check knows what should happen next.
    action: str | None = None
    # An unknown result of a critical check means the node could not be checked (exit 3).
    critical: bool = False
    duration_s: float | None = None
    details: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["status"] = self.status.value
        return data


def exit_code(results: list[CheckResult]) -> int:
    """The exit code of a run whose checks returned ``results`` (see the module docstring)."""
    if not results:
        return EXIT_COULD_NOT_RUN
    if any(r.status is Status.FAIL for r in results):
        return EXIT_UNHEALTHY
    if any(r.status is Status.UNKNOWN and r.critical for r in results):
        return EXIT_COULD_NOT_RUN
    if any(r.status in (Status.WARN, Status.UNKNOWN) for r in results):
        return EXIT_WARNING
    return EXIT_HEALTHY


def verdict(code: int) -> str:
    return {
        EXIT_HEALTHY: "healthy",
        EXIT_WARNING: "warning",
        EXIT_UNHEALTHY: "unhealthy",
        EXIT_COULD_NOT_RUN: "could not run",
    }[code]
