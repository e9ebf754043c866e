"""Store files are untrusted input: crafted and generated stores against ls, show and the page.

Every case asserts that nothing escapes the artifact directory, no traceback (no exception
other than a DynprofError) reaches the user, and one bad artifact never hides the good ones.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import os
import pickle
import random
import struct
import zlib
from pathlib import Path

import pytest

from collectors.memory.reader import _SnapshotUnpickler, parse_snapshot
from collectors.stacks import load_processes
from collectors.torch_trace import summarize_file
from dynprof import untrusted
from dynprof.cli import main
from dynprof.errors import ArtifactError
from dynprof.sidecar.app import create_app
from dynprof.store import MANIFEST, ArtifactStore

SECRET = "dynprof-secret-" + hashlib.sha256(b"outside the store").hexdigest()[:16]


def good_artifact(store: ArtifactStore, text: str = "hello") -> Path:
    w = store.create("healthcheck", job="good", host="h")
    w.write_text("notes.txt", text)
    return w.finish("complete").path


def crafted_dir(store: ArtifactStore, name: str) -> Path:
    d = store.root / "bad" / "h" / "node" / "trace" / name
    d.mkdir(parents=True)
    return d


def manifest_for(files: list[dict[str, object]] | None = None, **fields: object) -> dict[str, object]:
    m: dict[str, object] = {
        "schema": "dynprof.artifact",
        "schema_version": 1,
        "kind": "trace",
        "status": "complete",
        "job": "bad",
        "host": "h",
        "rank": None,
        "pid": 1,
        "created_at": "2026-01-01T00:00:00.000Z",
        "finished_at": "2026-01-01T00:00:01.000Z",
        "options": {},
        "files": files or [],
        "summary": {},
        "error": None,
    }
    m.update(fields)
    return m


def nested(depth: int) -> str:
    return "[" * depth + "]" * depth


# (case name, manifest.json content: bytes, or a callable that builds the directory)
BAD_MANIFESTS: list[tuple[str, object]] = [
    ("json-array", b"[1, 2, 3]"),
    ("json-string", b'"dynprof.artifact"'),
    ("not-json", b"{nope"),
    ("empty", b""),
    ("invalid-utf8", b'{"schema": "\xff\xfe"}'),
    ("deep-nesting", ('{"schema": "dynprof.artifact", "x": ' + nested(100_000) + "}").encode()),
    ("depth-100", ('{"schema": "dynprof.artifact", "options": ' + nested(100) + "}").encode()),
    ("missing-files", json.dumps({k: v for k, v in manifest_for().items() if k != "files"}).encode()),
    ("missing-kind", json.dumps({k: v for k, v in manifest_for().items() if k != "kind"}).encode()),
    ("files-a-dict", json.dumps(manifest_for(files={"a": 1})).encode()),  # type: ignore[arg-type]
    ("files-entry-string", json.dumps(manifest_for(files=["trace.json.gz"])).encode()),  # type: ignore[list-item]
    ("file-size-string", json.dumps(manifest_for(files=[{"name": "a", "size": "1", "sha256": "x"}])).encode()),
    ("file-size-negative", json.dumps(manifest_for(files=[{"name": "a", "size": -1, "sha256": "x"}])).encode()),
    ("file-size-bool", json.dumps(manifest_for(files=[{"name": "a", "size": True, "sha256": "x"}])).encode()),
    ("file-no-sha", json.dumps(manifest_for(files=[{"name": "a", "size": 1}])).encode()),
    (
        "file-name-etc-passwd",
        json.dumps(manifest_for(files=[{"name": "/etc/passwd", "size": 1, "sha256": "x"}])).encode(),
    ),
    ("file-name-dotdot", json.dumps(manifest_for(files=[{"name": "../../secret", "size": 1, "sha256": "x"}])).encode()),
    ("file-name-int", json.dumps(manifest_for(files=[{"name": 7, "size": 1, "sha256": "x"}])).encode()),
    ("kind-a-list", json.dumps(manifest_for(kind=["trace"])).encode()),
    ("kind-5000-chars", json.dumps(manifest_for(kind="k" * 5000)).encode()),
    ("status-null", json.dumps(manifest_for(status=None)).encode()),
    ("rank-a-string", json.dumps(manifest_for(rank="0")).encode()),
    ("pid-a-float", json.dumps(manifest_for(pid=1.5)).encode()),
    ("options-a-list", json.dumps(manifest_for(options=[1])).encode()),
    ("created-at-int", json.dumps(manifest_for(created_at=5)).encode()),
    ("wrong-schema", json.dumps(manifest_for(schema="other")).encode()),
    ("too-large", b'{"schema": "dynprof.artifact", "pad": "' + b"x" * (2 << 20) + b'"}'),
]


def build_bad_store(store: ArtifactStore, outside: Path) -> list[str]:
    names = []
    for name, content in BAD_MANIFESTS:
        d = crafted_dir(store, name)
        assert isinstance(content, bytes)
        (d / MANIFEST).write_bytes(content)
        names.append(name)
    # a directory in place of the manifest, a FIFO, a link to a file outside
    (crafted_dir(store, "manifest-a-directory") / MANIFEST).mkdir()
    os.mkfifo(crafted_dir(store, "manifest-a-fifo") / MANIFEST)
    (crafted_dir(store, "manifest-a-symlink") / MANIFEST).symlink_to(outside / "manifest.json")
    # an artifact directory that is a link to a directory outside the store
    (store.root / "bad" / "h" / "node" / "trace" / "dir-symlink").symlink_to(outside)
    names += ["manifest-a-directory", "manifest-a-fifo", "manifest-a-symlink", "dir-symlink"]
    return names


@pytest.fixture
def outside(tmp_path: Path) -> Path:
    """A directory outside the store holding a secret and a manifest that looks valid."""
    d = tmp_path / "outside"
    d.mkdir()
    (d / "secret.txt").write_text(SECRET + "\n")
    data = (SECRET + "\n").encode()
    files = [{"name": "secret.txt", "size": len(data), "sha256": hashlib.sha256(data).hexdigest()}]
    (d / "manifest.json").write_text(json.dumps(manifest_for(files=files)))
    return d


def test_bad_manifests_are_reported_and_skipped_by_ls_show_and_the_page(capsys, dynprof_dirs, outside):
    # GIVEN a store with one good artifact and one of each kind of damaged manifest
    store = ArtifactStore()
    good = good_artifact(store)
    bad = build_bad_store(store, outside)

    # WHEN it is listed
    arts, found_bad = store.scan()

    # THEN the good one is listed, every bad one is reported (none silently escapes), none raises
    assert [a.path for a in arts] == [good]
    assert sorted(Path(b.path).name for b in found_bad) == sorted(bad)
    assert all(b.reason for b in found_bad)
    assert main(["ls"]) == 0
    out, err = capsys.readouterr()
    assert store.list()[0].id in out and err.count("dynprof: skipped") == len(bad)
    assert main(["ls", "--json"]) == 0
    listing = json.loads(capsys.readouterr().out)
    assert len(listing["artifacts"]) == 1 and len(listing["bad"]) == len(bad)

    # AND show of each bad one is a clean error, the entry that links elsewhere too (inside
    # the store nothing is read through a link, named by its path or its id); the good one
    # still shows.
    for name in bad:
        code = main(["show", str(store.root / "bad" / "h" / "node" / "trace" / name)])
        assert code == 1, name
        out, err = capsys.readouterr()
        assert "error" in err and SECRET not in out + err
    assert main(["show", good.name]) == 0
    assert "notes.txt" in capsys.readouterr().out

    # AND the page and the API answer (no 500), listing the damaged ones apart
    client = create_app(store).test_client()
    page = client.get("/")
    assert page.status_code == 200 and "Damaged" in page.get_data(as_text=True)
    api = client.get("/api/artifacts").get_json()
    assert len(api["artifacts"]) == 1 and len(api["bad"]) == len(bad)
    for name in bad:
        r = client.get(f"/api/artifacts/bad/h/node/trace/{name}")
        assert r.status_code == 404, name
        assert SECRET not in r.get_data(as_text=True)


def test_a_5000_character_id_and_odd_refs_are_clean_errors(capsys, dynprof_dirs):
    store = ArtifactStore()
    good_artifact(store)
    client = create_app(store).test_client()
    for ref in ("x" * 5000, "a/" * 2500, "%00", "..", "/", "~", "x\x00y", "." * 300):
        assert main(["show", ref]) == 1
        _, err = capsys.readouterr()
        assert "Traceback" not in err and "error" in err
        assert client.get(f"/api/artifacts/{ref}").status_code in (404, 308)
        assert client.get(f"/artifact/{ref}").status_code in (404, 308)


def test_generated_manifests_never_break_a_listing(capsys, dynprof_dirs):
    # GIVEN 300 manifests mutated at random from a valid one (seeded: the same every run)
    rng = random.Random(20261130)
    store = ArtifactStore()
    good = good_artifact(store)
    valid = json.dumps(manifest_for(files=[{"name": "a.txt", "size": 1, "sha256": "0" * 64}])).encode()
    values: list[object] = [None, True, -1, 2**70, 1.5, float("inf"), "", "x" * 300, [], [1], {}, {"a": {}}]
    tried = 0
    for i in range(300):
        kind = i % 3
        if kind == 0:  # a field replaced by a value of another type
            m = json.loads(valid)
            key = rng.choice(list(m))
            m[key] = rng.choice(values)
            data = json.dumps(m).encode()
        elif kind == 1:  # truncated
            data = valid[: rng.randrange(len(valid))]
        else:  # random bytes flipped
            b = bytearray(valid)
            for _ in range(rng.randint(1, 8)):
                b[rng.randrange(len(b))] = rng.randrange(256)
            data = bytes(b)
        d = crafted_dir(store, f"gen{i}")
        (d / MANIFEST).write_bytes(data)
        (d / "a.txt").write_text("a")
        tried += 1

    # WHEN the store is listed and every artifact shown
    arts, bad = store.scan()
    assert good in [a.path for a in arts]
    assert len(arts) + len(bad) == tried + 1
    client = create_app(store).test_client()
    assert client.get("/").status_code == 200
    assert client.get("/api/artifacts").status_code == 200
    for art in arts:
        # THEN each one that loads also shows (exit 0 or 1, never a traceback) and renders
        assert main(["show", str(art.path), "--verify"]) in (0, 1)
        capsys.readouterr()
        assert client.get(f"/api/artifacts/{art.id}").status_code == 200
        assert client.get(f"/artifact/{art.id}").status_code == 200


def test_stacks_entries_naming_files_outside_are_refused(capsys, dynprof_dirs, outside):
    proc = {
        "schema": "dynprof.stacks.process",
        "schema_version": 2,
        "pid": 1,
        "method": "agent",
        "threads": [{"tid": 1, "frames": [{"function": "f", "file": "x.py"}]}],
    }
    (outside / "secret.json").write_text(json.dumps({**proc, "notes": [SECRET]}))
    store = ArtifactStore()
    for absolute in (False, True):
        # GIVEN a stacks artifact whose merged.json names a file outside (../../.. or absolute)
        w = store.create("stacks", job="j")
        w.write_json("rank0-pid1.json", proc)
        stem = str(outside / "secret") if absolute else os.path.relpath(outside / "secret", w.final_path)
        w.write_json(
            "merged.json", {"schema": "dynprof.stacks", "schema_version": 2, "processes": [{"pid": 1, "file": stem}]}
        )
        art = w.finish("complete")
        assert (art.path / f"{stem}.json").exists()  # the entry does lead to the secret

        # WHEN it is loaded and shown
        with pytest.raises(ArtifactError, match="refused file name"):
            load_processes(art.path)
        assert main(["show", art.id]) == 0

        # THEN the outside file was not rendered
        out = capsys.readouterr().out
        assert SECRET not in out and "cannot summarise" in out


def test_links_in_an_artifact_are_not_followed_by_show_verify_or_the_page(capsys, dynprof_dirs, outside):
    # GIVEN an artifact whose listed file is replaced by a link to a secret outside the store,
    # and whose manifest claims the secret's size and checksum
    store = ArtifactStore()
    w = store.create("trace", job="j")
    w.write_bytes("trace.json.gz", gzip.compress(b'{"traceEvents": []}'))
    art = w.finish("complete")
    target = outside / "secret.txt"
    (art.path / "trace.json.gz").unlink()
    (art.path / "trace.json.gz").symlink_to(target)
    m = json.loads((art.path / MANIFEST).read_text())
    data = target.read_bytes()
    m["files"] = [{"name": "trace.json.gz", "size": len(data), "sha256": hashlib.sha256(data).hexdigest()}]
    (art.path / MANIFEST).write_text(json.dumps(m))

    # WHEN it is verified, shown and downloaded
    assert main(["show", art.path.name, "--verify"]) == 1
    out = capsys.readouterr().out
    r = create_app(store).test_client().get(f"/api/artifacts/{art.id}/files/trace.json.gz")

    # THEN the link is refused, not followed
    assert "symbolic link: refused" in out and SECRET not in out
    assert r.status_code == 404 and SECRET.encode() not in r.data


def test_verify_reports_a_directory_in_place_of_a_file(capsys, dynprof_dirs):
    store = ArtifactStore()
    w = store.create("trace", job="j")
    w.write_text("a.txt", "abc")
    art = w.finish("complete")
    (art.path / "a.txt").unlink()
    (art.path / "a.txt").mkdir()
    assert art.verify() == [f"a.txt: a.txt in {art.path} is not a regular file: refused"]
    assert main(["show", art.path.name, "--verify"]) == 1
    assert "not a regular file" in capsys.readouterr().out


# -- bombs ---------------------------------------------------------------------------------------
def spaces_gzip(prefix: bytes, mib: int, suffix: bytes) -> bytes:
    """A gzip member of prefix + MIB MiB of spaces + suffix, built by repeating one compressed
    block (back-references to spaces decode to spaces whatever precedes them)."""
    co = zlib.compressobj(9, zlib.DEFLATED, -15)
    head = co.compress(prefix) + co.flush(zlib.Z_SYNC_FLUSH)
    block_co = zlib.compressobj(9, zlib.DEFLATED, -15)
    block = block_co.compress(b" " * (1 << 20)) + block_co.flush(zlib.Z_SYNC_FLUSH)
    tail_co = zlib.compressobj(9, zlib.DEFLATED, -15)
    tail = tail_co.compress(suffix) + tail_co.flush()
    crc = zlib.crc32(prefix)
    chunk = b" " * (1 << 20)
    for _ in range(mib):
        crc = zlib.crc32(chunk, crc)
    crc = zlib.crc32(suffix, crc)
    size = (len(prefix) + (mib << 20) + len(suffix)) & 0xFFFFFFFF
    header = b"\x1f\x8b\x08\x00\x00\x00\x00\x00\x02\xff"
    return header + head + block * mib + tail + struct.pack("<II", crc, size)


def test_the_spaces_bomb_is_a_valid_gzip_file():
    data = spaces_gzip(b'{"traceEvents": [', 3, b"]}")
    assert gzip.decompress(data) == b'{"traceEvents": [' + b" " * (3 << 20) + b"]}"


def test_a_gzip_bomb_is_refused_at_the_cap(monkeypatch):
    # GIVEN a 1 MiB gzip file that inflates to 1 GiB, and a 64 MiB cap
    bomb = spaces_gzip(b'{"traceEvents": [', 1024, b"]}")
    assert len(bomb) < 2 << 20
    monkeypatch.setenv("DYNPROF_MAX_TRACE_BYTES", "64M")
    # WHEN it is summarised THEN it is refused, having inflated no more than the cap
    with pytest.raises(ArtifactError, match="inflates to more than 67108864 bytes"):
        summarize_file(io.BytesIO(bomb), "bomb")


@pytest.mark.parametrize(
    ("doc", "message"),
    [
        (b'{"traceEvents": [' + b"[" * 100_000, "nested deeper than 64 levels|malformed|over"),
        (b'{"traceEvents": [{"ph": "X", "name": "' + b"a" * (20 << 20) + b'"}]}', "over 16777216 characters"),
        (b'{"traceEvents": [1, 2', "malformed"),
        (b"\x00" * 1000, "expected '{'"),
        (b'{"deviceProperties": ' + nested(5000).encode() + b"}", "nested"),
        (b'{"traceEvents": 5} trailing', "unexpected data"),
    ],
)
def test_malformed_traces_are_clean_errors(doc, message):
    with pytest.raises(ArtifactError, match=message):
        summarize_file(io.BytesIO(gzip.compress(doc, 1)), "t")


def test_odd_but_valid_traces_are_summarised():
    # events of the wrong types are skipped, numbers of any size do not break the tally
    doc = {
        "traceEvents": [
            1,
            "x",
            None,
            {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "dur": 2**80},
            {"ph": "X", "cat": "kernel", "name": ["k"], "dur": "fast"},
            {"ph": "X", "name": "ProfilerStep#1", "dur": 1000, "ts": "soon"},
        ],
        "distributedInfo": {"rank": 0},
    }
    summary = summarize_file(io.BytesIO(json.dumps(doc).encode()))
    assert summary["events"] == 3 and summary["steps"] == [{"name": "ProfilerStep#1", "dur_ms": 1.0}]
    assert summary["gpu_kernel_count"] == 1 and summary["distributed_info"] == {"rank": 0}


def bytearray_bomb() -> bytes:
    """43 bytes: bytearray(1 << 33) through the allowed builtins.bytearray."""
    return b"\x80\x04\x95\x00\x00\x00\x00\x00\x00\x00\x00\x8c\x08builtins\x8c\tbytearray\x93\x8a\x05\x00\x00\x00\x00\x02\x85R."


def memo_bomb() -> bytes:
    """9 bytes: LONG_BINPUT at index 2**26, which makes the C unpickler allocate 1 GiB."""
    return b"\x80\x04Nr" + struct.pack("<I", 1 << 26) + b"."


def test_pickle_bombs_are_refused_cleanly(tmp_path, capsys):
    # The bytearray bomb is refused before allocating
    with pytest.raises(ArtifactError, match="bytearray"):
        parse_snapshot(bytearray_bomb(), "bomb")
    path = tmp_path / "bomb.pickle"
    path.write_bytes(bytearray_bomb())
    assert main(["memory-report", str(path), "--no-html"]) == 1
    assert "bytearray" in capsys.readouterr().err
    # The memo bomb costs a dict entry, not a gigabyte (and is not a snapshot)
    with pytest.raises(ArtifactError, match="not a PyTorch memory snapshot"):
        parse_snapshot(memo_bomb(), "memo")
    # bytearray from bytes (what pickle writes for a real bytearray) still loads
    assert _SnapshotUnpickler(io.BytesIO(pickle.dumps(bytearray(b"abc"), protocol=4))).load() == b"abc"


def dict_bomb(n: int = 4 << 20) -> bytes:
    """4 MiB: a list of 4 Mi empty dicts, one opcode each (about 300 MB once loaded)."""
    return b"\x80\x04](" + b"}" * n + b"e."


@pytest.mark.parametrize("in_thread", [False, True], ids=["C-unpickler-with-rlimit", "pure-python-with-rss-checks"])
def test_amplifying_pickles_are_refused_at_the_memory_budget(in_thread):
    # GIVEN bombs that would take far more memory than their size; in the main thread (the C
    # unpickler under an address-space cap) and in a worker thread (the pure-Python unpickler)
    import threading

    results: dict[str, str] = {}

    def load_all() -> None:
        cases = (
            ("dict", dict_bomb()),
            ("memo", memo_bomb()),
            ("bytearray", bytearray_bomb()),
            ("code", pickle.dumps(os.getcwd, protocol=4)),
        )
        for name, bomb in cases:
            try:
                parse_snapshot(bomb, name)
                results[name] = "loaded"
            except ArtifactError as exc:
                results[name] = exc.message

    if in_thread:
        t = threading.Thread(target=load_all)
        t.start()
        t.join()
    else:
        load_all()
    # THEN each is refused with a reason, and nothing else escapes
    assert "needs more than 96 MiB" in results["dict"]
    assert "not a PyTorch memory snapshot" in results["memo"]
    assert "bytearray" in results["bytearray"]
    assert "refers to posix.getcwd" in results["code"]


def test_json_with_too_many_values_is_refused(tmp_path):
    (tmp_path / "many.json").write_bytes(b"[" + b"{}," * 1_000_001 + b"{}]")
    with pytest.raises(ArtifactError, match="over 1000000 JSON values"):
        untrusted.read_json_in(tmp_path, "many.json")


def test_ill_typed_snapshot_contents_are_clean_errors(tmp_path, capsys):
    for obj in (
        {"segments": [1, 2], "device_traces": []},
        {"segments": [{"blocks": "x", "total_size": "big"}], "device_traces": [[1]]},
        {"segments": [], "device_traces": [{"x": 1}]},
    ):
        path = tmp_path / "odd.pickle"
        path.write_bytes(pickle.dumps(obj, protocol=4))
        assert main(["memory-report", str(path), "--no-html"]) in (0, 1)
        err = capsys.readouterr().err
        assert "Traceback" not in err


def test_safe_open_refuses_names_links_and_special_files(tmp_path):
    (tmp_path / "f").write_text("x")
    (tmp_path / "l").symlink_to(tmp_path / "f")
    os.mkfifo(tmp_path / "p")
    assert untrusted.read_bytes_in(tmp_path, "f", 10) == b"x"
    for name, message in (
        ("l", "symbolic link"),
        ("p", "not a regular file"),
        ("../f", "refused file name"),
        ("/etc/passwd", "refused file name"),
        ("..", "refused file name"),
        ("nope", "no such file"),
    ):
        with pytest.raises(ArtifactError, match=message):
            untrusted.read_bytes_in(tmp_path, name, 10)
    with pytest.raises(ArtifactError, match="over the 0-byte limit"):
        untrusted.read_bytes_in(tmp_path, "f", 0)


def test_a_gzip_bomb_is_refused_by_its_compression_ratio_long_before_the_cap():
    # GIVEN a 4 MiB gzip file that inflates to 4 GiB (far over the default 2 GiB cap)
    bomb = spaces_gzip(b'{"traceEvents": [', 4096, b"]}")
    assert len(bomb) < 5 << 20

    # WHEN it is summarised
    with pytest.raises(ArtifactError) as refused:
        summarize_file(io.BytesIO(bomb), "bomb")

    # THEN the refusal names the ratio, not the size cap
    assert "compression ratio" in refused.value.message and "inflates to more than" not in refused.value.message


def test_a_trace_that_compresses_well_but_plausibly_is_read_whole():
    # GIVEN a trace with repetitive events, well compressed (as real traces are)
    events = [{"ph": "X", "name": f"aten::op{i % 7}", "ts": i, "dur": 1, "pid": 1, "tid": 1} for i in range(200_000)]
    data = gzip.compress(json.dumps({"traceEvents": events}).encode(), 9)

    # WHEN it is summarised THEN every event is read
    summary = summarize_file(io.BytesIO(data), "t")
    assert summary["events"] == 200_000


def test_analyze_refuses_a_gzip_bomb_by_its_compression_ratio(tmp_path):
    from collectors.trace_analysis.reader import TraceError, iter_trace

    # GIVEN a trace file that is a 4 MiB gzip bomb
    path = tmp_path / "trace.json.gz"
    path.write_bytes(spaces_gzip(b'{"traceEvents": [', 4096, b"]}"))

    # WHEN it is read for analysis THEN it is refused for its ratio, as a trace error
    with pytest.raises(TraceError, match="compression ratio"):
        list(iter_trace(path))
