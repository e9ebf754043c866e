"""The one decoder of stacks documents and process dumps on crafted input: huge counts, deep
nesting, long strings, wrong types. Each gives a clean ArtifactError or a bounded result with
what was cut counted in `truncated`; never a traceback."""

from __future__ import annotations

import io
import json
from typing import Any

import pytest

from collectors.stacks import Budget, ProcessStacks, from_json, model, read_document
from dynprof.cli import main
from dynprof.errors import ArtifactError

V2 = {"schema": "dynprof.stacks", "schema_version": 2}


def _row(pid: int, frames: list[Any], **extra: Any) -> dict[str, Any]:
    return {"pid": pid, "rank": pid, "method": "py-spy", "main_thread": {"tid": pid, "frames": frames}, **extra}


def _frame(i: int) -> dict[str, Any]:
    return {"function": f"f{i}", "file": "/job/train.py", "line": i}


def _file(doc: Any) -> io.BytesIO:
    return io.BytesIO(json.dumps(doc).encode())


def test_long_stacks_strings_and_failure_lists_are_cut_and_counted() -> None:
    # GIVEN a stack of 5000 frames, a name of 100 000 characters and 20 000 failures
    doc = {
        **V2,
        "processes": [_row(1, [_frame(i) for i in range(5000)], job="j" * 100_000)],
        "failures": {f"rank {i}": "timed out" for i in range(20_000)},
    }
    # WHEN decoded
    stacks = from_json(doc)
    # THEN each is cut to its bound, innermost frames kept, and the cuts counted
    (p,) = stacks.processes
    assert len(p.threads[0].frames) == model.MAX_FRAMES and p.threads[0].frames[0].function == "f0"
    assert p.job == "j" * model.MAX_TEXT
    assert len(stacks.failures) == model.MAX_FAILURES
    assert stacks.truncated == (5000 - model.MAX_FRAMES) + 1 + (20_000 - model.MAX_FAILURES)
    # and the count travels on with the merged document
    assert stacks.to_json()["truncated"] == stacks.truncated


@pytest.mark.parametrize(
    "bound, doc, message",
    [
        ("MAX_PROCESSES", {**V2, "processes": [{"pid": i} for i in range(50)]}, "over 10 processes: refused"),
        (
            "MAX_DISTINCT_FRAMES",
            {**V2, "processes": [_row(1, [_frame(i) for i in range(50)])]},
            "over 10 different frames: refused",
        ),
        (
            "MAX_TEXT_TOTAL",
            {**V2, "processes": [{"pid": i, "job": f"{i}" * 20} for i in range(5)]},
            "over 10 characters of text: refused",
        ),
        ("MAX_ITEMS", {**V2, "processes": [], "groups": list(range(50))}, "over 10 values: refused"),
    ],
)
def test_huge_counts_are_refused_past_the_budget(monkeypatch: Any, bound: str, doc: Any, message: str) -> None:
    # GIVEN a bound made small, and a document past it
    monkeypatch.setattr(model, bound, 10)
    # WHEN decoded, THEN refused with the bound named
    with pytest.raises(ArtifactError, match=message):
        from_json(doc)


def test_identical_frames_of_many_processes_are_kept_once() -> None:
    # GIVEN 1000 processes on the same 100-frame stack
    frames = [_frame(i) for i in range(100)]
    budget = Budget()
    # WHEN decoded
    stacks = from_json({**V2, "processes": [_row(pid, frames) for pid in range(1000)]}, budget)
    # THEN every process has its stack, and the frames exist once
    assert len(stacks.processes) == 1000
    first, last = stacks.processes[0].threads[0].frames, stacks.processes[-1].threads[0].frames
    assert all(a is b for a, b in zip(first, last)) and len(first) == 100


WRONG = [None, True, -1.5, "text", [1, [2]], {"x": {}}, 1 << 70, float("nan")]


@pytest.mark.parametrize("bad", WRONG, ids=range(len(WRONG)))
def test_fields_of_the_wrong_type_are_dropped(bad: Any) -> None:
    # GIVEN every field of a row, its thread and a frame of the wrong type
    row = {key: bad for key in ("rank", "job", "host", "method", "native", "fallback_reason", "file")}
    frame = {key: bad for key in ("function", "file", "line", "native", "library", "locals")}
    doc = {**V2, "processes": [{"pid": 7, **row, "main_thread": {"tid": bad, "name": bad, "frames": [frame, bad]}}]}
    doc["failures"] = {"a": bad}
    doc["truncated"] = bad
    # WHEN decoded
    (p,) = from_json(doc).processes
    # THEN what is left has the types the renderers expect
    assert p.pid == 7 and (p.rank is None or isinstance(p.rank, int)) and isinstance(p.method, str)
    assert all(isinstance(v, (str, type(None))) for v in (p.job, p.host, p.fallback_reason, p.file))
    (main_thread,) = p.threads
    assert main_thread.tid == 7 and main_thread.main
    for f in main_thread.frames:
        assert isinstance(f.function, str) and isinstance(f.file, str) and isinstance(f.line, int)
        assert f.locals is None or all(isinstance(k, str) and isinstance(v, str) for k, v in f.locals.items())
    assert from_json(doc).failures == {"a": bad if isinstance(bad, str) else "?"}


@pytest.mark.parametrize(
    "doc, message",
    [
        ([], "not a JSON object"),
        ({"processes": []}, "no schema"),
        (
            {"schema": "dynprof.stacks", "schema_version": 1, "processes": []},
            "this dynprof reads dynprof.stacks version 2",
        ),
        ({"schema": ["x"] * 1000, "schema_version": 2, "processes": []}, "not a dynprof stacks document"),
        ({**V2, "processes": {"pid": 1}}, "no list of processes"),
    ],
)
def test_what_is_not_a_stacks_document_is_named(doc: Any, message: str) -> None:
    with pytest.raises(ArtifactError, match=message):
        from_json(doc)


def test_process_dumps_are_bounded_and_checked() -> None:
    # GIVEN a process dump with too many threads, notes and locals, one without schema, one without pid
    thread = {"tid": 1, "frames": [{"function": "f", "locals": {f"v{i}": "x" * 5000 for i in range(500)}}]}
    dump = {"schema": "dynprof.stacks.process", "schema_version": 2, "pid": 3, "method": "agent"}
    big = {**dump, "threads": [thread] * 5000, "notes": ["n"] * 1000}
    # WHEN decoded
    p = ProcessStacks.from_json(big)
    # THEN bounded
    assert len(p.threads) == model.MAX_THREADS and len(p.notes) == model.MAX_NOTES
    local = p.threads[0].frames[0].locals or {}
    assert len(local) == model.MAX_LOCALS and all(len(v) == model.MAX_TEXT for v in local.values())
    # and what is not a dump is refused with its reason
    for bad, message in (({"pid": 3}, "no schema"), ({**dump, "pid": "3"}, "without a pid"), ([], "not a JSON object")):
        with pytest.raises(ArtifactError, match=message):
            ProcessStacks.from_json(bad)
    # and what a dump writes, it reads back
    again = ProcessStacks.from_json(p.to_json())
    assert again.to_json() == p.to_json()


@pytest.mark.parametrize(
    "doc", [{**V2}, {**V2, "processes": []}, {**V2, "processes": [], "pad": "x" * ((1 << 20) - 100)}]
)
def test_a_document_without_processes_has_none(doc: dict[str, Any]) -> None:
    # GIVEN a document listing no process (every node failed), parsed, or as a small or large file
    for stacks in (from_json(doc), read_document(_file(doc))):
        # THEN it is read, with no process
        assert stacks.processes == []


def test_a_large_file_is_read_piece_by_piece_with_the_same_result() -> None:
    # GIVEN a document over the size parsed at once (2000 processes, 40 frames each)
    doc = {**V2, "processes": [_row(pid, [_frame(i + pid % 3) for i in range(40)]) for pid in range(2000)]}
    data = json.dumps(doc).encode()
    assert len(data) > model.SMALL_FILE_BYTES
    # WHEN read from a file
    stacks = read_document(io.BytesIO(data))
    # THEN it is what the parsed document decodes to
    assert stacks.to_json() == from_json(doc).to_json()


@pytest.mark.parametrize(
    "text, message",
    [
        (b"{not json", "not valid JSON"),
        (b"[" * 100_000 + b"]" * 100_000, "nested deeper than 16 levels"),
        (b'{"processes": [], "x": ' + b"[" * 100 + b"]" * 100 + b"}", "nested deeper than 16 levels"),
        (json.dumps({**V2, "processes": [_row(1, [{}] * 400_000)]}).encode(), "one JSON value is over"),
        (json.dumps({**V2, "pad": "x" * (2 << 20), "processes": []}).encode(), "one JSON value is over"),
        (b'{"schema": "dynprof.stacks", "processes": [{"pid": 1}' + b" " * (2 << 20), "malformed"),
        (b'{"a": 1, ' * (300_000) + b"}", "one JSON value is over 65536 characters: refused"),
    ],
    ids=["bad", "deep-list", "deep-field", "long-row", "long-field", "cut", "bad-key"],
)
def test_malformed_files_give_a_clean_error(text: bytes, message: str) -> None:
    with pytest.raises(ArtifactError, match=message) as caught:
        read_document(io.BytesIO(text))
    assert not caught.value.message.startswith("it:")


def test_merge_of_a_crafted_file_names_it_and_goes_on(tmp_path: Any, capsys: Any) -> None:
    # GIVEN a good file and one with more different frames than a read keeps
    good = tmp_path / "stacks.a.json"
    good.write_text(json.dumps({**V2, "processes": [_row(1, [_frame(0)])]}))
    crafted = tmp_path / "stacks.b.json"
    rows = [_row(pid, [_frame(pid * 1000 + i) for i in range(1000)]) for pid in range(220)]
    crafted.write_text(json.dumps({**V2, "processes": rows}))
    # WHEN merged
    code = main(["stacks", "--merge", str(good), str(crafted), "--no-save"])
    # THEN the crafted file is named with its reason, the good one merged, exit 1
    captured = capsys.readouterr()
    assert code == 1 and "Traceback" not in captured.err
    assert f"FAILED file {crafted}: over {model.MAX_DISTINCT_FRAMES} different frames: refused" in captured.out
    assert "1 process(es) of 1 node(s) merged from 1 file(s)" in captured.out


def test_frames_with_locals_count_against_the_budget(monkeypatch: Any) -> None:
    # GIVEN a bound of 10 frames kept, a document whose 50 identical frames each carry locals,
    # and a process dump with as many
    monkeypatch.setattr(model, "MAX_DISTINCT_FRAMES", 10)
    frame = {"function": "f", "file": "/a.py", "line": 1, "locals": {"x": "1"}}
    doc = {**V2, "processes": [_row(1, [frame] * 50)]}
    thread = {"tid": 1, "main": True, "frames": [frame] * 50}
    dump = {"schema": "dynprof.stacks.process", "schema_version": 2, "pid": 1, "threads": [thread]}
    # WHEN decoded
    (p,) = from_json(doc).processes
    # THEN a document's frames carry no locals (identical frames are kept once) ...
    assert p.threads[0].frames[0].locals is None and len(p.threads[0].frames) == 50
    # ... and a dump's, which do, count each frame against the bound
    with pytest.raises(ArtifactError, match="over 10 different frames: refused"):
        ProcessStacks.from_json(dump)


def test_threads_count_against_the_budget(monkeypatch: Any) -> None:
    # GIVEN a bound of 10 threads kept, and dumps of 4 threads each read with one budget
    monkeypatch.setattr(model, "MAX_THREADS_TOTAL", 10)
    dump = {"schema": "dynprof.stacks.process", "schema_version": 2, "pid": 1, "threads": [{"tid": 1}] * 4}
    budget = Budget()
    ProcessStacks.from_json(dump, budget)
    ProcessStacks.from_json(dump, budget)
    # WHEN a third is read, THEN it is refused
    with pytest.raises(ArtifactError, match="over 10 threads: refused"):
        ProcessStacks.from_json(dump, budget)


class _Counting(io.BytesIO):
    """A file that counts the bytes read from it."""

    def __init__(self, data: bytes) -> None:
        super().__init__(data)
        self.read_bytes = 0

    def read(self, size: int | None = -1) -> bytes:
        chunk = super().read(size)
        self.read_bytes += len(chunk)
        return chunk


@pytest.mark.parametrize(
    "where",
    ["processes", "groups", "field"],
)
def test_a_deeply_nested_file_is_refused_from_its_text_before_it_is_decoded(where: str) -> None:
    # GIVEN a 60 MB file of values nested 40 levels deep (under the 64 of any JSON dynprof
    # reads, far over a stacks document's 8), in its processes, its groups or a field
    value = b"[" * 40 + b",".join([b"[[0]]"] * 1000) + b"]" * 40
    if where == "field":
        body = b",".join(b'"k%d": ' % i + value for i in range(12_000))
        data = b'{"schema": "dynprof.stacks", "schema_version": 2, ' + body + b"}"
    else:
        data = b'{"schema": "dynprof.stacks", "schema_version": 2, "%s": [' % where.encode()
        data += b",".join([value] * 12_000) + b"]}"
    assert len(data) > 60_000_000
    fh = _Counting(data)
    # WHEN it is read
    with pytest.raises(ArtifactError, match=f"nested deeper than {model.MAX_DOCUMENT_DEPTH} levels: refused"):
        read_document(fh)
    # THEN it was refused with the reason after its first few MB, not read to the end
    assert fh.read_bytes < 4 << 20


def test_a_small_deeply_nested_file_is_refused_before_it_is_decoded(monkeypatch: Any) -> None:
    # GIVEN a file small enough to be parsed at once, of rows nested 30 levels deep
    row = b"[" * 30 + b"0" + b"]" * 30
    data = b'{"schema": "dynprof.stacks", "schema_version": 2, "processes": [' + b",".join([row] * 5000) + b"]}"
    assert len(data) <= model.SMALL_FILE_BYTES

    def no_parse(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("decoded")

    monkeypatch.setattr(json, "loads", no_parse)
    # WHEN it is read THEN it is refused with the reason, never decoded
    with pytest.raises(ArtifactError, match="nested deeper than 16 levels: refused"):
        read_document(io.BytesIO(data))


def test_a_document_as_dynprof_writes_it_is_within_the_depth() -> None:
    # GIVEN a document with every level a document has (locals included), over the size parsed at once
    frames = [{**_frame(i), "locals": {"x": "1"}} for i in range(40)]
    doc = {**V2, "processes": [_row(pid, frames) for pid in range(2000)], "failures": {"node a": "why"}}
    data = json.dumps(doc).encode()
    # THEN it is read whole, as a file and parsed
    assert len(read_document(io.BytesIO(data)).processes) == 2000 == len(from_json(doc).processes)


def _depth(value: Any) -> int:
    if isinstance(value, dict):
        return 1 + max((_depth(v) for v in value.values()), default=0)
    if isinstance(value, list):
        return 1 + max((_depth(v) for v in value), default=0)
    return 0


def test_the_depth_read_from_the_text_is_the_decoded_depth() -> None:
    import random

    from dynprof.untrusted import text_depth

    # GIVEN documents whose strings hold brackets, quotes and backslashes (a repr in a local)
    rng = random.Random(7)
    texts = ["a[", "]}", '"\\[', "\\", '"', "{[", "", "x"]

    def make(depth: int) -> Any:
        pick = rng.random()
        if depth > 12 or pick < 0.3:
            return rng.choice([*texts, 1, None])
        if pick < 0.65:
            return [make(depth + 1) for _ in range(rng.randint(0, 3))]
        return {rng.choice(texts) + str(i): make(depth + 1) for i in range(rng.randint(0, 3))}

    docs = [d for d in (make(0) for _ in range(2000)) if isinstance(d, (dict, list))]
    assert len(docs) > 500 and max(_depth(d) for d in docs) > 8
    # THEN the depth read from each one's text, strings skipped, is the depth it decodes to
    for doc in docs:
        text = json.dumps(doc)
        assert text_depth(text) == (_depth(doc), True), text
        # and the text after a value (its siblings, its parents' brackets) does not count
        assert text_depth(text + ', "]]" ]]]' + "[" * 50) == (_depth(doc), True)
    # and a value cut at the end of the text is as deep as what is there
    assert text_depth('[[["]]]", [[') == (5, False)
