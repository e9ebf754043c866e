"""What a micro-benchmark reports (kept free of torch, so judging results never imports it)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class Measurement:
    check: str
    metric: str | None
    value: float
    unit: str
    ok: bool = True
    reason: str = ""
    details: dict[str, Any] = field(default_factory=dict)
