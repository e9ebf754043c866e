"""The GPU fault suite: two ranks share one GPU (gloo all-reduces the gradients, copied to the
CPU), and rank 1 blocks behind a kernel that does not end, in each of the ways a CUDA job waits
for its GPU; beside them, busy phases on the GPU that are not hangs. The watch must name rank 1
``waiting-gpu`` with the call in words, and call no busy phase a hang.

Run on a GPU machine: ``pytest -m gpu tests/gpu/test_gpu_faults.py -s`` (``DYNPROF_GPU_RUNS=3``
runs each case three times). Each case prints one row of the verdict table: case, run, right,
detection s, verdict s.
"""

from __future__ import annotations

import json
import os
import sys
import time

import pytest

from dynprof.identity import detect
from dynprof.watch.gpu_side import KERNEL_NOT_ARMED
from tests._ports import free_port

pytestmark = [pytest.mark.gpu, pytest.mark.ptrace]
PROGRAM = "tests/gpu/programs/gpu_fault_program.py"
RUNS = range(int(os.environ.get("DYNPROF_GPU_RUNS", "1")))
BLOCKING = {
    "item": ("a device-to-host copy", "Tensor.item"),
    "cpu": ("a device-to-host copy", "Tensor.cpu"),
    "tolist": ("a device-to-host copy", "Tensor.tolist"),
    "cuda-sync": ("a device synchronize", "torch.cuda.synchronize"),
    "event-sync": ("an event synchronize", "Event.synchronize"),
    "stream-sync": ("a stream synchronize", "Stream.synchronize"),
    "h2d-pageable": ("a host-to-device copy", "Tensor.to"),
    # all-reduce in the rank's own one-member NCCL group, waited for on the host: no binding names it
    "nccl-wait": ("an NCCL call", None),
}
# what a fault needs in the ranks' environment
FAULT_ENV = {"nccl-wait": {"TORCH_NCCL_BLOCKING_WAIT": "1"}}


def _row(*lines: str) -> None:
    """Print a row of the verdict table (and what it said); with ``DYNPROF_GPU_ROWS`` set, also
    append it to that file (pytest-xdist workers' output is not shown)."""
    text = "\n".join(lines)
    print("\n" + text)
    rows = os.environ.get("DYNPROF_GPU_ROWS")
    if rows:
        with open(rows, "a") as f:
            f.write(text + "\n")


def _free_port() -> str:
    return str(free_port())


def _start(spawn, job: str, fault: str, *extra: str, env_extra: dict[str, str] | None = None) -> list[int]:
    """Rank 0's and rank 1's pids, once each is where the test wants it."""
    port = _free_port()
    targets = []
    for rank in range(2):
        env = {"RANK": str(rank), "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}
        env["DYNPROF_JOB_ID"] = job
        env.update(env_extra or {})
        args = ["-m", "dynprof", "run", "-q", "--", sys.executable, PROGRAM, "--fault", fault, *extra]
        targets.append(spawn(args, under_run=False, env=env))
    return [t.ready_pids(timeout=240)[0] for t in targets]


def _watch_once(cli, job: str, stall_after: str = "3") -> tuple[int, list[dict], str]:
    out = cli(
        "watch", "--job", job, "--once", "--json", "--stall-after", stall_after, "--look-interval", "1", timeout=300
    )
    events = [json.loads(line) for line in out.stdout.splitlines() if line.strip()]
    return out.returncode, [e["verdict"] for e in events if "verdict" in e], out.stderr


@pytest.mark.parametrize("run", RUNS)
@pytest.mark.parametrize("fault", sorted(BLOCKING))
def test_a_rank_blocked_behind_its_gpu_is_named_waiting_for_its_gpu(spawn, cli, fault, run):
    # GIVEN rank 1 blocked behind an endless kernel at step 5, rank 0 waiting in all_reduce
    job = f"gpu{fault.replace('-', '')}{run}"
    _start(spawn, job, fault, "--at-step", "5", env_extra=FAULT_ENV.get(fault))
    time.sleep(4.0)  # past the stall time below
    # WHEN the watch looks once
    rc, verdicts, err = _watch_once(cli, job)
    # THEN one hang, rank 1 on this host, waiting for its GPU in the call, in words
    call, op = BLOCKING[fault]
    assert rc == 20 and len(verdicts) == 1, err
    v = verdicts[0]
    t = v["evidence"]["timing"]
    _row(
        f"VERDICT-ROW {fault} run={run} kind={v['kind']} detection_s={t['detection_s']} verdict_s={t['verdict_s']}",
        v["conclusion"],
    )
    assert v["kind"] == "hang"
    assert [(c["rank"], c["host"]) for c in v["culprits"]] == [(1, detect().host)]
    said = f"waits for its GPU in {call} ({op} at " if op else f"waits for its GPU in {call} (at "
    assert said in v["conclusion"], v["conclusion"]
    assert "moving" not in v["conclusion"]
    (row,) = [r for r in v["ranks"] if r["rank"] == 1]
    assert row["state"].startswith("waiting for its GPU in "), row


@pytest.mark.parametrize("run", RUNS)
@pytest.mark.parametrize("fault", ["checkpoint", "eval"])
def test_busy_phases_on_the_gpu_are_not_a_hang(spawn, cli, fault, run):
    # GIVEN every rank in a busy phase on the GPU (CUDA tensors saved, an evaluation loop)
    # that lasts far longer than the stall time
    job = f"gpubusy{fault}{run}"
    _start(spawn, job, fault, "--at-step", "5", "--busy-seconds", "60")
    time.sleep(4.0)
    # WHEN the watch looks once, three times over
    kinds = []
    for _ in range(3):
        rc, verdicts, err = _watch_once(cli, job)
        kinds += [v["kind"] for v in verdicts]
        _row(
            f"VERDICT-ROW busy-{fault} run={run} rc={rc} kinds={[v['kind'] for v in verdicts]}",
            *[v["conclusion"] for v in verdicts],
        )
        # THEN never a hang
        assert rc != 20, err
    assert "hang" not in kinds


@pytest.mark.parametrize("run", RUNS)
def test_every_rank_waiting_for_its_gpu_is_a_hang_on_the_devices(spawn, cli, run):
    # GIVEN every rank blocked behind its own endless kernel, in .item()
    job = f"gpuallitem{run}"
    _start(spawn, job, "item", "--at-step", "5", "--fault-rank", "-1")
    time.sleep(4.0)
    # WHEN the watch looks once
    rc, verdicts, err = _watch_once(cli, job)
    # THEN one hang on the devices: every rank named, each waiting for its GPU in the copy
    assert rc == 20 and len(verdicts) == 1, (err, [(v["kind"], v["conclusion"], v["ranks"]) for v in verdicts])
    v = verdicts[0]
    t = v["evidence"]["timing"]
    _row(
        f"VERDICT-ROW all-ranks-item run={run} kind={v['kind']} detection_s={t['detection_s']} verdict_s={t['verdict_s']}",
        v["conclusion"],
    )
    assert v["kind"] == "hang"
    assert "every rank waits for its GPU" in v["conclusion"] and "the hang is on the devices" in v["conclusion"]
    assert sorted(c["rank"] for c in v["culprits"]) == [0, 1]
    for r in v["ranks"]:
        assert r["state"].startswith("waiting for its GPU in a device-to-host copy"), r


@pytest.mark.parametrize("run", RUNS)
def test_torch_compile_warm_up_on_the_gpu_is_not_a_hang(spawn, cli, run):
    # GIVEN two ranks in their first step under torch.compile (max-autotune, Inductor's caches
    # off): tens of seconds of compiling and autotuning kernels on the GPU before any step
    job = f"gpubusycompile{run}"
    _start(spawn, job, "compile", env_extra={"TORCHINDUCTOR_FORCE_DISABLE_CACHES": "1"})
    time.sleep(6.0)  # past the stall time below
    # WHEN the watch looks once, three times over, during the warm-up
    kinds = []
    for _ in range(3):
        rc, verdicts, err = _watch_once(cli, job, stall_after="5")
        kinds += [v["kind"] for v in verdicts]
        _row(
            f"VERDICT-ROW busy-compile run={run} rc={rc} kinds={[v['kind'] for v in verdicts]}",
            *[v["conclusion"] for v in verdicts],
        )
        # THEN never a hang
        assert rc != 20, err
    assert "hang" not in kinds
    # AND the looks were made during the warm-up: the job was seen stalled before its first step
    assert "busy" in kinds, kinds


STRAGGLERS = {
    "gpu-compute": "GPU compute",
    "host-launch": "host launch",
    "h2d-input": "host-to-device copy",
    "data-loading": "data loading",
    "none": None,
}


@pytest.mark.parametrize("run", RUNS)
@pytest.mark.parametrize("fault", sorted(STRAGGLERS))
def test_gpu_stragglers_are_named_with_their_cause_and_an_even_job_names_none(spawn, cli, fault, run):
    # GIVEN rank 1 slower every step in one way (none: an even job), after 20 steady steps
    job = f"gpuslow{fault.replace('-', '')}{run}"
    _start(spawn, job, fault, "--at-step", "20")
    # WHEN 6 steps are traced job-wide and analysed
    started = cli("start", "--job", job, "--steps", "6", "--json", timeout=300)
    assert started.returncode == 0, started.stderr
    result = cli("analyze", "--job", job, "--json", timeout=300)
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    keep = os.environ.get("DYNPROF_GPU_KEEP")  # a folder: keep each analysis, to study the rule's figures
    if keep:
        os.makedirs(keep, exist_ok=True)
        with open(os.path.join(keep, f"{job}.json"), "w") as f:
            f.write(result.stdout)
        _keep_traces(data, os.path.join(keep, job))
    s = data["straggler"]
    _row(
        f"VERDICT-ROW straggler-{fault} run={run} rank={s and s['rank']} cause={s and s.get('cause')}",
        s["reason"] if s else data["straggler_check"],
    )
    # THEN the ranks' traces say the one GPU they share (its UUID, from each trace's manifest)
    devices = {r["device"] for r in data["ranks"]}
    assert len(devices) == 1 and str(next(iter(devices))).startswith("GPU-"), data["ranks"]
    # AND the right rank and cause, or none for the even job
    cause = STRAGGLERS[fault]
    if cause is None:
        assert s is None, s
    else:
        assert s is not None and s["rank"] == 1 and s["cause"] == cause, data["straggler_check"]


def _keep_traces(data: dict, folder: str) -> None:
    """Copy the analysed traces and their manifests into ``folder`` (to record a case)."""
    import shutil

    from dynprof.store import ArtifactStore

    store = ArtifactStore()
    for r in data["ranks"]:
        art = store.get(r["artifact"])
        dest = os.path.join(folder, f"rank{r['rank']}")
        os.makedirs(dest, exist_ok=True)
        for name in ("trace.json.gz", "manifest.json"):
            shutil.copy(art.path / name, dest)


GPU_SIDE = {
    # fault: (the status's gpu_step.done, what the verdict's GPU line says)
    "step-behind-kernel": (False, ("busy ", "its work queued at step 6 has not finished after ")),
    "host-sleep": (True, ("idle (", "its last step's work (step 6) finished: the host is stuck")),
}
SAID_AFTER = {  # what the line ends with where the event marks an earlier step than the last one
    "step-behind-kernel": "it runs work queued since",
    "host-sleep": "the host is stuck",
}


@pytest.mark.parametrize("run", RUNS)
@pytest.mark.parametrize("fault", sorted(GPU_SIDE))
def test_the_verdict_says_whether_the_hung_ranks_gpu_work_finished(spawn, cli, fault, run):
    # GIVEN rank 1 stuck after its 6th step: behind an endless kernel queued before that step
    # (then .item()), or sleeping on the host after the step's work finished (synchronized)
    from dynprof.client import AgentClient

    job = f"gpuside{fault.replace('-', '')}{run}"
    _, pid = _start(spawn, job, fault, "--at-step", "5")
    time.sleep(12.0)  # past the stall time below, and past the age at which NVML is read
    # WHEN its agent is asked for its status, and the watch looks once
    g = AgentClient.for_pid(pid, timeout=10.0).status().gpu_step
    rc, verdicts, err = _watch_once(cli, job)
    # THEN the status says whether the GPU finished that step's work, recorded 12 s ago or more
    done, (state, said) = GPU_SIDE[fault]
    assert g.recorded and 1 <= g.step <= 6, g
    if g.step < 6:
        # the marker records at most every 10 ms: step 6 came sooner after the last record, so the
        # event marks an earlier step, whose work finished; the line says so, and NVML says the rest
        done, said = True, f"its work up to step {g.step} finished (the marker records at most every 10 ms"
        if fault == "step-behind-kernel":
            state = "busy "
    assert g.done is done, g
    assert g.age_s >= 10.0 and g.device == 0 and g.device_uuid.startswith("GPU-"), g
    # and the hang's verdict says what rank 1's GPU does, in its conclusion and evidence
    assert rc == 20 and len(verdicts) == 1, err
    v = verdicts[0]
    _row(f"VERDICT-ROW gpu-side-{fault} run={run} kind={v['kind']} marked_step={g.step} done={g.done}", v["conclusion"])
    assert v["kind"] == "hang"
    assert [(c["rank"], c["host"]) for c in v["culprits"]] == [(1, detect().host)]
    (item,) = v["evidence"]["gpu"]
    line = item["line"]
    assert item["rank"] == 1 and item["pid"] == pid
    assert line.startswith("GPU ") and state in line and said in line, line
    if g.step < 6:
        assert line.endswith(SAID_AFTER[fault]), line
    assert "GiB used" in line and "(this process " in line, line
    assert f"rank 1 ({detect().host}): {line}" in v["conclusion"]
    assert item["kernel"] == KERNEL_NOT_ARMED and g.coredump_armed is False  # not run with --gpu-coredump
