"""collectors.memory.reader: snapshot pickles read back as untrusted input.

Only plain data is unpickled (no class reference runs), the size and the memory that reading
takes are bounded, and every failure is an ArtifactError that says what is wrong with the file.
"""

from __future__ import annotations

import collections
import io
import json
import os
import pickle
import resource
import threading
from pathlib import Path

import pytest

from collectors.memory import SNAPSHOT_FILE, SUMMARY_FILE, reader
from collectors.memory.reader import (
    MAX_SNAPSHOT_BYTES,
    load_artifact_snapshot,
    load_snapshot,
    max_snapshot_bytes,
    parse_snapshot,
    read_snapshot_file,
    read_summary,
)
from collectors.memory.summary import summarize_snapshot
from dynprof.errors import ArtifactError
from dynprof.store import Artifact, ArtifactStore

DATA = Path(__file__).resolve().parent.parent / "data"
REAL = DATA / "memory_oom_artifact"
MB = 1 << 20


def snapshot(**extra: object) -> dict:
    return {
        "segments": [
            {
                "device": 0,
                "address": 0x7F0000000000,
                "total_size": 2 * MB,
                "stream": 0,
                "segment_type": "large",
                "blocks": [{"address": 0x7F0000000000, "size": 2 * MB, "state": "active_allocated", "frames": []}],
            }
        ],
        "device_traces": [[]],
        **extra,
    }


@pytest.fixture
def slow_path(monkeypatch):
    """The pure-Python unpickler: what runs where the address space cannot be capped."""
    monkeypatch.setattr(reader.threading, "active_count", lambda: 2)


# -- the size limit -------------------------------------------------------------------------------
def test_the_size_limit_is_4_gib_unless_the_environment_says(monkeypatch):
    monkeypatch.delenv("DYNPROF_MAX_SNAPSHOT_BYTES", raising=False)
    assert max_snapshot_bytes() == MAX_SNAPSHOT_BYTES == 4 << 30
    monkeypatch.setenv("DYNPROF_MAX_SNAPSHOT_BYTES", "")
    assert max_snapshot_bytes() == MAX_SNAPSHOT_BYTES
    monkeypatch.setenv("DYNPROF_MAX_SNAPSHOT_BYTES", "64K")
    assert max_snapshot_bytes() == 64 * 1024
    monkeypatch.setenv("DYNPROF_MAX_SNAPSHOT_BYTES", "0")
    assert max_snapshot_bytes() == 1  # never 0: a cap of nothing refuses every file, clearly
    monkeypatch.setenv("DYNPROF_MAX_SNAPSHOT_BYTES", "lots")
    with pytest.raises(ArtifactError, match="cannot read size 'lots'"):
        max_snapshot_bytes()


def test_a_file_over_the_limit_is_refused_before_it_is_read(tmp_path, monkeypatch):
    path = tmp_path / "big.pickle"
    path.write_bytes(pickle.dumps(snapshot(), protocol=4))
    monkeypatch.setenv("DYNPROF_MAX_SNAPSHOT_BYTES", "100")
    with pytest.raises(ArtifactError, match=r"is \d+ bytes, over the 100-byte limit: refused") as refused:
        load_snapshot(path)
    assert "DYNPROF_MAX_SNAPSHOT_BYTES" in refused.value.help


def test_a_file_that_grew_past_the_limit_while_read_is_refused(tmp_path, monkeypatch):
    # GIVEN a file whose size, when looked at, was under the limit (it grows while read)
    path = tmp_path / "growing.pickle"
    path.write_bytes(b"\x80" * 200)
    monkeypatch.setenv("DYNPROF_MAX_SNAPSHOT_BYTES", "100")
    real_fstat = os.fstat

    def fstat(fd: int) -> os.stat_result:
        st = real_fstat(fd)
        return os.stat_result((st.st_mode, st.st_ino, st.st_dev, st.st_nlink, st.st_uid, st.st_gid, 10, 0, 0, 0))

    monkeypatch.setattr(reader.os, "fstat", fstat)
    # THEN what was read is bounded all the same
    with pytest.raises(ArtifactError, match="is over the 100-byte limit: refused"):
        read_snapshot_file(path)


# -- files that are not there or not files ------------------------------------------------------------
def test_a_missing_path_a_directory_and_a_device_get_their_own_error(tmp_path):
    with pytest.raises(ArtifactError, match=r"nope\.pickle: no such file"):
        load_snapshot(tmp_path / "nope.pickle")
    with pytest.raises(ArtifactError, match=f"is a directory without a {SNAPSHOT_FILE}") as refused:
        load_snapshot(tmp_path)
    assert "dynprof ls --kind memory" in refused.value.help
    with pytest.raises(ArtifactError, match="/dev/null is not a regular file"):
        read_snapshot_file(Path("/dev/null"))


def test_an_unreadable_path_says_why(tmp_path):
    # a path through a file, not a directory: the OS's own reason
    (tmp_path / "f").write_text("x")
    with pytest.raises(ArtifactError, match=r"cannot read .*f/s\.pickle: .*Not a directory"):
        load_snapshot(tmp_path / "f" / "s.pickle")


# -- what a snapshot is ------------------------------------------------------------------------------
@pytest.mark.parametrize("protocol", [3, 4, 5])
def test_plain_data_round_trips_through_either_unpickler(tmp_path, monkeypatch, protocol):
    # a snapshot's values may come as the few builtin containers a pickle writes by reference
    snap = snapshot(
        allocator_settings=collections.OrderedDict(a=1),
        extra={"s": {1, 2}, "f": frozenset({3}), "c": complex(1, 2), "b": bytearray(b"ab"), "e": bytearray()},
    )
    data = pickle.dumps(snap, protocol=protocol)
    assert parse_snapshot(data) == snap  # the C unpickler where the process can cap itself
    monkeypatch.setattr(reader.threading, "active_count", lambda: 2)
    assert parse_snapshot(data) == snap  # the pure-Python one otherwise


@pytest.mark.parametrize("path", ["fast", "slow"])
def test_a_bytearray_of_a_string_and_its_encoding_is_read(monkeypatch, path):
    # what Python 2's pickles write: bytearray(u"ab", "latin-1")
    if path == "slow":
        monkeypatch.setattr(reader.threading, "active_count", lambda: 2)
    data = (
        b"\x80\x04}(\x8c\x08segments]\x8c\rdevice_traces]\x8c\x01b"
        b"cbuiltins\nbytearray\n\x8c\x02ab\x8c\x07latin-1\x86Ru."
    )
    assert parse_snapshot(data) == {"segments": [], "device_traces": [], "b": bytearray(b"ab")}


def test_the_real_snapshot_loads_from_its_file_and_from_its_artifact():
    from_file = load_snapshot(REAL / SNAPSHOT_FILE)
    from_artifact = load_artifact_snapshot(Artifact.load(REAL))
    assert from_file == from_artifact
    assert from_file["segments"] and isinstance(from_file["device_traces"], list)


@pytest.mark.parametrize(
    ("data", "said"),
    [
        (b"", "x.pickle is empty, not a PyTorch memory snapshot"),
        (b'{"segments": []}', "x.pickle is not a pickle"),
        (pickle.dumps({"a": 1, "b": 2}), "a pickle of a dict with keys ['a', 'b'], not a PyTorch memory snapshot"),
        (pickle.dumps([1, 2, 3]), "a pickle of a list, not a PyTorch memory snapshot"),
        (pickle.dumps({"segments": {}, "device_traces": []}), "a pickle of a dict with keys"),
        (pickle.dumps({"segments": [], "device_traces": None}), "(no 'segments' and 'device_traces')"),
    ],
)
def test_what_is_not_a_snapshot_is_named(data, said):
    with pytest.raises(ArtifactError) as refused:
        parse_snapshot(data, "x.pickle")
    assert said in refused.value.message
    assert "torch.cuda.memory._dump_snapshot()" in refused.value.help


def test_the_keys_named_of_a_foreign_dict_are_at_most_six():
    data = pickle.dumps({f"k{i:02d}": i for i in range(50)})
    with pytest.raises(ArtifactError) as refused:
        parse_snapshot(data)
    assert "['k00', 'k01', 'k02', 'k03', 'k04', 'k05']" in refused.value.message
    assert "k06" not in refused.value.message


@pytest.mark.parametrize(
    ("cut", "path"),
    [(1, "fast"), (1, "slow"), (2, "fast"), (2, "slow"), (30, "fast"), (30, "slow"), (-1, "fast"), (-1, "slow")],
)
def test_a_truncated_pickle_is_said_to_be_cut_short(monkeypatch, cut, path):
    if path == "slow":
        monkeypatch.setattr(reader.threading, "active_count", lambda: 2)
    data = pickle.dumps(snapshot(), protocol=4)[:cut]
    with pytest.raises(ArtifactError, match=rf"is truncated \({len(data)} bytes\)") as refused:
        parse_snapshot(data, "cut.pickle")
    assert "capture again" in refused.value.help


@pytest.mark.parametrize(
    ("data", "said"),
    [
        # a class reference: refused before anything is called
        (b"\x80\x04cos\nsystem\n\x8c\x04echo\x85R.", "it refers to os.system"),
        (b"\x80\x04cbuiltins\neval\n\x8c\x011\x85R.", "it refers to builtins.eval"),
        (b"\x80\x04\x8c\x08builtins\x8c\x04exec\x93.", "it refers to builtins.exec"),
        # bytearray from a size would allocate what the file does not hold
        (b"\x80\x04cbuiltins\nbytearray\nJ\x00\xca\x9a;\x85R.", "calls bytearray() with a size"),
        (b"\x80\x04cbuiltins\nbytearray\nK\x01K\x02K\x03\x87R.", "calls bytearray() with a size"),
        # a persistent id names an object outside the file
        (b"\x80\x04\x8c\x03pid\x94Q.", "it holds a persistent id"),
    ],
)
@pytest.mark.parametrize("path", ["fast", "slow"])
def test_a_pickle_that_would_call_anything_is_refused_unrun(monkeypatch, data, said, path):
    if path == "slow":
        monkeypatch.setattr(reader.threading, "active_count", lambda: 2)
    with pytest.raises(ArtifactError) as refused:
        parse_snapshot(data, "evil.pickle")
    assert refused.value.message.startswith("evil.pickle is not a PyTorch memory snapshot: ")
    assert said in refused.value.message


def test_a_pickle_naming_a_huge_memo_index_is_read_without_allocating_for_it(slow_path):
    # LONG_BINPUT 2**31-1: the C unpickler would size its memo array from it
    data = b"\x80\x04]r\xff\xff\xff\x7f."
    got = reader._unpickle(data)
    assert got == []


@pytest.mark.parametrize(
    ("raised", "said"),
    [
        (RecursionError(), "nests too deeply to be a PyTorch memory snapshot"),
        (MemoryError(), "not enough memory to read it"),
        (ValueError("bad opcode"), "is not a readable pickle: ValueError: bad opcode"),
        (pickle.UnpicklingError("pickle exhausted before end of frame"), "is truncated"),
    ],
)
def test_every_failure_of_the_unpickler_is_an_artifact_error(monkeypatch, raised, said):
    def fail(data: bytes) -> object:
        raise raised

    monkeypatch.setattr(reader, "_unpickle", fail)
    with pytest.raises(ArtifactError, match=said):
        parse_snapshot(b"\x80\x04.", "s.pickle")


# -- the memory budget ---------------------------------------------------------------------------------
def test_the_pure_python_unpickler_stops_when_the_process_grows_past_its_budget(slow_path, monkeypatch):
    # GIVEN a process that (as its RSS says) grows by 1 GiB at each check, checked every 64 opcodes
    grown = iter(range(1 << 30, 1 << 40, 1 << 30))
    monkeypatch.setattr(reader, "_resident_bytes", lambda: next(grown))
    monkeypatch.setattr(reader, "_CHECK_EVERY", 64)
    data = pickle.dumps({"segments": [{} for _ in range(200)], "device_traces": []}, protocol=4)
    # WHEN it is read, THEN reading stops, with the budget in the message
    with pytest.raises(ArtifactError, match=r"it needs more than 96 MiB of memory to load"):
        parse_snapshot(data)


def test_the_budget_grows_with_the_file_and_is_not_checked_without_a_reading(slow_path, monkeypatch):
    unpickler = reader._SnapshotUnpickler(io.BytesIO(b""), size=10 * MB)
    assert unpickler._budget == 24 * 10 * MB
    assert reader._SnapshotUnpickler(io.BytesIO(b""), size=10)._budget == reader.MEMORY_GROWTH_MIN
    # no RSS to compare with (no /proc): never refused
    monkeypatch.setattr(reader, "_resident_bytes", lambda: 0)
    monkeypatch.setattr(reader, "_CHECK_EVERY", 1)
    assert parse_snapshot(pickle.dumps(snapshot(), protocol=4)) == snapshot()


def test_the_c_unpickler_running_out_of_its_address_space_is_a_clear_error(monkeypatch):
    import contextlib

    @contextlib.contextmanager
    def capped(extra: int):
        yield True

    class Exhausted(reader._FastSnapshotUnpickler):
        def load(self):
            raise MemoryError

    monkeypatch.setattr(reader, "_address_space_limit", capped)
    monkeypatch.setattr(reader, "_FastSnapshotUnpickler", Exhausted)
    with pytest.raises(ArtifactError, match="it needs more than 96 MiB of memory to load"):
        parse_snapshot(pickle.dumps(snapshot(), protocol=4))


def test_the_address_space_is_capped_only_on_the_main_thread_alone_and_restored(monkeypatch):
    before = resource.getrlimit(resource.RLIMIT_AS)
    monkeypatch.setattr(reader.threading, "active_count", lambda: 1)
    with reader._address_space_limit(1 << 40) as limited:
        assert limited
        soft, _hard = resource.getrlimit(resource.RLIMIT_AS)
        assert soft != resource.RLIM_INFINITY and soft > 1 << 40
    assert resource.getrlimit(resource.RLIMIT_AS) == before

    seen: list[bool] = []

    def other_thread() -> None:
        with reader._address_space_limit(1 << 40) as limited:
            seen.append(limited)

    worker = threading.Thread(target=other_thread)
    worker.start()
    worker.join(30)
    assert seen == [False]
    monkeypatch.setattr(reader.threading, "active_count", lambda: 2)
    with reader._address_space_limit(1 << 40) as limited:
        assert not limited
    assert resource.getrlimit(resource.RLIMIT_AS) == before


# -- an artifact's summary ---------------------------------------------------------------------------
def _artifact(tmp_path: Path, files: dict[str, bytes]) -> Artifact:
    writer = ArtifactStore(tmp_path / "store").create("memory", job="j", host="h", rank=0)
    for name, data in files.items():
        writer.write_bytes(name, data)
    return writer.finish("complete")


def test_the_summary_is_the_artifact_s_own_file_where_it_has_one(tmp_path):
    art = _artifact(tmp_path, {SUMMARY_FILE: json.dumps({"totals": {"x": 1}}).encode()})
    assert read_summary(art) == {"totals": {"x": 1}}
    assert read_summary(Artifact.load(REAL)) == json.loads((REAL / SUMMARY_FILE).read_text())


def test_a_summary_file_that_is_not_an_object_is_refused(tmp_path):
    art = _artifact(tmp_path, {SUMMARY_FILE: b"[1, 2]"})
    with pytest.raises(ArtifactError, match=f"{SUMMARY_FILE} of .* is not a JSON object"):
        read_summary(art)


def test_without_a_summary_file_it_is_computed_from_the_snapshot(tmp_path):
    art = _artifact(tmp_path, {SNAPSHOT_FILE: pickle.dumps(snapshot(), protocol=4)})
    assert read_summary(art) == summarize_snapshot(snapshot())


def test_an_artifact_s_snapshot_is_bounded_by_the_same_limit(tmp_path, monkeypatch):
    art = _artifact(tmp_path, {SNAPSHOT_FILE: pickle.dumps(snapshot(), protocol=4)})
    monkeypatch.setenv("DYNPROF_MAX_SNAPSHOT_BYTES", "64")
    with pytest.raises(ArtifactError):
        load_artifact_snapshot(art)
