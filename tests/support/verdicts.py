"""A watch's verdict for the tests of how it is shown (text, HTML): a hang of job-7 whose
conclusion names rank 3, detected at 100 s and decided 4 s later; ``fields`` change the rest."""

from __future__ import annotations

from typing import Any

from dynprof.watch.model import Verdict


def hang_verdict(**fields: Any) -> Verdict:
    base: dict[str, Any] = {
        "kind": "hang",
        "job": "job-7",
        "conclusion": "rank 3 never entered the all_reduce",
        "detected_at": 100.0,
        "decided_at": 104.0,
    }
    base.update(fields)
    return Verdict(**base)
