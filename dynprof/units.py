"""Human-readable quantities, shared by the CLI, the collectors' renderers and the web page."""

from __future__ import annotations

import math
import re
from typing import Any

from dynprof.errors import ArtifactError


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


def human_age(seconds: Any) -> str:
    """``3725`` -> ``"1h02m"``; a value that is not a finite number (a node's answer) -> ``"?"``."""
    try:
        value = float(seconds)
    except (TypeError, ValueError, OverflowError):
        return "?"
    if not math.isfinite(value):
        return "?"
    whole = max(0, int(value))
    if whole < 60:
        return f"{whole}s"
    if whole < 3600:
        return f"{whole // 60}m{whole % 60:02d}s"
    if whole < 86400:
        return f"{whole // 3600}h{whole % 3600 // 60:02d}m"
    return f"{whole // 86400}d{whole % 86400 // 3600:02d}h"


# A number as people type one, in ASCII digits: float() and int() also read other scripts'
# digits ("\u0664\u0660" is 40 to them) and underscores ("1_0"), which no dynprof option documents.
_FLOAT = re.compile(
    r"[+-]?(?:(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][+-]?[0-9]+)?|inf(?:inity)?|nan)", re.ASCII | re.IGNORECASE
)
_SPACE = " \t\n\r\f\v"


def ascii_float(text: str) -> float:
    """``text`` (ASCII white space around it allowed) as a float, if it is a number written in
    ASCII digits (or ``inf``, ``nan``: the caller says whether it takes them); ValueError if not."""
    core = text.strip(_SPACE)
    if not _FLOAT.fullmatch(core):
        raise ValueError(f"not a number in ASCII digits: {text[:40]!a}")
    return float(core)


def parse_size(text: str) -> int:
    """Parse ``"512M"``, ``"20G"``, ``"1073741824"`` into bytes (ASCII digits only)."""
    match = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([kKmMgGtT]?)i?[bB]?\s*", text, re.ASCII)
    if not match:
        raise ArtifactError(f"cannot read size {text!r}", help="Write it as bytes or with K, M, G, T.")
    number, unit = match.groups()
    scale = {"": 1, "k": 1024, "m": 1024**2, "g": 1024**3, "t": 1024**4}[unit.lower()]
    return int(float(number) * scale)
