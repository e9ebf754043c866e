"""dynprof.cli.memory_report: `dynprof memory-report` on a snapshot pickle, a directory or a memory
artifact; where the HTML goes, --torch-viz, the text, and the clean errors of every kind of bad
input (no such file, another kind of artifact, a failed capture, a malformed snapshot, a path it
cannot write)."""

from __future__ import annotations

import json
import pickle
import sys
import types
from pathlib import Path

import pytest

from collectors.memory import SNAPSHOT_FILE, SUMMARY_FILE
from dynprof import errors
from dynprof.cli import main
from dynprof.cli import memory_report as report_cli
from dynprof.store import ArtifactStore

MB = 1 << 20
FRAMES = [{"filename": "/home/u/train.py", "line": 40, "name": "step"}]


def snapshot(history: bool = True, frame_name: str = "step") -> dict:
    frames = [{"filename": "/home/u/train.py", "line": 40, "name": frame_name}] if history else []
    return {
        "segments": [
            {
                "device": 0,
                "address": 0x7F0000000000,
                "total_size": 4 * MB,
                "stream": 0,
                "segment_type": "large",
                "blocks": [
                    {
                        "address": 0x7F0000000000,
                        "size": 3 * MB,
                        "requested_size": 3 * MB,
                        "state": "active_allocated",
                        "frames": frames,
                    },
                    {"address": 0x7F0000300000, "size": MB, "requested_size": MB, "state": "inactive", "frames": []},
                ],
            }
        ],
        "device_traces": [
            [{"action": "alloc", "addr": 0x7F0000000000, "size": 3 * MB, "stream": 0, "frames": frames}]
            if history
            else []
        ],
    }


def write_pickle(path: Path, snap: dict | None = None) -> Path:
    path.write_bytes(pickle.dumps(snapshot() if snap is None else snap, protocol=4))
    return path


def memory_artifact(summary: object = None, status: str = "complete", kind: str = "memory"):
    writer = ArtifactStore().create(kind, job="j", rank=0)
    writer.write_bytes(SNAPSHOT_FILE, pickle.dumps(snapshot(), protocol=4))
    if summary is not None:
        writer.write_text(SUMMARY_FILE, json.dumps(summary))
    return writer.finish(status, error="CUDA error: boom" if status == "failed" else None)


# -- a pickle ---------------------------------------------------------------------------------------
def test_a_pickle_is_summarised_and_its_html_written_here_by_default(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    path = write_pickle(tmp_path / "dump.pickle")
    assert main(["memory-report", str(path)]) == 0
    out = capsys.readouterr().out
    html = tmp_path / "memory-report-dump.html"
    assert html.is_file() and f"HTML report: {html}" in out
    assert "/home/u/train.py:40 in step" in out
    assert "no allocation history" not in out and "interactive viewer" not in out
    page = html.read_text()
    assert "CUDA memory: dump" in page and 'download="snapshot.pickle"' in page


def test_json_names_the_source_and_the_files_written(tmp_path, capsys):
    path = write_pickle(tmp_path / "dump.pickle")
    out = tmp_path / "r.html"
    assert main(["memory-report", str(path), "-o", str(out), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert set(doc) == {"source", "html", "torch_viz", "summary"}
    assert doc["source"] == str(path) and doc["html"] == str(out) and doc["torch_viz"] is None
    assert doc["summary"]["totals"]["allocated_bytes"] == 3 * MB
    assert out.is_file()


def test_no_html_writes_nothing(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    path = write_pickle(tmp_path / "dump.pickle")
    assert main(["memory-report", str(path), "--no-html"]) == 0
    assert "HTML report" not in capsys.readouterr().out
    assert not list(tmp_path.glob("*.html"))


def test_a_big_pickle_is_not_embedded_in_the_page(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(report_cli, "EMBED_PICKLE_MAX", 10)
    path = write_pickle(tmp_path / "dump.pickle")
    out = tmp_path / "r.html"
    assert main(["memory-report", str(path), "-o", str(out)]) == 0
    assert 'download="snapshot.pickle"' not in out.read_text()


def test_a_snapshot_without_history_says_so(tmp_path, capsys):
    path = write_pickle(tmp_path / "dump.pickle", snapshot(history=False))
    assert main(["memory-report", str(path), "--no-html"]) == 0
    assert "note: no allocation history or stacks in this snapshot" in capsys.readouterr().out


def test_frame_names_of_the_pickle_are_shown_escaped(tmp_path, capsys):
    path = write_pickle(tmp_path / "dump.pickle", snapshot(frame_name="evil\x1b[2J\nname"))
    assert main(["memory-report", str(path), "--no-html"]) == 0
    out = capsys.readouterr().out
    assert "\x1b" not in out and "evil\\x1b[2J" in out


def test_top_bounds_the_tables(tmp_path, capsys):
    path = write_pickle(tmp_path / "dump.pickle")
    assert main(["memory-report", str(path), "--no-html", "--json", "--top", "1"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert all(len(v) <= 1 for v in doc["summary"].values() if isinstance(v, list))


@pytest.mark.parametrize("top", ["0", "-1", "100001", "ten", "1e3"])
def test_a_bad_top_is_a_usage_error(tmp_path, top, capsys):
    path = write_pickle(tmp_path / "dump.pickle")
    with pytest.raises(SystemExit) as info:
        main(["memory-report", str(path), "--top", top])
    assert info.value.code == 2
    assert "--top" in capsys.readouterr().err


# -- a directory, an artifact -------------------------------------------------------------------------
def test_a_directory_with_a_snapshot_is_read(tmp_path, capsys):
    write_pickle(tmp_path / SNAPSHOT_FILE)
    assert main(["memory-report", str(tmp_path), "--no-html", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["source"] == str(tmp_path / SNAPSHOT_FILE)


def test_a_directory_without_a_snapshot_is_an_error(tmp_path, capsys):
    assert main(["memory-report", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert f"{tmp_path} is a directory without a {SNAPSHOT_FILE}" in err and "dynprof ls --kind memory" in err


def test_a_memory_artifact_by_id_adds_what_the_capture_knew(tmp_path, capsys):
    captured = {"trigger": "oom", "torch_version": "2.9", "device_memory": {"free": 1}, "unrelated": "x"}
    art = memory_artifact(summary=captured)
    out = tmp_path / "r.html"
    assert main(["memory-report", art.id, "-o", str(out), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["source"] == str(art.path / SNAPSHOT_FILE)
    summary = doc["summary"]
    assert summary["trigger"] == "oom" and summary["torch_version"] == "2.9" and summary["device_memory"] == {"free": 1}
    assert "unrelated" not in summary
    assert f"CUDA memory: {art.path.name}" in out.read_text()


def test_an_artifact_by_its_path_and_by_its_manifest(tmp_path, capsys):
    art = memory_artifact()
    for source in (str(art.path), str(art.path / "manifest.json")):
        assert main(["memory-report", source, "--no-html", "--json"]) == 0, capsys.readouterr().err
        assert json.loads(capsys.readouterr().out)["source"] == str(art.path / SNAPSHOT_FILE)


@pytest.mark.parametrize("summary", [["not", "a", "dict"], "text"])
def test_a_capture_summary_that_is_not_an_object_is_ignored(summary, capsys):
    art = memory_artifact(summary=summary)
    assert main(["memory-report", art.id, "--no-html", "--json"]) == 0
    assert "trigger" not in json.loads(capsys.readouterr().out)["summary"]


def test_an_artifact_of_another_kind_is_refused(capsys):
    art = memory_artifact(kind="trace")
    assert main(["memory-report", art.id, "--no-html"]) == 1
    err = capsys.readouterr().err
    assert "is a 'trace' artifact, not a memory snapshot" in err and "dynprof ls --kind memory" in err


def test_a_failed_capture_is_refused_with_its_error(capsys):
    art = memory_artifact(status="failed")
    assert main(["memory-report", art.id, "--no-html"]) == 1
    assert f"{art.path}: the capture failed (CUDA error: boom)" in capsys.readouterr().err


# -- bad input ------------------------------------------------------------------------------------------
def test_a_missing_path_is_no_such_file_or_artifact(tmp_path, capsys):
    assert main(["memory-report", str(tmp_path / "nope.pickle")]) == 1
    err = capsys.readouterr().err
    assert "nope.pickle: no such file or artifact" in err and "what to do:" in err


@pytest.mark.parametrize("source", ["x" * 5000, "a\0b", "/" + "d/" * 3000 + "f"])
def test_a_name_the_filesystem_refuses_is_an_artifact_error(source):
    with pytest.raises(errors.ArtifactError) as info:
        report_cli._locate(source)
    assert "no such file or artifact" in info.value.message


@pytest.mark.parametrize(
    "snap",
    [
        {"segments": [{"device": 0, "address": 0, "total_size": "big", "blocks": []}], "device_traces": []},
        {
            "segments": [{"device": 0, "address": 0, "total_size": 10, "blocks": [{"size": "x", "state": "active"}]}],
            "device_traces": [],
        },
    ],
)
def test_a_malformed_snapshot_is_a_clean_error(tmp_path, capsys, snap):
    path = write_pickle(tmp_path / "odd.pickle", snap)
    assert main(["memory-report", str(path), "--no-html"]) == 1
    err = capsys.readouterr().err
    assert f"{path} is not a well-formed PyTorch memory snapshot" in err
    assert "Traceback" not in err and "dynprof show --verify" in err


def test_an_html_path_it_cannot_write_is_an_error_with_what_to_do(tmp_path, capsys):
    path = write_pickle(tmp_path / "dump.pickle")
    assert main(["memory-report", str(path), "-o", str(tmp_path / "no" / "dir" / "r.html")]) == 1
    err = capsys.readouterr().err
    assert "cannot write" in err and "Give a writable path with -o." in err


def test_a_summary_that_cannot_be_rendered_is_malformed_not_a_crash(tmp_path):
    result = report_cli.MemoryReport(
        doc={"summary": {"devices": [{"device": 0}]}, "html": None, "torch_viz": None}, source=tmp_path / "s.pickle"
    )
    with pytest.raises(errors.ArtifactError) as info:
        report_cli.MemoryReportCommand().render(result)
    assert "s.pickle is not a well-formed PyTorch memory snapshot" in info.value.message


def test_an_artifacts_capture_summary_of_the_wrong_shape_is_a_clean_error(capsys):
    # GIVEN a memory artifact whose summary.json holds a list where the device table is read
    art = memory_artifact(summary={"device_memory": [1, 2]})
    # WHEN it is reported THEN it is named as malformed, no traceback
    assert main(["memory-report", art.id, "--no-html"]) == 1
    err = capsys.readouterr().err
    assert "is not a well-formed PyTorch memory snapshot" in err and "Traceback" not in err


# -- --torch-viz ----------------------------------------------------------------------------------------
def test_torch_viz_without_torch_is_unsupported(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "torch", None)  # import torch fails
    monkeypatch.setitem(sys.modules, "torch.cuda", None)
    path = write_pickle(tmp_path / "dump.pickle")
    assert main(["memory-report", str(path), "--no-html", "--torch-viz", str(tmp_path / "v.html")]) == 7
    assert "--torch-viz needs torch here" in capsys.readouterr().err
    assert not (tmp_path / "v.html").exists()


@pytest.fixture
def fake_torch_viz(monkeypatch):
    seen = []
    torch = types.ModuleType("torch")
    cuda = types.ModuleType("torch.cuda")
    cuda._memory_viz = types.SimpleNamespace(trace_plot=lambda snap: seen.append(snap) or "<html>viz</html>")
    torch.cuda = cuda
    monkeypatch.setitem(sys.modules, "torch", torch)
    monkeypatch.setitem(sys.modules, "torch.cuda", cuda)
    return seen


def test_torch_viz_writes_torchs_page(tmp_path, capsys, fake_torch_viz):
    path = write_pickle(tmp_path / "dump.pickle")
    viz = tmp_path / "v.html"
    assert main(["memory-report", str(path), "--no-html", "--torch-viz", str(viz)]) == 0
    assert viz.read_text() == "<html>viz</html>"
    assert len(fake_torch_viz) == 1 and fake_torch_viz[0]["segments"][0]["total_size"] == 4 * MB
    out = capsys.readouterr().out
    assert f"PyTorch's interactive viewer: {viz} (loads its scripts from cdn.jsdelivr.net when opened)" in out


def test_a_torch_viz_path_it_cannot_write_is_an_error(tmp_path, capsys, fake_torch_viz):
    path = write_pickle(tmp_path / "dump.pickle")
    bad = tmp_path / "missing" / "v.html"
    assert main(["memory-report", str(path), "--no-html", "--torch-viz", str(bad)]) == 1
    err = capsys.readouterr().err
    assert f"cannot write {bad}" in err and "Give a writable path to --torch-viz." in err
