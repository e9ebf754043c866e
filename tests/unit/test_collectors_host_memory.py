"""collectors.host_memory: how close a process is to the kernel's OOM killer (RSS against the
configured, cgroup or machine limit), and the ``host-memory`` artifact taken before it strikes.

The /proc and cgroup files are laid out under tmp_path (their reader redirected there), so
every layout, v1 and v2, limited or not, is checked on any machine.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import types
from pathlib import Path
from typing import Any

import pytest
import torch

from collectors import host_memory as hm
from collectors.host_memory import (
    KIND,
    STACKS_FILE,
    SUMMARY_FILE,
    TENSORS_FILE,
    UNLIMITED,
    Cgroup,
    Limit,
    Usage,
    all_thread_stacks,
    find_cgroup,
    find_cpu_tensors,
    format_tensors,
    meminfo,
    process_rss,
    process_status,
    read_usage,
    render_artifact,
    resolve_limit,
    usage_dict,
)
from dynprof.store import ArtifactStore

GB = 1 << 30
MB = 1 << 20


@pytest.fixture
def proc(monkeypatch):
    """/proc files as the test writes them (a dict: path -> text); other paths are read as they are."""
    files: dict[str, str] = {}
    real = hm._read

    def read(path: str | Path) -> str | None:
        if str(path) in files:
            return files[str(path)]
        return real(path)

    monkeypatch.setattr(hm, "_read", read)
    return files


# -- the figures ----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("text", "value"),
    [
        (None, None),
        ("", None),
        ("  \n", None),
        ("max\n", None),
        ("lots", None),
        ("1073741824\n", GB),
        (str(UNLIMITED), None),
        ("9223372036854771712", None),  # cgroup v1's "no limit"
    ],
)
def test_a_limit_file_s_value(text, value):
    assert hm._int(text) == value


def test_a_file_that_cannot_be_read_is_none(tmp_path):
    assert hm._read(tmp_path / "missing") is None
    assert hm._read(tmp_path) is None  # a directory


def test_this_process_s_rss_is_read_and_a_gone_process_s_is_zero():
    assert process_rss() > 0
    assert process_rss(os.getpid()) > 0
    assert process_rss(2**31) == 0  # no such pid


def test_the_status_figures_are_bytes(proc):
    proc["/proc/self/status"] = (
        "Name:\tpython\nVmPeak:\t  1000 kB\nVmHWM:\t    10 kB\nVmRSS:\t     8 kB\nRssAnon:\t 6 kB\n"
        "VmFlags: rd\nThreads:\t5\nVmOdd:\t12\nVmBad:\tx kB\n"
    )
    assert process_status() == {
        "VmPeak": 1000 * 1024,
        "VmHWM": 10 * 1024,
        "VmRSS": 8 * 1024,
        "RssAnon": 6 * 1024,
        "VmOdd": 12,
    }
    real = process_status(os.getpid())  # the real file: peak RSS at least RSS
    assert real["VmHWM"] >= real["VmRSS"] > 0


def test_meminfo_is_bytes_and_skips_what_is_not_a_number(proc):
    proc["/proc/meminfo"] = "MemTotal:       16 kB\nMemAvailable:   8 kB\nHugePages_Total:       0\nOdd: x\n"
    assert meminfo() == {"MemTotal": 16 * 1024, "MemAvailable": 8 * 1024, "HugePages_Total": 0}
    proc["/proc/meminfo"] = None  # type: ignore[assignment]  # unreadable
    assert meminfo() == {}


# -- cgroups -------------------------------------------------------------------------------------------
def _write(directory: Path, **files: str) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (directory / name.replace("_", ".", 1)).write_text(text)
    return directory


@pytest.mark.parametrize(
    ("version", "files", "usage"),
    [
        (
            2,
            {
                "memory_current": "5000\n",
                "memory_stat": "anon 3000\nfile 1500\nshmem 10\nkernel 99\nanon_thp x\n",
                "memory_events": "low 0\nhigh 4\nmax 7\noom 2\noom_kill 1\noom_group_kill 0\n",
            },
            {
                "current_bytes": 5000,
                "anon_bytes": 3000,
                "file_bytes": 1500,
                "shmem_bytes": 10,
                "events_high": 4,
                "events_max": 7,
                "events_oom": 2,
                "events_oom_kill": 1,
            },
        ),
        (
            1,
            {
                "memory_usage_in_bytes": "7000\n",
                "memory_failcnt": "3\n",
                "memory_stat": "rss 1\ntotal_rss 4000\ntotal_cache 2000\ntotal_shmem 5\n",
            },
            {"current_bytes": 7000, "anon_bytes": 4000, "file_bytes": 2000, "shmem_bytes": 5, "failcnt": 3},
        ),
    ],
    ids=["v2", "v1"],
)
def test_cgroup_usage(tmp_path, version, files, usage):
    d = _write(tmp_path / "g", **files)
    assert Cgroup(version=version, path=str(d)).usage() == usage


def test_a_cgroup_whose_files_are_gone_has_no_usage(tmp_path):
    assert Cgroup(version=2, path=str(tmp_path / "gone")).usage() == {}
    assert Cgroup(version=1, path=str(tmp_path / "gone")).usage() == {}


def _mountinfo(*mounts: tuple[str, Path, str, str]) -> str:
    lines = ["22 1 8:1 / / rw,relatime shared:1 - ext4 /dev/sda1 rw", "bad line", "1 2 3 - cgroup2"]
    for i, (root, point, fstype, opts) in enumerate(mounts):
        lines.append(f"{30 + i} 22 0:{26 + i} {root} {point} rw,nosuid shared:9 - {fstype} cgroup {opts}")
    return "\n".join(lines) + "\n"


def test_v2_the_effective_limit_is_the_smallest_up_to_the_mount(tmp_path, proc):
    # GIVEN a v2 hierarchy: the job's group limits at 8 GiB, its step's at 16, the slice's at 32
    mount = _write(tmp_path / "cg2", memory_max="max\n")
    _write(mount / "slice", memory_max=f"{32 * GB}\n")
    _write(mount / "slice" / "job", memory_max=f"{8 * GB}\n")
    step = _write(mount / "slice" / "job" / "step", memory_max=f"{16 * GB}\n")
    proc["/proc/self/cgroup"] = "0::/slice/job/step\n"
    proc["/proc/self/mountinfo"] = _mountinfo(("/", mount, "cgroup2", "rw"))
    # WHEN the process's cgroup is found
    group = find_cgroup()
    # THEN it is the step's, limited by its parent
    assert group == Cgroup(version=2, path=str(step), limit_dir=str(mount / "slice" / "job"), limit_bytes=8 * GB)


def test_v1_memory_controller_and_a_namespaced_mount_root(tmp_path, proc):
    mount = tmp_path / "memory"
    _write(mount, **{"memory_limit_in_bytes": f"{4 * GB}\n"})
    _write(mount / "job1", **{"memory_limit_in_bytes": f"{2 * GB}\n"})
    proc["/proc/self/cgroup"] = "5:cpu,cpuacct:/slurm/job1\n4:memory:/slurm/job1\n0::/\nnonsense\n"
    # the mount's root is /slurm: the process's path is relative to it
    proc["/proc/self/mountinfo"] = _mountinfo(
        ("/slurm", mount, "cgroup", "rw,memory"), ("/", tmp_path / "none", "cgroup", "rw,cpu")
    )
    group = find_cgroup()
    assert group == Cgroup(version=1, path=str(mount / "job1"), limit_dir=str(mount / "job1"), limit_bytes=2 * GB)


def test_an_unlimited_v1_group_gives_way_to_v2_and_stands_alone(tmp_path, proc):
    v1 = _write(tmp_path / "memory", **{"memory_limit_in_bytes": "9223372036854771712\n"})
    v2 = _write(tmp_path / "cg2", memory_max="max\n")
    proc["/proc/self/cgroup"] = "4:memory:/\n0::/\n"
    proc["/proc/self/mountinfo"] = _mountinfo(("/", v1, "cgroup", "rw,memory"), ("/", v2, "cgroup2", "rw"))
    # both: the unlimited v1 group is passed over for the v2 one (unlimited too: it is the process's)
    assert find_cgroup() == Cgroup(version=2, path=str(v2))
    # v1 alone: it is the process's group, without a limit
    proc["/proc/self/mountinfo"] = _mountinfo(("/", v1, "cgroup", "rw,memory"))
    assert find_cgroup() == Cgroup(version=1, path=str(v1))


def test_no_memory_cgroup_mounted_or_no_limit_file_is_none(tmp_path, proc):
    proc["/proc/self/cgroup"] = "0::/job\n"
    proc["/proc/self/mountinfo"] = _mountinfo()
    assert find_cgroup() is None
    proc["/proc/self/mountinfo"] = _mountinfo(("/", tmp_path / "empty", "cgroup2", "rw"))
    assert find_cgroup() is None
    proc["/proc/self/cgroup"] = None  # type: ignore[assignment]
    assert find_cgroup() is None


# -- the limit and the pressure ------------------------------------------------------------------------
def test_the_limit_is_configured_then_the_cgroup_s_then_the_machine_s(proc):
    group = Cgroup(version=2, path="/sys/fs/cgroup/job", limit_dir="/sys/fs/cgroup", limit_bytes=8 * GB)
    assert resolve_limit(4 * GB, group) == Limit(4 * GB, "configured")
    assert resolve_limit(None, group) == Limit(8 * GB, "cgroup v2 /sys/fs/cgroup")
    proc["/proc/meminfo"] = "MemTotal: 1024 kB\n"
    assert resolve_limit(0, Cgroup(version=1, path="/x")) == Limit(MB, "MemTotal")
    proc["/proc/meminfo"] = ""
    assert resolve_limit() == Limit(0, "MemTotal")


def test_the_pressure_is_rss_or_the_cgroup_s_anonymous_memory_under_a_cgroup_limit():
    cg = Limit(10 * GB, "cgroup v2 /g")
    assert Usage(2 * GB, 5 * GB, cg).pressure_bytes == 5 * GB
    assert Usage(6 * GB, 5 * GB, cg).pressure_bytes == 6 * GB
    assert Usage(2 * GB, None, cg).pressure_bytes == 2 * GB
    assert Usage(2 * GB, 5 * GB, Limit(10 * GB, "MemTotal")).pressure_bytes == 2 * GB
    assert Usage(2 * GB, 5 * GB, cg).fraction == pytest.approx(0.5)
    assert Usage(2 * GB, None, Limit(0, "MemTotal")).fraction == 0.0


def test_usage_reads_the_cgroup_only_under_its_limit(tmp_path):
    d = _write(tmp_path / "g", memory_stat="anon 4096\n")
    group = Cgroup(version=2, path=str(d), limit_dir=str(d), limit_bytes=GB)
    under = read_usage(Limit(GB, f"cgroup v2 {d}"), group)
    assert under.cgroup_anon_bytes == 4096 and under.rss_bytes > 0
    assert read_usage(Limit(GB, "configured"), group).cgroup_anon_bytes is None
    assert read_usage(Limit(GB, "cgroup v2 x"), None).cgroup_anon_bytes is None
    assert usage_dict(Usage(GB // 4, 4096, Limit(GB, "cgroup v2 /g"))) == {
        "rss_bytes": GB // 4,
        "cgroup_anon_bytes": 4096,
        "limit": {"bytes": GB, "source": "cgroup v2 /g"},
        "fraction": 0.25,
    }


# -- stacks and tensors -------------------------------------------------------------------------------
@pytest.fixture
def waiting_thread():
    """A thread that holds CPU tensors in its locals until the test ends."""
    done = threading.Event()
    ready = threading.Event()

    def hold() -> None:
        big = torch.zeros(1000, dtype=torch.float64)  # 8000 bytes
        view = big[:10]  # the same storage
        table = {"weights": [torch.zeros(10)]}
        meta = torch.zeros(10**6, device="meta")
        sparse = torch.zeros(100, 100).to_sparse()
        assert view is not None and table and meta is not None and sparse is not None
        ready.set()
        done.wait(60)

    worker = threading.Thread(target=hold, name="holder")
    worker.start()
    assert ready.wait(30)
    yield worker
    done.set()
    worker.join(30)


def test_every_thread_s_stack_is_dumped(waiting_thread):
    text = all_thread_stacks()
    assert f'Thread {waiting_thread.ident} "holder" (most recent call last):' in text
    assert "in hold" in text and "done.wait(60)" in text
    assert f'Thread {threading.get_ident()} "MainThread"' in text


def test_cpu_tensors_are_found_in_other_threads_frames_once_per_storage(waiting_thread):
    tensors, visited = find_cpu_tensors()
    mine = [t for t in tensors if "hold()" in t["where"]]
    # the view and its base are one storage, found once (with the shape of whichever came first)
    assert [(t["bytes"], t["dtype"]) for t in mine] == [(8000, "float64"), (40, "float32")]
    assert mine[0]["shape"] in ([1000], [10]) and mine[1]["shape"] == [10]
    assert visited > 0
    where = {t["bytes"]: t["where"] for t in mine}
    assert where[40].startswith("thread holder: hold() test_collectors_host_memory.py:")
    assert where[40].endswith(" table['weights'][0]")
    assert where[8000].endswith((" big", " view"))


def test_main_s_globals_and_objects_attributes_are_searched(monkeypatch):
    model = types.SimpleNamespace(layer=types.SimpleNamespace(weight=torch.zeros(64)))
    main = types.ModuleType("__main__")
    main.model = model  # type: ignore[attr-defined]
    main.batches = (torch.zeros(8), [torch.zeros(2)])  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "__main__", main)
    tensors, _ = find_cpu_tensors(limit=2)
    assert [(t["bytes"], t["where"]) for t in tensors] == [
        (256, "__main__ model.layer.weight"),
        (32, "__main__ batches[0]"),
    ]


def test_the_search_is_bounded_in_depth_and_objects(monkeypatch):
    deep: Any = torch.zeros(4)
    for _ in range(5):
        deep = [deep]
    main = types.ModuleType("__main__")
    main.deep = deep  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "__main__", main)
    found, _ = find_cpu_tensors(max_depth=6)
    assert [t["where"] for t in found] == ["__main__ deep[0][0][0][0][0]"]
    assert find_cpu_tensors(max_depth=3)[0] == []
    found, visited = find_cpu_tensors(max_objects=2)
    assert visited == 2 and found == []


def test_without_torch_loaded_there_are_no_tensors_to_find(monkeypatch):
    monkeypatch.delitem(sys.modules, "torch")
    assert find_cpu_tensors() == ([], 0)


def test_a_path_is_written_as_python_would_reach_it():
    path: Any = ("__main__",)
    for step in ("model", ".", "layers", 3, ".", "weight"):
        path = (path, step)
    assert hm._format_path(path) == "__main__ model.layers[3].weight"
    assert hm._format_path(((("t",), 0), "k")) == "t[0]['k']"
    assert hm._format_path(("only",)) == "only"


def test_the_tensor_list_is_one_line_each_and_says_when_empty():
    assert format_tensors([]) == "(no CPU tensors found from the threads' frames and __main__)\n"
    text = format_tensors(
        [
            {"bytes": 3 * MB, "dtype": "float32", "shape": [1024, 768], "where": "__main__ model.w"},
            {"bytes": 10, "dtype": "int8", "shape": [10], "where": "evil\n\x1b[2Jname"},
        ]
    )
    lines = text.splitlines()
    assert lines[0] == "    3.0 MiB  float32   [1024, 768]            __main__ model.w"
    assert len(lines) == 2 and "\x1b" not in text and "evil\\n\\x1b[2Jname" in lines[1]


# -- the artifact -------------------------------------------------------------------------------------
def test_a_capture_writes_its_summary_stacks_and_tensors(tmp_path, waiting_thread):
    d = _write(
        tmp_path / "g", memory_current="9000\n", memory_stat="anon 5000\nfile 4000\n", memory_events="oom_kill 2\n"
    )
    group = Cgroup(version=2, path=str(d), limit_dir=str(d), limit_bytes=GB)
    usage = Usage(rss_bytes=GB // 2, cgroup_anon_bytes=5000, limit=Limit(GB, f"cgroup v2 {d}"))
    art = hm.capture(
        ArtifactStore(tmp_path / "store"),
        trigger="threshold",
        job="j",
        host="h",
        rank=2,
        usage=usage,
        fraction=0.9,
        cgroup=group,
        options={"extra": "x"},
    )
    assert art.status == "complete" and art.kind == KIND and not art.verify()
    assert art.manifest["options"] == {"trigger": "threshold", "fraction": 0.9, "extra": "x"}
    s = json.loads(art.file(SUMMARY_FILE).read_text())
    assert s["rss_bytes"] == GB // 2 and s["limit_bytes"] == GB and s["limit_source"] == f"cgroup v2 {d}"
    assert s["pressure_bytes"] == GB // 2 and s["usage_fraction"] == 0.5 and s["threshold_fraction"] == 0.9
    assert s["cgroup"] == {
        "version": 2,
        "path": str(d),
        "limit_bytes": GB,
        "current_bytes": 9000,
        "anon_bytes": 5000,
        "file_bytes": 4000,
        "events_oom_kill": 2,
    }
    assert s["peak_rss_bytes"] > 0 and set(s["system"]) == {"MemTotal", "MemAvailable", "SwapTotal", "SwapFree"}
    assert s["threads"] >= 2 and s["objects_visited"] > 0
    assert s["cpu_tensor_bytes_found"] == sum(t["bytes"] for t in s["largest_cpu_tensors"]) >= 8000
    assert '"holder" (most recent call last):' in art.file(STACKS_FILE).read_text()
    assert art.file(TENSORS_FILE).read_text() == format_tensors(s["largest_cpu_tensors"])
    assert set(art.manifest["summary"]) == {
        "trigger",
        "rss_bytes",
        "limit_bytes",
        "limit_source",
        "usage_fraction",
        "threshold_fraction",
        "cpu_tensor_bytes_found",
        "capture_s",
    }

    summary, text = render_artifact(art)
    assert summary == s
    lines = text.splitlines()
    assert (
        lines[0]
        == f"RSS 512.0 MiB (peak {hm._b(s['peak_rss_bytes'])}) = 50.0 % of the limit 1.0 GiB (cgroup v2 {d}); threshold 90 %"
    )
    assert lines[1] == f"cgroup v2 {d}: usage 8.8 KiB, anon 4.9 KiB, page cache 3.9 KiB, oom_kill events 2"
    assert lines[2].startswith("system: MemTotal ")
    assert lines[4].startswith(f"largest CPU tensors ({s['objects_visited']} objects searched in ")
    assert lines[-1] == f"Python stacks of {s['threads']} threads in {STACKS_FILE}"


def test_a_capture_without_a_cgroup_and_its_text(tmp_path):
    usage = Usage(rss_bytes=GB, cgroup_anon_bytes=None, limit=Limit(4 * GB, "MemTotal"))
    art = hm.capture(
        ArtifactStore(tmp_path / "store"),
        trigger="t",
        job=None,
        host=None,
        rank=None,
        usage=usage,
        fraction=0.5,
        cgroup=None,
    )
    s = json.loads(art.file(SUMMARY_FILE).read_text())
    assert s["cgroup"] is None and s["usage_fraction"] == 0.25
    _summary, text = render_artifact(art)
    assert "cgroup v" not in text
    assert text.splitlines()[0].endswith("= 25.0 % of the limit 4.0 GiB (MemTotal); threshold 50 %")


def test_the_text_of_an_artifact_without_its_stacks_file_or_oom_kills(tmp_path):
    summary = {
        "rss_bytes": GB,
        "peak_rss_bytes": None,
        "usage_fraction": 0.5,
        "limit_bytes": 2 * GB,
        "limit_source": "configured",
        "threshold_fraction": 0.85,
        "cgroup": {"version": 1, "path": "/g", "current_bytes": GB},
        "system": {},
        "objects_visited": 3,
        "tensor_search_s": 0.01,
    }
    writer = ArtifactStore(tmp_path / "store").create(KIND, job="j", host="h", rank=0)
    writer.write_json(SUMMARY_FILE, summary)
    _s, text = render_artifact(writer.finish("complete"))
    lines = text.splitlines()
    assert lines[0] == "RSS 1.0 GiB (peak ?) = 50.0 % of the limit 2.0 GiB (configured); threshold 85 %"
    assert lines[1] == "cgroup v1 /g: usage 1.0 GiB, anon ?, page cache ?"
    assert lines[2] == "system: MemTotal ?, MemAvailable ?"
    assert lines[-1] == "(no CPU tensors found from the threads' frames and __main__)"
    assert "Python stacks" not in text


def test_a_capture_that_fails_leaves_a_failed_artifact_and_raises(tmp_path, monkeypatch):
    def broken(*a: Any, **k: Any) -> Any:
        raise RuntimeError("walk failed")

    monkeypatch.setattr(hm, "find_cpu_tensors", broken)
    store = ArtifactStore(tmp_path / "store")
    usage = Usage(rss_bytes=1, cgroup_anon_bytes=None, limit=Limit(2, "MemTotal"))
    with pytest.raises(RuntimeError, match="walk failed"):
        hm.capture(store, trigger="t", job="j", host="h", rank=0, usage=usage, fraction=0.5, cgroup=None)
    (art,) = store.list(kind=KIND)
    assert art.status == "failed" and art.manifest["error"] == "RuntimeError: walk failed"


def test_the_watcher_reads_the_jobs_tensors_on_the_training_thread_only(waiting_thread):
    # GIVEN a main (training) thread holding a tensor in its locals, another thread holding its
    # own, and a watcher thread that asks for the largest tensors over a stand-in pending-call
    # queue, which this (main) thread drains as CPython would at a bytecode boundary
    from collectors.host_memory import tensors_on_training_thread

    mine = torch.zeros(4096, dtype=torch.uint8)
    queued: list = []
    got: list = []
    walked_on: list = []

    def call_soon(fn):
        queued.append(fn)
        return True

    def on_thread():
        got.append(tensors_on_training_thread(call_soon, timeout_s=60))

    watcher = threading.Thread(target=on_thread)
    watcher.start()
    while not queued:
        threading.Event().wait(0.01)
    walked_on.append(threading.current_thread() is threading.main_thread())
    queued.pop()()
    watcher.join(60)
    # THEN the walk ran here, found this thread's tensor, and none of the other thread's
    tensors, visited, note = got[0]
    assert walked_on == [True] and note == "" and visited > 0
    assert any(t["bytes"] == mine.numel() and " mine" in t["where"] for t in tensors), tensors
    assert not any("hold()" in t["where"] for t in tensors)


def test_a_training_thread_that_runs_no_python_leaves_the_tensors_unread_with_the_reason():
    from collectors.host_memory import tensors_on_training_thread

    got: list = []
    t = threading.Thread(target=lambda: got.append(tensors_on_training_thread(lambda fn: True, timeout_s=0.01)))
    t.start()
    t.join(60)
    assert got == [([], 0, "not read: the training thread ran no Python within 0.01 s (inside a long call)")]
