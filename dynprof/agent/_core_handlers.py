"""Commands every agent answers: ``ping`` and ``status``."""

from __future__ import annotations

import json
import sys
from typing import TYPE_CHECKING, Any

from dynprof import __version__, _phase
from dynprof.proto import pb

if TYPE_CHECKING:
    from dynprof.agent._agent import Agent


def install(agent: Agent) -> None:
    def ping(_: Any) -> tuple[str, Any]:
        return "pong", pb.Pong(dynprof_version=__version__)

    def status(_: Any) -> tuple[str, Any]:
        ident = agent.identity
        steps = agent.steps
        steps.fold_compiled()
        trace = getattr(agent, "trace", None)
        in_phase = _phase.current()
        gpu = steps.gpu.look(sys.modules.get("torch"))
        checkpoint = getattr(getattr(agent, "memory", None), "checkpoint", None)
        return "status", pb.Status(
            pid=agent.pid,
            step=steps.step,
            step_time_s=steps.step_time_s,
            last_step_at=steps.last_step_at,
            torch_imported="torch" in sys.modules,
            cuda_initialized=agent.cuda_initialized(),
            step_hook_installed=steps.hook_installed,
            trace=trace.state_pb() if trace is not None else pb.TraceState(state="unavailable"),
            job_id=ident.job_id or "",
            rank=ident.rank if ident.rank is not None else -1,
            world_size=ident.world_size if ident.world_size is not None else -1,
            dynprof_version=__version__,
            started_at=agent.started_at,
            memory_history=str(getattr(agent, "memory_history_policy", "off")),
            memory_history_detail=str(getattr(agent, "memory_history_detail", "")),
            role=agent.role,
            phase=in_phase[0] if in_phase else "",
            phase_since=in_phase[1] if in_phase else 0.0,
            checkpoint_json=json.dumps(checkpoint.status()) if checkpoint is not None else "",
            gpu_step=pb.GpuStep(
                recorded=gpu.recorded,
                step=gpu.step,
                done=gpu.done,
                age_s=gpu.age_s,
                device=gpu.device,
                device_uuid=gpu.device_uuid,
                note=gpu.note,
                coredump_armed=gpu.coredump_armed,
                probed=gpu.probed,
                probe_done=gpu.probe_done,
                probe_age_s=gpu.probe_age_s,
            ),
        )

    agent.handlers["ping"] = ping
    agent.handlers["status"] = status
