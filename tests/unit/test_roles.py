"""dynprof.roles (what a process is in its job) and dynprof.phase."""

from __future__ import annotations

import threading

import pytest

import dynprof
from dynprof import _phase, roles
from dynprof.agents import select_workers
from dynprof.registry import AgentRecord
from tests.support.records import agent_record


def _record(pid: int, ppid: int = 1, rank: int | None = None, role: str | None = None, job: str = "j") -> AgentRecord:
    return agent_record(pid, ppid=ppid, rank=rank, job_id=job, role=role)


@pytest.mark.parametrize(
    ("argv", "launcher"),
    [
        (["python", "-m", "torch.distributed.run", "--nproc-per-node", "2", "t.py"], True),
        (["/v/bin/python", "/v/bin/torchrun", "t.py"], True),
        (["/v/bin/python", "/v/bin/accelerate", "launch", "t.py"], True),
        (["/v/bin/python", "/v/bin/accelerate", "config"], False),
        (["python", "-m", "accelerate.commands.launch", "t.py"], True),
        (["python", "train.py", "--out", "torchrun"], False),
        (["python", "-c", "from multiprocessing.spawn import spawn_main", "--multiprocessing-fork"], False),
    ],
)
def test_launcher_command_lines(argv, launcher):
    assert roles.is_launcher_cmdline(argv) is launcher


def _role(**facts):
    """The role ``roles.decide`` gives a process of no rank that has not stepped, given ``facts``."""
    base = dict(
        stepped=False,
        worker=lambda: False,
        launcher_cmdline=False,
        has_agent_children=lambda: False,
        rank=None,
        mp_child=False,
    )
    return roles.decide(**{**base, **facts})


def test_a_process_that_stepped_is_a_trainer_whatever_else_it_is():
    # GIVEN every other fact pointing elsewhere, WHEN the process stepped, THEN it is a trainer
    role = _role(
        stepped=True, worker=lambda: True, launcher_cmdline=True, has_agent_children=lambda: True, mp_child=True
    )
    assert role == roles.TRAINER


def test_roles_before_the_first_step():
    assert _role(worker=lambda: True, rank=0) == roles.WORKER
    assert _role(has_agent_children=lambda: True) == roles.LAUNCHER
    assert _role(launcher_cmdline=True, rank=3) == roles.LAUNCHER  # torchrun under srun knows SLURM_PROCID
    assert _role(rank=1) == roles.TRAINER
    assert _role(rank=1, mp_child=True) == roles.OTHER  # a helper spawned by rank 1 inherits RANK=1
    assert _role() == roles.OTHER


def test_a_wrapper_without_ranks_is_the_launcher_of_its_child():
    # GIVEN a wrapper and the script it runs as a child, neither knowing a rank (defect: the
    # child was taken for a DataLoader worker of its parent, and --job targeted the wrapper)
    wrapper, child = _record(100, role=roles.OTHER), _record(101, ppid=100, role=roles.TRAINER)
    # WHEN the job's targets are chosen, THEN the child is
    assert [r.pid for r in select_workers([wrapper, child])] == [101]
    assert roles.job_roles([wrapper, child]) == {100: roles.LAUNCHER, 101: roles.TRAINER}


def test_records_without_roles_from_older_agents():
    launcher = _record(100)
    r0, r1 = _record(101, ppid=100, rank=0), _record(102, ppid=100, rank=1)
    helper_of_r0 = _record(103, ppid=101, rank=0)
    assert roles.job_roles([launcher, r0, r1, helper_of_r0]) == {
        100: roles.LAUNCHER,
        101: roles.TRAINER,
        102: roles.TRAINER,
        103: roles.OTHER,
    }


def test_workers_and_launchers_are_never_targets_even_without_a_trainer():
    records = [_record(100, role=roles.LAUNCHER), _record(101, ppid=100, role=roles.WORKER), _record(102)]
    assert [r.pid for r in select_workers(records)] == [102]


def test_a_bad_role_in_a_record_is_refused():
    data = _record(5).to_dict() | {"role": "root"}
    with pytest.raises(ValueError, match="role"):
        AgentRecord.from_dict(data)


def test_roles_from_proc():
    job_env = {"DYNPROF_JOB_ID": "j"}
    trainer = (["python", "train.py"], job_env)
    spawn_child = [
        "python",
        "-c",
        "from multiprocessing.spawn import spawn_main; spawn_main()",
        "--multiprocessing-fork",
    ]
    assert roles.role_from_proc(spawn_child, job_env, trainer) == roles.WORKER
    assert roles.role_from_proc(["python", "train.py"], job_env, trainer) == roles.WORKER  # a forked copy
    assert roles.role_from_proc(["python", "-m", "torch.distributed.run", "t.py"], job_env, None) == roles.LAUNCHER
    assert roles.role_from_proc(["python", "train.py"], {**job_env, "RANK": "0"}, None) == roles.TRAINER
    assert roles.role_from_proc(["python", "train.py"], job_env, None) == roles.OTHER


def test_phase_as_context_manager_and_decorator_nests_and_reports():
    # GIVEN no phase in progress
    assert _phase.current() is None

    @dynprof.phase("checkpoint")
    def save() -> tuple[str, float] | None:
        return _phase.current()

    # WHEN phases run, nested and as a decorator
    with dynprof.phase("eval"):
        outer = _phase.current()
        inner = save()
        after_inner = _phase.current()
    # THEN the innermost is reported while it runs, and none after
    assert outer is not None and outer[0] == "eval"
    assert inner is not None and inner[0] == "checkpoint"
    assert after_inner == outer
    assert _phase.current() is None
    assert _phase.busy_until(1e12) >= outer[1]


def test_phase_never_raises_and_lets_exceptions_through():
    class Bad:
        def __str__(self) -> str:
            raise RuntimeError("no name")

    with pytest.raises(KeyError), dynprof.phase(Bad()):  # type: ignore[arg-type]
        raise KeyError("the job's own")
    assert _phase.current() is None


def test_phase_in_threads_keeps_each_threads_phase():
    mark = dynprof.phase("load")
    barrier = threading.Barrier(4)

    def work() -> None:
        with mark:
            barrier.wait(timeout=10)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=10)
    assert _phase.current() is None


def test_attach_job_counts_a_process_that_exited_meanwhile_as_gone(monkeypatch, capsys):
    # GIVEN a job whose search found a trainer (attached) and a short-lived process that exited
    # before its turn came (its attach fails: no such process)
    import json
    import os
    import subprocess
    import sys

    from dynprof import errors
    from dynprof.attach import AttachResult
    from dynprof.attach._discover import JobProcess, JobSearch
    from dynprof.cli import attach as attach_cli
    from dynprof.cli import main

    exited = subprocess.Popen([sys.executable, "-c", "pass"])
    exited.wait()
    found = [JobProcess(os.getpid(), 1, "DYNPROF_JOB_ID", None), JobProcess(exited.pid, 1, "DYNPROF_JOB_ID", None)]
    monkeypatch.setattr(attach_cli, "find_job_processes", lambda job: JobSearch(job, found, []))

    def attach_many(pids, options, quiet=False):
        return [AttachResult(pid=pids[0], status="attached", method="test"), errors.ProcessNotFound("gone")]

    monkeypatch.setattr(attach_cli, "attach_many", attach_many)

    # WHEN the job is attached
    code = main(["attach", "--job", "J", "--json"])

    # THEN it succeeds, and the exited process is reported gone, not failed
    assert code == 0
    processes = json.loads(capsys.readouterr().out)["processes"]
    assert [(p["pid"], p["status"]) for p in processes] == [(os.getpid(), "attached"), (exited.pid, "gone")]


def test_sidecar_job_section_shows_roles_and_acts_on_the_trainers_only():
    # GIVEN ps rows of a job: a launcher and its two trainers
    from dynprof.sidecar.app import _job_section

    def row(pid: int, role: str, rank: int | None) -> dict:
        return {
            "pid": pid,
            "role": role,
            "rank": rank,
            "host": "h",
            "step": 3,
            "state": "idle",
            "age_s": 1,
            "cmdline": ["python"],
        }

    rows = [row(100, "launcher", None), row(101, "trainer", 0), row(102, "trainer", 1)]
    # WHEN the page's section of the job is rendered
    page = _job_section("j", rows, read_only=False, job_wide=False)
    # THEN every process is listed with its role, and the buttons act on the trainers
    assert "data-pids='101,102'" in page
    assert page.count("<td class='role'>") == 3 and "<td class='role'>launcher</td>" in page


def test_a_helper_started_by_multiprocessing_does_not_make_its_parent_a_launcher():
    # GIVEN a trainer before its first step with a spawned helper process (an agent, no rank),
    # and a wrapper whose child runs the script
    trainer = _record(100, role=roles.OTHER)
    helper = _record(101, ppid=100, role=roles.OTHER)
    helper.cmdline = ["python", "-c", "from multiprocessing.spawn import spawn_main", "--multiprocessing-fork"]
    wrapper, script = _record(200, role=roles.OTHER), _record(201, ppid=200, role=roles.OTHER)
    # WHEN their roles are read, THEN only the wrapper is a launcher
    assert roles.job_roles([trainer, helper, wrapper, script]) == {
        100: roles.OTHER,
        101: roles.OTHER,
        200: roles.LAUNCHER,
        201: roles.OTHER,
    }


def test_the_processes_left_out_of_a_job_are_named_once_per_process(capsys):
    # GIVEN a job of a launcher and its trainer, selected again and again (a watch's every look
    # reads the stacks twice and the flight recorder once)
    from dynprof import agents

    launcher, trainer = _record(7001, rank=None, job="once-job"), _record(7002, ppid=7001, rank=0, job="once-job")
    launcher.role, trainer.role = roles.LAUNCHER, roles.TRAINER

    # WHEN the job's targets are chosen three times, then once more with a new process left out
    for _ in range(3):
        agents._note_left_out("once-job", [launcher, trainer], [trainer])
    first = capsys.readouterr().err
    worker = _record(7003, ppid=7002, rank=None, role=roles.WORKER, job="once-job")
    agents._note_left_out("once-job", [launcher, trainer, worker], [trainer])
    second = capsys.readouterr().err

    # THEN the launcher is named once, and the new set of processes left out once again
    assert first.count("not targeting 1 process(es) that are not trainers: pid 7001 (a launcher)") == 1
    assert first.count("\n") == 1
    assert "not targeting 2 process(es)" in second and "pid 7003 (a DataLoader worker)" in second
