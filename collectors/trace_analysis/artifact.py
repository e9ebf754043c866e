"""The ``analysis`` artifact: its kind, the file that holds the job-wide analysis, the schema
that analysis carries, and the one reader of it (:func:`load_analysis`: bounded, schema
checked; what is wrong with the file is a :class:`~collectors.trace_analysis.reader.TraceError`).
"""

from __future__ import annotations

from typing import Any

from collectors.trace_analysis.reader import TraceError
from dynprof.errors import ArtifactError
from dynprof.untrusted import loads_json

KIND = "analysis"
ANALYSIS_FILE = "analysis.json"
SCHEMA = "dynprof.analysis"
SCHEMA_VERSION = 1
MAX_ANALYSIS_FILE_BYTES = 64 * 1024**2


def load_analysis(artifact: Any) -> dict[str, Any]:
    """The analysis saved in an ``analysis`` artifact (bounded read, schema checked)."""
    what = f"{ANALYSIS_FILE} in {artifact.path}"
    try:
        data = loads_json(artifact.read_bytes(ANALYSIS_FILE, MAX_ANALYSIS_FILE_BYTES), what)
    except ArtifactError as exc:
        raise TraceError(str(exc)) from None
    if not isinstance(data, dict) or data.get("schema") != SCHEMA:
        raise TraceError(f"{what} is not a dynprof analysis")
    version = data.get("schema_version")
    if not isinstance(version, int) or version > SCHEMA_VERSION:
        raise TraceError(f"{what}: schema version {version!r} is not one this dynprof reads")
    return data
