"""The summary of a real OOM artifact (tests/data/memory_oom_artifact), made into an OOM that
activations dominate, for the tests of the memory advice."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

OOM_SUMMARY = Path(__file__).resolve().parents[1] / "data" / "memory_oom_artifact" / "summary.json"


def activations_oom(measurement: Any, limit: int, frame_tensors: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """The real OOM artifact's summary, with an attribution where activations are the largest
    part (the ``frame_tensors`` given, none by default), the device's memory ``limit`` and (if
    any) the last measured step."""
    s = copy.deepcopy(json.loads(OOM_SUMMARY.read_text()))
    s["attribution"] = {
        "optimizers": 1,
        "parameters_bytes": 0,
        "gradients_bytes": 0,
        "optimizer_state_bytes": 0,
        "frame_tensors_bytes": 0,
        "frame_tensors": frame_tensors or [],
    }
    s["failing_allocation"] = {**(s.get("failing_allocation") or {}), "device_limit_bytes": limit}
    if measurement is not None:
        s["memory_plan_measurement"] = measurement
    return s
