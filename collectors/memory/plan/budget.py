"""A memory plan's budget as a person writes it: ``SIZE`` (``40G``) or ``P%`` of the measured
peak (:func:`parse_budget`), for ``dynprof memory plan --budget/--save`` and ``dynprof run
--checkpoint``."""

from __future__ import annotations

from dynprof import errors
from dynprof.units import ascii_float, parse_size


def parse_budget(text: str) -> tuple[int | None, float | None]:
    """``SIZE`` (bytes, K/M/G/T) or ``P%`` (of the measured peak): (bytes, fraction)."""
    raw = text.strip()
    if raw.endswith("%"):
        try:
            value = ascii_float(raw[:-1])
        except ValueError:
            raise errors.UsageError(
                f"--budget {text[:80]!r}: not a percentage (ASCII digits)", help="Write e.g. 60% or 40G."
            ) from None
        if not 0 < value < 100:
            raise errors.UsageError(
                f"--budget {text[:80]!r}: a percentage must be between 0 and 100", help="Write e.g. 60% or 40G."
            )
        return None, value / 100.0
    try:
        return parse_size(raw), None
    except errors.DynprofError as exc:
        raise errors.UsageError(
            f"--budget/--save {text[:80]!r}: {exc.message[:200]}", help="Write e.g. 40G, 512M or 60%."
        ) from None
    except OverflowError:  # more digits than a float holds
        raise errors.UsageError(
            f"--budget/--save {text[:80]!r}: not a size", help="Write e.g. 40G, 512M or 60%."
        ) from None
