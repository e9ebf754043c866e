"""The commands every agent answers (dynprof/agent/_core_handlers.py): ``ping`` with the
version, and ``status`` with the agent's counters, identity, phase and GPU step as they are now,
unknown values sent as -1 or a named absence."""

from __future__ import annotations

import types

import dynprof
from dynprof import __version__
from dynprof.agent import _core_handlers
from dynprof.agent._steps import StepTracker
from dynprof.identity import Identity
from dynprof.proto import pb


class _Agent:
    def __init__(self, identity: Identity) -> None:
        self.identity = identity
        self.steps = StepTracker()
        self.pid = 4242
        self.started_at = 1234.5
        self.role = "trainer"
        self.handlers: dict = {}

    def cuda_initialized(self) -> bool:
        return False


def _installed(identity: Identity) -> _Agent:
    agent = _Agent(identity)
    _core_handlers.install(agent)  # type: ignore[arg-type]
    return agent


def test_ping_answers_pong_with_the_version():
    # GIVEN an agent with the core handlers
    agent = _installed(Identity(host="h", rank=None, local_rank=None, world_size=None, job_id=None))

    # WHEN pinged
    field, reply = agent.handlers["ping"](pb.Ping())

    # THEN pong, with this dynprof's version
    assert field == "pong" and reply.dynprof_version == __version__


def test_status_reports_the_agents_counters_and_identity():
    # GIVEN an agent of rank 3 of 8 in job j, at step 41
    agent = _installed(Identity(host="node-1", rank=3, local_rank=1, world_size=8, job_id="j"))
    agent.steps.step = 41
    agent.steps.step_time_s = 0.25
    agent.steps.last_step_at = 999.0
    agent.memory_history_policy = "auto"  # type: ignore[attr-defined]

    # WHEN asked for its status
    field, status = agent.handlers["status"](pb.StatusRequest())

    # THEN the reply says what the agent holds
    assert field == "status"
    assert (status.pid, status.step, status.step_time_s, status.last_step_at) == (4242, 41, 0.25, 999.0)
    assert (status.job_id, status.rank, status.world_size) == ("j", 3, 8)
    assert (status.role, status.started_at, status.dynprof_version) == ("trainer", 1234.5, __version__)
    assert status.memory_history == "auto"
    assert status.cuda_initialized is False


def test_status_of_an_agent_that_knows_nothing_yet_says_so():
    # GIVEN an agent with no rank, no job, no trace controller and no memory policy
    agent = _installed(Identity(host="h", rank=None, local_rank=None, world_size=None, job_id=None))

    # WHEN asked for its status
    _, status = agent.handlers["status"](pb.StatusRequest())

    # THEN unknown numbers are -1, the trace is "unavailable", the memory history "off"
    assert (status.rank, status.world_size, status.job_id) == (-1, -1, "")
    assert status.trace.state == "unavailable"
    assert status.memory_history == "off"
    assert status.gpu_step.recorded is False and status.gpu_step.note, "the GPU step says why it has none"


def test_status_names_the_phase_in_progress():
    # GIVEN an agent and a phase the job is in
    agent = _installed(Identity(host="h", rank=0, local_rank=0, world_size=1, job_id="j"))

    # WHEN asked inside the phase and after it
    with dynprof.phase("checkpoint"):
        _, inside = agent.handlers["status"](pb.StatusRequest())
    _, after = agent.handlers["status"](pb.StatusRequest())

    # THEN the phase and its start are named while it lasts only
    assert inside.phase == "checkpoint" and inside.phase_since > 0
    assert (after.phase, after.phase_since) == ("", 0.0)


def test_status_counts_compiled_steps_not_yet_folded(monkeypatch):
    # GIVEN a compiled optimizer step that nothing has folded into the count yet
    from dynprof.agent import _steps

    monkeypatch.setattr(_steps, "_ON_COMPILED_STEP", [None])
    agent = _installed(Identity(host="h", rank=0, local_rank=0, world_size=1, job_id="j"))
    _steps.COMPILED_STEPS.step = True

    # WHEN asked for its status
    _, status = agent.handlers["status"](pb.StatusRequest())

    # THEN the step is counted
    assert status.step == 1


def test_status_shows_the_trace_controllers_state():
    # GIVEN an agent whose trace controller is tracing
    agent = _installed(Identity(host="h", rank=0, local_rank=0, world_size=1, job_id="j"))
    agent.trace = types.SimpleNamespace(state_pb=lambda: pb.TraceState(state="tracing", steps=5))  # type: ignore[attr-defined]

    # WHEN asked for its status
    _, status = agent.handlers["status"](pb.StatusRequest())

    # THEN the trace's own state is in the reply
    assert (status.trace.state, status.trace.steps) == ("tracing", 5)
