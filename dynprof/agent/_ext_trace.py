"""Agent extension: on-demand torch.profiler traces (``start_trace`` / ``stop_trace``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from dynprof.agent._trace import TraceController

if TYPE_CHECKING:
    from dynprof.agent._agent import Agent


def install(agent: Agent) -> TraceController:
    controller = TraceController(agent)
    agent.trace = controller  # type: ignore[attr-defined]
    agent.handlers["start_trace"] = controller.handle_start
    agent.handlers["stop_trace"] = controller.handle_stop
    agent.exit_callbacks.append(controller.at_exit)
    return controller
