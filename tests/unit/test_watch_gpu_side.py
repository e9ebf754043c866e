"""The GPU's side of a hang (dynprof/watch/gpu_side.py): the line of words from a rank's GPU
step and its device's NVML reading, NVML read through a stand-in module, and the verdict that
carries the line (the engine over a fake source)."""

from __future__ import annotations

import types
from typing import Any

import pytest

from dynprof.watch import gpu_side
from dynprof.watch.model import Culprit, GpuReading, GpuStep, RankProgress, Verdict

GIB = 1024**3


def _row(gpu_step: GpuStep | None, gpu: GpuReading | None, age: float = 40.0) -> RankProgress:
    return RankProgress(
        job="j", rank=1, world_size=2, pid=4242, host="n1", last_step_age_s=age, gpu_step=gpu_step, gpu=gpu
    )


BUSY = GpuReading(
    index=1, utilization_pct=100, used_bytes=int(41.2 * GIB), total_bytes=141 * GIB, process_bytes=int(40.9 * GIB)
)
IDLE = GpuReading(index=1, utilization_pct=0, used_bytes=int(41.2 * GIB), total_bytes=141 * GIB)


def test_busy_gpu_with_unfinished_work_is_said_with_step_and_age():
    # GIVEN a rank whose step 199's work has not finished for 40 s, on a GPU busy 100 %
    row = _row(GpuStep(step=199, done=False, age_s=40.2, device=0), BUSY)
    # THEN the line says busy, the memory, and the unfinished work
    assert gpu_side.describe(row) == (
        "GPU 1 busy 100 %, 41.2 GiB used (this process 40.9 GiB); "
        "its work queued at step 199 has not finished after 40 s"
    )


def test_idle_gpu_with_finished_work_says_the_host_is_stuck():
    # GIVEN a rank whose last step's work finished, on an idle GPU (its process not listed)
    row = _row(GpuStep(step=199, done=True, age_s=40.0, device=0), IDLE)
    # THEN the line says idle, finished, and that the host is stuck
    assert gpu_side.describe(row) == (
        "GPU 1 idle (0 %), 41.2 GiB used; its last step's work (step 199) finished: the host is stuck"
    )


def test_a_last_step_the_marker_did_not_mark_is_said_not_taken_for_the_marked_one():
    # GIVEN a rank seen at step 205 whose marker's event marks step 199 (steps under 10 ms), finished
    row = _row(GpuStep(step=199, done=True, age_s=40.0, device=0), IDLE)
    row.step = 205
    # THEN the line says which work finished, and that the last step is not marked
    assert gpu_side.describe(row) == (
        "GPU 1 idle (0 %), 41.2 GiB used; its work up to step 199 finished (the marker records at most "
        "every 10 ms, so its last step, 205, is not marked): the host is stuck"
    )


@pytest.mark.parametrize(
    "done, gpu, expected",
    [
        (
            True,
            BUSY,
            "GPU 1 busy 100 %, 41.2 GiB used (this process 40.9 GiB); "
            "its last step's work (step 7) finished: it runs work queued since",
        ),
        (
            False,
            IDLE,
            "GPU 1 idle (0 %), 41.2 GiB used; its work queued at step 7 has not finished after 12 s: "
            "it waits on something that is not a kernel (another stream, a peer, the host)",
        ),
    ],
    ids=["busy-finished", "idle-unfinished"],
)
def test_the_two_mixed_cases_are_told_apart(done, gpu, expected):
    assert gpu_side.describe(_row(GpuStep(step=7, done=done, age_s=12.0), gpu)) == expected


def test_without_nvml_the_state_is_unknown_and_the_step_still_said():
    # GIVEN no NVML on the node (no reading, its note)
    row = _row(GpuStep(step=3, done=False, age_s=65.0), GpuReading(note=gpu_side.NO_NVML))
    # THEN the line says the GPU's state is unknown, and why, and what the event said
    assert (
        gpu_side.describe(row)
        == "GPU state unknown: no NVML here; its work queued at step 3 has not finished after 65 s"
    )


def test_a_device_not_read_yet_says_when_it_is_read():
    row = _row(GpuStep(step=3, done=False, age_s=5.0), None, age=5.0)
    assert gpu_side.describe(row) == (
        "GPU state unknown: its device is read once the rank has not stepped for 10 s; "
        "its work queued at step 3 has not finished after 5 s"
    )


def test_without_a_gpu_step_the_line_says_none_was_recorded():
    row = _row(None, BUSY)
    assert gpu_side.describe(row) == (
        "GPU 1 busy 100 %, 41.2 GiB used (this process 40.9 GiB); "
        "no GPU step recorded (no optimizer step on CUDA seen by its agent)"
    )


class FakeNvml:
    """What gpu_side calls of pynvml: two devices; the rank's process on the second."""

    class NVMLError(Exception):
        pass

    def __init__(self, fail: str | None = None) -> None:
        self.fail = fail
        self.calls: list[str] = []

    def _call(self, name: str) -> None:
        self.calls.append(name)
        if name == self.fail:
            raise self.NVMLError("Unknown Error")

    def nvmlDeviceGetCount(self) -> int:
        self._call("count")
        return 2

    def nvmlDeviceGetHandleByIndex(self, i: int) -> int:
        return i

    def nvmlDeviceGetUUID(self, h: int) -> str:
        return f"GPU-0000000{h}-aaaa"

    def nvmlDeviceGetUtilizationRates(self, h: int) -> Any:
        self._call("utilization")
        return types.SimpleNamespace(gpu=(0, 97)[h])

    def nvmlDeviceGetMemoryInfo(self, h: int) -> Any:
        return types.SimpleNamespace(used=(1, 30)[h] * GIB, total=80 * GIB)

    def nvmlDeviceGetComputeRunningProcesses(self, h: int) -> list[Any]:
        return [types.SimpleNamespace(pid=4242, usedGpuMemory=29 * GIB)] if h == 1 else []


@pytest.mark.parametrize("uuid", ["GPU-00000001-aaaa", ""], ids=["by-uuid", "by-process"])
def test_nvml_is_read_for_a_rank_that_stopped_stepping_on_its_device(uuid):
    # GIVEN a rank that has not stepped for 40 s, its device named by UUID (or not at all)
    row = _row(GpuStep(step=9, done=False, age_s=40.0, device=0, device_uuid=uuid), None)
    nvml = FakeNvml()
    # WHEN this node reads the GPUs of its ranks
    gpu_side.read_gpus([row], nvml=nvml)
    # THEN the rank's device (NVML's index 1) is read, with its process's memory
    assert row.gpu == GpuReading(
        index=1, utilization_pct=97, used_bytes=30 * GIB, total_bytes=80 * GIB, process_bytes=29 * GIB
    )
    assert gpu_side.describe(row).startswith("GPU 1 busy 97 %, 30.0 GiB used (this process 29.0 GiB); ")


def test_nvml_is_not_read_for_ranks_that_step_or_never_stepped_on_cuda():
    # GIVEN a rank that stepped a second ago, and one with no GPU step
    stepping = _row(GpuStep(step=9, done=True, age_s=0.1), None, age=1.0)
    cpu_only = _row(None, None, age=400.0)
    nvml = FakeNvml()
    # WHEN this node reads the GPUs of its ranks
    gpu_side.read_gpus([stepping, cpu_only], nvml=nvml)
    # THEN NVML is not called, and neither row has a reading
    assert nvml.calls == [] and stepping.gpu is None and cpu_only.gpu is None


def test_an_nvml_failure_or_an_unknown_device_is_said_never_raised():
    # GIVEN NVML failing on utilization, and a device no NVML device matches
    failing = _row(GpuStep(step=9, done=False, age_s=40.0, device_uuid="GPU-00000001-aaaa"), None)
    gpu_side.read_gpus([failing], nvml=FakeNvml(fail="utilization"))
    lost = _row(GpuStep(step=9, done=False, age_s=40.0, device_uuid="GPU-ffff"), None)
    lost.pid = 1
    gpu_side.read_gpus([lost], nvml=FakeNvml())
    # THEN each reading says why, and the line starts with the GPU's state unknown
    assert failing.gpu is not None and failing.gpu.note == "NVML could not read it: NVMLError: Unknown Error"
    assert gpu_side.describe(failing).startswith(
        "GPU state unknown: NVML could not read it: NVMLError: Unknown Error; "
    )
    assert lost.gpu is not None and lost.gpu.note == "its device (GPU-ffff) is not among this node's NVML devices"


def test_the_hang_verdict_says_the_culprits_gpu_line_in_its_conclusion_and_evidence():
    # GIVEN the engine's fake job (tests/unit/test_watch_engine.py) whose stuck rank 3 reports
    # work unfinished on a busy GPU
    from tests.unit.test_watch_engine import FakeSource, engine_for

    class GpuSource(FakeSource):
        def progress(self, job: str, fresh: bool = False) -> list[Any]:
            reads = super().progress(job, fresh)
            for read in reads:
                for r in read.progress.ranks if read.progress else []:
                    r.gpu_step = GpuStep(step=self.step, done=r.rank != 3, age_s=40.0)
                    r.gpu = BUSY if r.rank == 3 else IDLE
            return reads

    source = GpuSource()
    engine, said = engine_for(source)
    for _ in range(3):
        engine.tick()
    source.stuck = True
    for _ in range(12):
        engine.tick()
    hangs = [v for v, _ in said if v.kind == "hang"]
    assert len(hangs) == 1
    verdict = hangs[0]
    # THEN the conclusion ends its culprit's part with the GPU line, and the evidence holds it
    line = f"GPU 1 busy 100 %, 41.2 GiB used (this process 40.9 GiB); its work queued at step {source.step} has not finished after 40 s"
    assert f"; rank 3 (node-2): {line}" in verdict.conclusion
    (item,) = verdict.evidence["gpu"]
    assert (item["rank"], item["host"], item["pid"], item["line"]) == (3, "node-2", 103, line)
    assert item["gpu_step"]["done"] is False and item["gpu"]["utilization_pct"] == 100
    # and it survives the verdict's decoder
    assert Verdict.from_json(verdict.to_json()).evidence["gpu"][0]["line"] == line


def test_no_gpu_evidence_outside_a_hang_or_for_a_rank_without_gpu_facts():
    row = _row(GpuStep(step=1, done=True, age_s=1.0), IDLE)
    culprit = Culprit(rank=1, host="n1", where="?", why="?", pid=4242)
    assert gpu_side.evidence("busy", [culprit], [("n1", row)]) == []
    assert gpu_side.evidence("hang", [culprit], [("n1", _row(None, None))]) == []
    assert gpu_side.clause([]) == ""


def test_the_progress_read_carries_the_status_gpu_step_and_reads_nvml_for_a_stalled_rank(monkeypatch):
    # GIVEN this process as a rank whose agent says its step 41's GPU work has not finished,
    # its last step 30 s ago, on a node whose NVML is the stand-in
    import os
    import time

    from dynprof.proto import pb
    from dynprof.watch import progress
    from tests.support.records import agent_record

    status = pb.Status(
        pid=os.getpid(),
        step=41,
        last_step_at=time.time() - 30.0,
        job_id="j",
        rank=1,
        world_size=2,
        role="trainer",
        gpu_step=pb.GpuStep(
            recorded=True,
            step=41,
            done=False,
            age_s=30.5,
            device=0,
            device_uuid="GPU-00000001-aaaa",
            coredump_armed=True,
        ),
    )
    unrecorded = pb.Status(pid=1, step=3, job_id="j", rank=0, role="trainer", gpu_step=pb.GpuStep(recorded=False))
    records = [
        agent_record(pid, rank=rank, world_size=2, job_id="j", socket="", role="trainer")
        for pid, rank in ((os.getpid(), 1), (1, 0))
    ]
    answers = {os.getpid(): status, 1: unrecorded}
    monkeypatch.setattr(progress, "parallel", lambda fn, rs: [answers[r.pid] for r in rs])
    monkeypatch.setattr(gpu_side, "_NVML", types.SimpleNamespace(get=lambda: (FakeNvml(), None)))
    # WHEN the node's progress is read
    rows = {r.rank: r for r in progress.read_progress(records, "h", "j").ranks}
    # THEN the stalled rank carries its GPU step and its device's reading; the other none
    assert rows[1].gpu_step == GpuStep(
        step=41, done=False, age_s=30.5, device=0, device_uuid="GPU-00000001-aaaa", coredump_armed=True
    )
    assert rows[1].gpu is not None and (rows[1].gpu.index, rows[1].gpu.utilization_pct) == (1, 97)
    assert rows[0].gpu_step is None and rows[0].gpu is None


@pytest.mark.parametrize(
    ("gpu_step", "gpu", "agrees", "evidence"),
    [
        # work queued and unfinished: agrees, whatever NVML says
        (GpuStep(step=9, done=False, age_s=20.0), IDLE, True, "GPU 1 idle (0 %), its step 9's work unfinished"),
        # the probe's work unfinished
        (
            GpuStep(step=9, done=True, age_s=20.0, probe_done=False, probe_age_s=2.5),
            None,
            True,
            "the work queued 2.5 s ago unfinished, its step 9's work finished",
        ),
        # the device busy, its last step's work finished: it runs work queued since
        (GpuStep(step=9, done=True, age_s=20.0), BUSY, True, "GPU 1 busy (100 %), its step 9's work finished"),
        # idle, and the step's work finished: disagrees
        (GpuStep(step=9, done=True, age_s=20.0), IDLE, False, "GPU 1 idle (0 %), its step 9's work finished"),
        # the probe's work finished, NVML not read: disagrees
        (
            GpuStep(step=9, done=True, age_s=20.0, probe_done=True, probe_age_s=2.0),
            GpuReading(note="no NVML here"),
            False,
            "the work queued 2.0 s ago finished, its step 9's work finished",
        ),
        # the step's work finished alone says nothing (work may have been queued since)
        (
            GpuStep(step=9, done=True, age_s=20.0),
            GpuReading(note="no NVML here"),
            None,
            "its step 9's work finished; no reading of its device (no NVML here)",
        ),
        (None, None, None, "no reading of its device (its device not read)"),
    ],
)
def test_the_gpu_side_agrees_with_a_wait_by_its_unfinished_work_or_busy_device(gpu_step, gpu, agrees, evidence):
    # GIVEN a rank's GPU step and NVML reading
    row = _row(gpu_step, gpu)
    # WHEN asked whether they agree that it waits for its device
    said = gpu_side.agreement(row)
    # THEN the answer and the evidence read, in words
    assert (said.agrees, said.evidence) == (agrees, evidence)
