"""JSON text that every reader accepts: RFC 8259, no NaN or Infinity.

Python's ``json.dumps`` writes ``NaN`` and ``Infinity`` for non-finite floats, which ``jq``,
browsers' ``JSON.parse`` and most other readers refuse. dynprof's JSON outputs (``--json``,
manifests, reports) go through :func:`dumps`, which writes them as ``null``.
"""

from __future__ import annotations

import json
import math
from typing import Any


def dumps(obj: Any, **kwargs: Any) -> str:
    """``json.dumps(obj, **kwargs)`` with non-finite floats written as null."""
    kwargs["allow_nan"] = False
    try:
        return json.dumps(obj, **kwargs)
    except ValueError:
        return json.dumps(finite(obj), **kwargs)


def finite(obj: Any) -> Any:
    """``obj`` with every non-finite float (at any depth of dicts, lists and tuples) as None."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [finite(v) for v in obj]
    return obj
