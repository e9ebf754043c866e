"""The streaming reader of Chrome traces (collectors/trace_analysis/reader.py): the same events
as ``json.load``, whatever the chunking; bounded; a clear TraceError for what it cannot read."""

from __future__ import annotations

import gzip
import json

import pytest

from collectors.torch_trace import read_trace
from collectors.trace_analysis import reader
from collectors.trace_analysis.reader import TraceError, iter_trace
from tests.unit._trace_analysis_cases import trace_files


def test_streaming_reader_yields_the_same_events_as_json_load(monkeypatch):
    # GIVEN a real trace, and a reader whose chunks are tiny (events straddle every boundary)
    path = trace_files("slow1")[0]
    expected = read_trace(path)
    monkeypatch.setattr(reader, "_CHUNK", 97)

    # WHEN it is read as a stream
    header: dict = {}
    events = list(iter_trace(path, header))

    # THEN every event and the header keys come back unchanged
    assert events == expected["traceEvents"]
    assert header["distributedInfo"] == expected["distributedInfo"]
    assert header["schemaVersion"] == expected["schemaVersion"]


def test_reader_refuses_a_trace_larger_than_the_limit():
    path = trace_files("slow1")[0]
    with pytest.raises(TraceError, match="more than 1000 bytes once decompressed"):
        list(iter_trace(path, max_bytes=1000))


@pytest.mark.parametrize(
    "content, message",
    [
        (b'{"traceEvents": [{"ph": "X", "ts": 1', "not valid JSON|truncated"),
        (b"[1, 2, 3]", "no JSON object"),
        (b'{"traceEvents": 5}', "not a list"),
        (b'{"traceEvents": [' + b"[" * 100000 + b"]" * 100000 + b"]}", "nested too deeply|not valid JSON"),
        (b"\xff\xfe{}", "not UTF-8|no JSON object"),
    ],
    ids=["truncated", "array", "events-not-list", "deep", "binary"],
)
def test_reader_rejects_bad_input_with_a_clear_error(tmp_path, content, message):
    path = tmp_path / "bad.json.gz"
    path.write_bytes(gzip.compress(content))
    with pytest.raises(TraceError, match=message):
        list(iter_trace(path))


def test_a_file_that_is_not_gzip_is_a_trace_error(tmp_path):
    path = tmp_path / "trace.json.gz"
    path.write_bytes(b"plain text, not gzip")
    with pytest.raises(TraceError, match="cannot read"):
        list(iter_trace(path))


def test_a_trace_that_is_a_symbolic_link_is_refused(tmp_path):
    real = trace_files("slow1")[0]
    link = tmp_path / "trace.json.gz"
    link.symlink_to(real)
    with pytest.raises(TraceError, match="symbolic link"):
        list(iter_trace(link))


def test_an_uncompressed_trace_is_read_and_events_that_are_not_objects_are_skipped(tmp_path):
    # GIVEN a plain (not gzipped) trace whose event list holds a number and a list among its events
    path = tmp_path / "trace.json"
    doc = {"schemaVersion": 1, "traceEvents": [{"name": "a"}, 7, ["b"], {"name": "c"}]}
    path.write_text(json.dumps(doc))

    # WHEN it is read THEN only the objects come back, and the header key before them
    header: dict = {}
    assert list(iter_trace(path, header)) == [{"name": "a"}, {"name": "c"}]
    assert header == {"schemaVersion": 1}


def test_header_keys_after_the_events_are_there_once_the_events_are_read(tmp_path):
    # GIVEN a trace whose "distributedInfo" follows its event list (Kineto writes some keys last)
    path = tmp_path / "trace.json.gz"
    path.write_bytes(gzip.compress(b'{"traceEvents": [{"name": "a"}], "distributedInfo": {"rank": 3}}'))

    # WHEN its events are read one by one
    header: dict = {}
    events = iter_trace(path, header)
    assert next(events) == {"name": "a"}
    assert "distributedInfo" not in header  # not read yet

    # THEN the key is in the header once the stream is exhausted
    assert list(events) == []
    assert header == {"distributedInfo": {"rank": 3}}
