"""Process roles in real jobs: launchers, DataLoader workers and trainers (dynprof.roles).

`--job` targets the trainers only, `ps` names every process's role, the hang watchdog waits for
no first step in launchers and workers, and a phase marked with dynprof.phase is no hang.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import sys
import time

import pytest

from dynprof.store import ArtifactStore
from tests._ports import free_port

PROGRAMS = "tests/integration/programs"
TRAIN = f"{PROGRAMS}/train_program.py"
WRAPPER = f"{PROGRAMS}/wrapper_program.py"
LOADER = f"{PROGRAMS}/dataloader_program.py"
PHASE = f"{PROGRAMS}/phase_program.py"


@pytest.fixture
def spawn_group(spawn):
    """``spawn`` whose targets' whole process groups (launched children too) end with the test."""
    started = []

    def _spawn(*args, **kwargs):
        target = spawn(*args, **kwargs)
        started.append(target)
        return target

    yield _spawn
    for target in started:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(target.pid, signal.SIGTERM)


def _never_stepping(spawn_group, job: str, *run_options: str) -> int:
    """A process of job ``job`` that never steps an optimizer, under `dynprof run RUN_OPTIONS`,
    once it is ready: its pid."""
    never = spawn_group(
        ["-m", "dynprof", "run", "-q", *run_options, "--", sys.executable, TRAIN, "--no-optimizer"],
        under_run=False,
        env={"DYNPROF_JOB_ID": job},
    )
    (pid,) = never.ready_pids(timeout=90)
    return pid


def _agents(cli, job: str) -> list[dict]:
    result = cli("ps", "--job", job, "--json")
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)["agents"]


def _roles(cli, job: str) -> dict[int, str]:
    return {a["pid"]: a.get("role") for a in _agents(cli, job)}


def _hang_artifacts() -> list:
    return ArtifactStore().list(kind="hang")


def _wait_for(condition, timeout: float = 60.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.1)


def _traced_pids(cli, job: str) -> list[int]:
    result = cli("start", "--job", job, "--steps", "2", "--json", "--timeout", "90")
    assert result.returncode == 0, result.stdout + result.stderr
    return sorted(r["pid"] for r in json.loads(result.stdout)["results"])


def _stacks_pids(cli, job: str) -> list[int]:
    result = cli("stacks", "--job", job, "--json", "--no-save")
    assert result.returncode == 0, result.stdout + result.stderr
    return sorted(p["pid"] for p in json.loads(result.stdout)["processes"])


def test_a_python_wrapper_is_the_launcher_and_its_child_the_trainer(spawn_group, cli):
    # GIVEN `dynprof run -- python wrapper.py train.py`: the wrapper runs the trainer as a child
    target = spawn_group([WRAPPER, TRAIN, "--step-sleep", "0.01"], env={"DYNPROF_JOB_ID": "wrapjob"})
    (child,) = target.ready_pids(timeout=90)
    wrapper = target.pid  # `dynprof run` execs the wrapper in place

    # WHEN the job is traced, its stacks read and its processes listed
    traced = _traced_pids(cli, "wrapjob")
    stacked = _stacks_pids(cli, "wrapjob")
    roles = _roles(cli, "wrapjob")

    # THEN --job means the child, and ps names the wrapper the launcher and the child the trainer
    assert traced == [child]
    assert stacked == [child]
    assert roles == {wrapper: "launcher", child: "trainer"}


def test_accelerate_launch_traces_the_script_not_the_launcher(spawn_group, cli):
    # GIVEN `dynprof run -- accelerate launch --cpu train.py` (its simple launcher runs the
    # script as a child process)
    pytest.importorskip("accelerate")
    target = spawn_group(
        ["-m", "accelerate.commands.launch", "--cpu", "--num_processes", "1", "--num_machines", "1",
         "--mixed_precision", "no", "--dynamo_backend", "no", TRAIN, "--step-sleep", "0.01"],
        env={"DYNPROF_JOB_ID": "accjob"},
    )  # fmt: skip
    (child,) = target.ready_pids(timeout=120)

    # WHEN the job is traced
    traced = _traced_pids(cli, "accjob")

    # THEN the script was traced, and ps tells the launcher from it
    assert traced == [child]
    assert _roles(cli, "accjob") == {target.pid: "launcher", child: "trainer"}


def test_spawned_dataloader_workers_are_not_processes_of_the_job(spawn_group, cli):
    # GIVEN a trainer whose persistent DataLoader workers are started with "spawn", under a
    # watchdog that also waits for the first step
    target = spawn_group(
        ["-m", "dynprof", "run", "-q", "--hang-timeout", "30", "--hang-first-step-timeout", "1", "--",
         sys.executable, LOADER, "--persistent", "--seconds", "90"],
        under_run=False,
        env={"DYNPROF_JOB_ID": "dljob"},
    )  # fmt: skip
    (trainer,) = target.ready_pids(timeout=120)
    workers = [int(p) for p in target.wait_for_line("WORKERS")[0].split()[1:]]
    assert len(workers) == 2

    # WHEN the job is listed, traced and its stacks read, and a process that never steps has
    # had its first-step timeout pass
    never_pid = _never_stepping(spawn_group, "nostepjob", "--hang-first-step-timeout", "1", "--hang-timeout", "30")
    _wait_for(lambda: any(a.manifest.get("pid") == never_pid for a in _hang_artifacts()), what="the control's dump")

    # THEN --job means the trainer, the watchdog dumped the process that never steps but no
    # worker, and the workers have no agent: ps shows the trainer alone. (The trainer itself
    # may be dumped too: on a loaded machine its first step, behind two spawned workers, can
    # come later than the 1 s first-step timeout, which is the watchdog doing its job.)
    assert _traced_pids(cli, "dljob") == [trainer]
    assert _stacks_pids(cli, "dljob") == [trainer]
    dumped = {a.manifest.get("pid") for a in _hang_artifacts()}
    assert never_pid in dumped and not dumped & set(workers)
    assert _roles(cli, "dljob") == {trainer: "trainer"}


def test_spawned_workers_slow_to_import_are_not_dumped_before_they_know_they_are_workers(spawn_group, tmp_path):
    # GIVEN a trainer whose persistent DataLoader workers, started with "spawn", are held in the
    # import of the training script (as on a loaded machine), under a 1 s first-step timeout
    gate = tmp_path / "gate"
    gate.mkdir()
    target = spawn_group(
        ["-m", "dynprof", "run", "-q", "--hang-timeout", "1", "--hang-first-step-timeout", "1", "--",
         sys.executable, LOADER, "--persistent", "--seconds", "90"],
        under_run=False,
        env={"DYNPROF_JOB_ID": "gatejob", "DATALOADER_IMPORT_GATE": str(gate)},
    )  # fmt: skip
    _wait_for(lambda: len(list(gate.glob("waiting-*"))) == 2, what="both workers held in their import")
    held = sorted(int(p.name.split("-")[1]) for p in gate.glob("waiting-*"))

    # WHEN a process that never steps, started after them under the same watchdog, has been
    # dumped twice (its first-step timeout and the second dump 3 timeouts later have passed:
    # the workers have been held longer than that), and the workers are then let go
    never_pid = _never_stepping(spawn_group, "gatecontrol", "--hang-timeout", "1", "--hang-first-step-timeout", "1")
    _wait_for(
        lambda: sum(a.manifest.get("pid") == never_pid for a in _hang_artifacts()) >= 2, what="the control's dumps"
    )
    (gate / "open").touch()
    target.ready_pids(timeout=120)
    workers = sorted(int(p) for p in target.wait_for_line("WORKERS")[0].split()[1:])

    # THEN the held processes were the workers, and no watchdog of theirs dumped
    assert workers == held
    assert not {a.manifest.get("pid") for a in _hang_artifacts()} & set(held)


def test_torchrun_launcher_and_ranks_workers(spawn_group, cli):
    # GIVEN torchrun with 2 gloo ranks on this node, each with a spawned DataLoader worker,
    # under a watchdog that waits for the first step
    port = str(free_port())
    target = spawn_group(
        ["-m", "dynprof", "run", "-q", "--job-id", "trjob", "--hang-first-step-timeout", "1",
         "--hang-timeout", "30", "--", sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
         "--master-addr", "127.0.0.1", "--master-port", port, LOADER, "--dist", "--workers", "1",
         "--persistent", "--seconds", "90"],
        under_run=False,
    )  # fmt: skip
    ranks = sorted(target.ready_pids(count=2, timeout=180))
    launcher = target.pid

    # WHEN the job is listed and traced, after the first-step timeout of a control process
    never_pid = _never_stepping(spawn_group, "nostepjob2", "--hang-first-step-timeout", "1", "--hang-timeout", "30")
    agents = _agents(cli, "trjob")
    traced = _traced_pids(cli, "trjob")
    _wait_for(lambda: any(a.manifest.get("pid") == never_pid for a in _hang_artifacts()), what="the control's dump")

    # THEN --job traces the ranks, the launcher (which never steps) wrote no hang dump, and
    # ps shows the launcher and the two ranks (no worker)
    assert traced == ranks
    assert launcher not in {a.manifest.get("pid") for a in _hang_artifacts()}
    assert {a["pid"]: a.get("role") for a in agents} == {launcher: "launcher", ranks[0]: "trainer", ranks[1]: "trainer"}
    assert sorted(a["rank"] for a in agents if a["pid"] in ranks) == [0, 1]


def test_a_phase_marked_evaluation_is_not_a_hang_but_an_unmarked_stall_is(spawn_group, cli):
    # GIVEN a loop under a 4 s watchdog that evaluates for 12 s inside dynprof.phase("eval"),
    # then trains, then stalls without a mark (4 s: a training step of this loop starved on a
    # loaded machine stays far below it, so the only dump is the stall's)
    target = spawn_group(
        ["-m", "dynprof", "run", "-q", "--hang-timeout", "4", "--", sys.executable, PHASE, "--eval-seconds", "12"],
        under_run=False,
    )

    # WHEN the evaluation runs, and later the stall has lasted past the timeout
    (pid,) = [int(line.split()[1]) for line in target.wait_for_line("EVAL", timeout=90)]
    in_eval = [a for a in json.loads(cli("ps", "--json").stdout)["agents"] if a["pid"] == pid]
    target.wait_for_line("STALL", timeout=60)
    _wait_for(lambda: bool(_hang_artifacts()), what="the stall's dump")

    # THEN ps named the phase, and the only dump is of the stall
    dumps = _hang_artifacts()
    assert {a.manifest["summary"]["main_thread"][0].split(" (")[0] for a in dumps} == {"stall_unmarked"}
    assert [a.get("phase") for a in in_eval] == ["eval"]


@pytest.mark.gdb_calls
@pytest.mark.skipif(shutil.which("gdb") is None, reason="attach to Python < 3.14 needs gdb on PATH")
def test_attach_job_attaches_the_trainer_and_skips_its_dataloader_workers(spawn_group, cli):
    # GIVEN a trainer started without dynprof, with 2 persistent DataLoader workers ("spawn")
    target = spawn_group([LOADER, "--persistent", "--seconds", "90"], under_run=False, env={"DYNPROF_JOB_ID": "atjob"})
    (trainer,) = target.ready_pids(timeout=120)
    workers = sorted(int(p) for p in target.wait_for_line("WORKERS")[0].split()[1:])

    # WHEN the job is attached to
    result = cli("attach", "--job", "atjob", "--json")

    # THEN only the trainer got an agent, the workers are named as skipped, and it exits 0
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads(result.stdout)
    assert [(p["pid"], p["status"]) for p in report["processes"]] == [(trainer, "attached")]
    assert sorted(s["pid"] for s in report["skipped"] if "DataLoader worker" in s["why"]) == workers
    assert _roles(cli, "atjob") == {trainer: "trainer"}
