"""dynprof.untrusted: store files read as untrusted input: plain names only, no links, size,
depth and value caps, bounded decompression; every refusal an ArtifactError."""

from __future__ import annotations

import gzip
import io
import os
import zlib

import pytest

from dynprof import untrusted
from dynprof.errors import ArtifactError, MissingFile, UsageError
from dynprof.untrusted import (
    DecompressedReader,
    check_name,
    count_json_values,
    is_inside,
    iter_decompressed,
    iter_json_document,
    json_depth_exceeds,
    loads_json,
    max_gzip_ratio,
    max_trace_bytes,
    open_in,
    open_regular,
    read_bytes_in,
    read_json_in,
    read_text_in,
    stat_in,
    text_depth,
)


@pytest.mark.parametrize("name", ["trace.json", "a b", "..x", ".hidden", "x" * 255, "\udcff"])
def test_a_plain_name_is_accepted(name):
    assert check_name(name) == name


@pytest.mark.parametrize("name", ["", ".", "..", "a/b", "/etc/passwd", "a\x00b", "x" * 256, None, 5, ["a"]])
def test_a_name_that_is_not_plain_is_refused(name):
    with pytest.raises(ArtifactError, match="refused file name"):
        check_name(name)


def test_a_name_with_a_lone_surrogate_from_json_is_refused_as_an_artifact_error():
    with pytest.raises(ArtifactError):
        check_name("\ud800")


def test_is_inside_resolves_links_and_does_not_take_a_prefix_for_a_parent(tmp_path):
    root = tmp_path / "store"
    (root / "a").mkdir(parents=True)
    (tmp_path / "store-other").mkdir()
    (root / "out").symlink_to(tmp_path)
    assert is_inside(root, root) and is_inside(root, root / "a" / "x")
    assert not is_inside(root, tmp_path / "store-other"), "a sibling sharing the prefix is outside"
    assert not is_inside(root, root / "out"), "a link out of the root is outside"
    assert not is_inside(root, root / "a" / ".." / ".." / "x")


def test_open_in_reads_a_regular_file_by_its_plain_name(tmp_path):
    (tmp_path / "f.json").write_bytes(b"{}")
    with open_in(tmp_path, "f.json") as fh:
        assert fh.read() == b"{}"
    assert stat_in(tmp_path, "f.json").st_size == 2


def test_open_in_refuses_a_link_a_directory_a_fifo_and_says_what_is_missing(tmp_path):
    (tmp_path / "secret").write_text("x")
    (tmp_path / "link").symlink_to(tmp_path / "secret")
    (tmp_path / "dir").mkdir()
    os.mkfifo(tmp_path / "fifo")
    with pytest.raises(ArtifactError, match="is a symbolic link: refused"):
        open_in(tmp_path, "link")
    with pytest.raises(ArtifactError, match="not a regular file"):
        open_in(tmp_path, "dir")
    with pytest.raises(ArtifactError, match="not a regular file"):
        open_in(tmp_path, "fifo")  # without a writer: neither blocks nor is read
    with pytest.raises(MissingFile, match="absent: no such file"):
        open_in(tmp_path, "absent")
    with pytest.raises(ArtifactError, match="cannot open"):
        open_in(tmp_path / "no-dir", "f")


def test_open_regular_reads_a_named_file_and_says_in_the_callers_words_why_not(tmp_path):
    (tmp_path / "hosts").write_bytes(b"a\nb\n")
    (tmp_path / "link").symlink_to(tmp_path / "hosts")  # a file a person names may be a link
    os.mkfifo(tmp_path / "fifo")
    for name in ("hosts", "link"):
        with open_regular(str(tmp_path / name), "cannot read it", "not a file", UsageError) as fh:
            assert fh.read() == b"a\nb\n"
    with pytest.raises(UsageError, match=r"^not a file$"):
        open_regular(str(tmp_path / "fifo"), "cannot read it", "not a file", UsageError)  # never blocks
    with pytest.raises(UsageError, match=r"^not a file$"):
        open_regular(str(tmp_path), "cannot read it", "not a file", UsageError)
    with pytest.raises(ArtifactError, match=r"^cannot read it: No such file or directory$"):
        open_regular(str(tmp_path / "absent"), "cannot read it", "not a file", ArtifactError)


def test_read_bytes_in_refuses_a_file_over_the_limit(tmp_path):
    (tmp_path / "f").write_bytes(b"x" * 11)
    assert read_bytes_in(tmp_path, "f", 11) == b"x" * 11
    with pytest.raises(ArtifactError, match="11 bytes, over the 10-byte limit"):
        read_bytes_in(tmp_path, "f", 10)


def test_read_text_in_replaces_bytes_that_are_not_utf8(tmp_path):
    (tmp_path / "t").write_bytes(b"ok\xff")
    assert read_text_in(tmp_path, "t") == "ok\ufffd"


def test_json_depth_is_counted_in_containers_without_recursion():
    assert not json_depth_exceeds({"a": [1, 2]}, 2)
    assert json_depth_exceeds({"a": [[1]]}, 2)
    assert not json_depth_exceeds(5, 0)
    deep: list = []
    node = deep
    for _ in range(100_000):  # deeper than Python's recursion limit
        node.append([])
        node = node[0]
    assert json_depth_exceeds(deep, 64)


def test_text_depth_reads_brackets_outside_strings_only():
    assert text_depth('[[{"a": "[[[["}]]') == (3, True)
    assert text_depth('{"k\\"[": 1}') == (1, True), "an escaped quote does not end the string"
    assert text_depth("[[[") == (3, False)
    assert text_depth("42") == (0, True)
    # text after the value closes is not counted
    assert text_depth("[] [[[[") == (1, True)


def test_count_json_values_bounds_the_cheap_to_write_costly_to_parse_lists():
    # GIVEN the docstring's case: a list of n empty objects (n + 1 values, ~3 bytes each)
    n = 1000
    text = "[" + ",".join(["{}"] * n) + "]"
    # WHEN counted (without parsing) THEN at least every value is counted, bytes as text
    assert count_json_values(text) >= n + 1
    assert count_json_values(text) == count_json_values(text.encode())
    assert count_json_values("7") == 0


def test_loads_json_refuses_malformed_deep_and_too_many_values():
    assert loads_json(b'{"a": [1]}', "x") == {"a": [1]}
    with pytest.raises(ArtifactError, match=r"m\.json: not valid JSON"):
        loads_json(b"{", "m.json")
    with pytest.raises(ArtifactError, match="not valid JSON"):
        loads_json(b"\xff\xfe{", "m.json")
    with pytest.raises(ArtifactError, match="nested deeper than 3 levels"):
        loads_json("[[[[1]]]]", "m.json", max_depth=3)
    with pytest.raises(ArtifactError, match="nested deeper than 64 levels: refused"):
        loads_json("[" * 200_000 + "]" * 200_000, "m.json")
    with pytest.raises(ArtifactError, match="holds over 2 JSON values"):
        loads_json("[1,2,3]", "m.json", max_values=2)


def test_read_json_in_applies_the_size_and_depth_caps(tmp_path):
    (tmp_path / "m.json").write_text('{"files": ["a"]}')
    assert read_json_in(tmp_path, "m.json") == {"files": ["a"]}
    with pytest.raises(ArtifactError, match="over the 5-byte limit"):
        read_json_in(tmp_path, "m.json", max_bytes=5)
    with pytest.raises(ArtifactError, match="nested deeper than 1 levels"):
        read_json_in(tmp_path, "m.json", max_depth=1)


def test_the_caps_from_the_environment(monkeypatch):
    monkeypatch.delenv("DYNPROF_MAX_TRACE_BYTES", raising=False)
    monkeypatch.delenv("DYNPROF_MAX_GZIP_RATIO", raising=False)
    assert max_trace_bytes() == untrusted.DEFAULT_MAX_TRACE_BYTES
    assert max_gzip_ratio() == untrusted.DEFAULT_MAX_GZIP_RATIO
    monkeypatch.setenv("DYNPROF_MAX_TRACE_BYTES", "512M")
    assert max_trace_bytes() in (512 * 10**6, 512 * 2**20)
    monkeypatch.setenv("DYNPROF_MAX_GZIP_RATIO", " 50 ")
    assert max_gzip_ratio() == 50
    monkeypatch.setenv("DYNPROF_MAX_GZIP_RATIO", "0")
    assert max_gzip_ratio() == 1, "a ratio is at least 1"
    monkeypatch.setenv("DYNPROF_MAX_GZIP_RATIO", "lots")
    with pytest.raises(ArtifactError, match="is not an integer"):
        max_gzip_ratio()


def test_iter_decompressed_gives_plain_and_gzip_bytes_and_every_member():
    assert b"".join(iter_decompressed(io.BytesIO(b'{"a": 1}'), 100)) == b'{"a": 1}'
    two = gzip.compress(b"first ") + gzip.compress(b"second")
    assert b"".join(iter_decompressed(io.BytesIO(two), 100)) == b"first second"


def test_iter_decompressed_caps_the_output_and_refuses_broken_streams():
    with pytest.raises(ArtifactError, match="over the 3-byte limit"):
        b"".join(iter_decompressed(io.BytesIO(b"abcd"), 3))
    with pytest.raises(ArtifactError, match="inflates to more than 100 bytes"):
        b"".join(iter_decompressed(io.BytesIO(gzip.compress(b"x" * 1000)), 100))
    with pytest.raises(ArtifactError, match="truncated"):
        b"".join(iter_decompressed(io.BytesIO(gzip.compress(b"x" * 1000)[:-12]), 10_000))
    with pytest.raises(ArtifactError, match="not a readable gzip file"):
        b"".join(iter_decompressed(io.BytesIO(b"\x1f\x8b" + b"\x00" * 30), 10_000))
    with pytest.raises(ArtifactError, match="not a gzip file"):
        b"".join(iter_decompressed(io.BytesIO(b"{}"), 10, gzip_only=True))


def test_a_gzip_bomb_is_refused_by_its_ratio_past_the_floor(monkeypatch):
    # GIVEN a floor of 1 MiB (64 MiB in use) and a stream of zeros that inflates ~1000:1
    monkeypatch.setattr(untrusted, "GZIP_RATIO_FLOOR", 1 << 20)
    bomb = zlib.compressobj(9, zlib.DEFLATED, 16 + zlib.MAX_WBITS)
    data = bomb.compress(b"\0" * (8 << 20)) + bomb.flush()
    # WHEN read with a ratio cap of 50 and a size cap it stays under
    # THEN it is refused as a gzip bomb
    with pytest.raises(ArtifactError, match="refused as a gzip bomb"):
        for _ in iter_decompressed(io.BytesIO(data), 1 << 30, max_ratio=50):
            pass


def test_decompressed_reader_reads_a_gzip_stream_in_chunks():
    reader = DecompressedReader(io.BytesIO(gzip.compress(b"hello")), 100)
    assert reader.read() == b"hello" and reader.read() == b""
    reader.close()


def test_iter_json_document_streams_the_elements_of_the_named_arrays():
    text = b'{"meta": {"v": 1}, "traceEvents": [{"n": 1}, {"n": 2}], "tail": [3]}'
    found = list(iter_json_document(iter([text[:10], text[10:]]), ["traceEvents"], "t.json"))
    assert found == [
        ("meta", {"v": 1}, False),
        ("traceEvents", {"n": 1}, True),
        ("traceEvents", {"n": 2}, True),
        ("tail", [3], False),
    ]


def test_iter_json_document_refuses_what_is_not_an_object_and_values_too_large_or_deep():
    with pytest.raises(ArtifactError):
        list(iter_json_document(iter([b"[1, 2]"]), [], "t.json"))
    with pytest.raises(ArtifactError):
        list(iter_json_document(iter([b'{"a": "' + b"x" * 200 + b'"}']), [], "t.json", max_value_chars=100))
    with pytest.raises(ArtifactError):
        list(iter_json_document(iter([b'{"a": [[[[1]]]]}']), [], "t.json", max_depth=2))
