"""What a check says: a status per check and device, the decision table that says it, and the
exit code of a whole run.

A check that judges what it read says its verdict as a decision table (:func:`decide`): rows of
condition, status and message (:func:`row`), the first that holds decides; the fields every row
shares (value, expected, unit, details) are given once.

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
from collections.abc import Mapping, Sequence
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


@dataclass(frozen=True)
class Row:
    """One row of a check's decision table: when ``when`` holds, the check says ``status`` and
    ``message``, with ``fields`` (value, expected, unit, action, details) over the shared ones."""

    when: bool
    status: Status
    message: str
    fields: Mapping[str, Any]


def row(when: bool, status: Status, message: str, **fields: Any) -> Row:
    return Row(when, status, message, fields)


# The condition of a table's last row.
OTHERWISE = True


def decide(name: str, rows: Sequence[Row], *, device: int | None = None, **shared: Any) -> CheckResult:
    """The result of check ``name`` (on ``device``, None: the node) that the first row that
    holds gives (the last row's condition is ``OTHERWISE``). The ``shared`` fields go with every
    row; a row's own fields replace them (``expected=None`` drops the shared one)."""
    for candidate in rows:
        if candidate.when:
            return CheckResult(
                name, candidate.status, candidate.message, device=device, **{**shared, **candidate.fields}
            )
    raise AssertionError(f"{name}: no row of the decision table holds")


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
