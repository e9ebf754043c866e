"""A kind's sidecar action, written in the kind's own code and named by its row of the kinds'
table (``action="module:ATTR"``, :mod:`dynprof.kinds`): the sidecar's table
(:mod:`dynprof.sidecar.table`) makes its row of the action from it.

It names the kind's request (whose ``OPTIONS`` are the action's options), its ``collect`` on
one node, and its job-wide answer: ``job(options, nodes, reach)``, or ``per_rank``, the kind's
decoder of a node's answer (its ``from_json``, returning the per-rank rows), for a kind whose
job-wide answer is its nodes' per-rank rows merged in rank order (the job layer's
``collect_per_rank``, each node waiting the action's ``timeout`` option, else its default).
``limits`` are the action's other facts (its time limits, whether it acts on jobs, where it
runs), each a field of the sidecar's ``Action``. This module imports nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class ActionSpec:
    request: type
    collect: Callable[[Any], Any]
    job: Callable[..., Any] | None = None
    per_rank: Callable[[Any], Any] | None = None
    decode: Callable[[dict[str, Any]], Any] | None = None  # default: the request's from_json
    limits: dict[str, Any] = field(default_factory=dict)
