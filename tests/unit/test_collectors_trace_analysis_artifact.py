"""The ``analysis`` artifact's one reader (collectors/trace_analysis/artifact.py): the analysis
comes back as it was saved; any other document is a TraceError that says what it is."""

from __future__ import annotations

import pytest

from collectors.trace_analysis.artifact import ANALYSIS_FILE, KIND, SCHEMA, SCHEMA_VERSION, load_analysis
from collectors.trace_analysis.reader import TraceError
from dynprof.store import Artifact, ArtifactStore


def _artifact(name: str, doc: object) -> Artifact:
    writer = ArtifactStore().create(KIND)
    writer.write_json(name, doc)
    return writer.finish("complete")


def test_a_saved_analysis_is_read_back_as_it_was():
    doc = {"schema": SCHEMA, "schema_version": SCHEMA_VERSION, "ranks": [{"rank": 0}], "straggler": None}
    assert load_analysis(_artifact(ANALYSIS_FILE, doc)) == doc


@pytest.mark.parametrize(
    "doc, message",
    [
        ([1, 2], "is not a dynprof analysis"),
        ({"schema": "dynprof.memory", "schema_version": 1}, "is not a dynprof analysis"),
        ({"schema": SCHEMA, "schema_version": SCHEMA_VERSION + 1}, "schema version 2 is not one this dynprof reads"),
        ({"schema": SCHEMA, "schema_version": "1"}, "schema version '1' is not one"),
        ({"schema": SCHEMA}, "schema version None is not one"),
    ],
    ids=["a-list", "another-schema", "newer", "version-text", "no-version"],
)
def test_a_document_that_is_not_an_analysis_this_dynprof_reads_is_refused(doc, message):
    with pytest.raises(TraceError, match=message):
        load_analysis(_artifact(ANALYSIS_FILE, doc))


def test_an_artifact_without_the_analysis_file_is_refused():
    with pytest.raises(TraceError, match=ANALYSIS_FILE):
        load_analysis(_artifact("other.json", {}))
