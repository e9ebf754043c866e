"""Human-readable quantities, shared by the CLI, the collectors' renderers and the web page."""

from __future__ import annotations

from typing import Any


def human_bytes(n: Any, digits: int = 1) -> str:
    """``1536`` -> ``"1.5 KiB"``; ``None`` -> ``"?"`` (a value that could not be read)."""
    if n is None:
        return "?"
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.{digits}f} {unit}"
        value /= 1024
    return f"{value:.{digits}f} TiB"  # pragma: no cover - the loop returns at TiB
