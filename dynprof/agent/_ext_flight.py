"""Agent extension: dump PyTorch's flight recorder on request (``flight_recorder_dump``).

The recorder itself is torch's: ``dynprof run --flight-recorder`` sets the variables that turn
it on (see collectors.flight_recorder). This handler asks torch for the dump on the agent's
server thread and writes it where the CLI asked. Nothing runs unless asked.
"""

from __future__ import annotations

import json
import os
from typing import TYPE_CHECKING, Any

from dynprof.agent._ext_stacks import open_output
from dynprof.agent._server import CommandError
from dynprof.errors import FLIGHT_RECORDER_HELP
from dynprof.proto import pb
from dynprof.store import ArtifactStore

if TYPE_CHECKING:
    from dynprof.agent._agent import Agent


def install(agent: Agent) -> None:
    def flight_recorder_dump(msg: Any) -> tuple[str, Any]:
        from collectors import flight_recorder as fr

        try:
            doc = fr.dump_in_process(
                include_stack_traces=bool(msg.include_stack_traces), only_active=bool(msg.only_active)
            )
        except fr.NotEnabled as exc:
            raise CommandError(pb.UNSUPPORTED, str(exc), FLIGHT_RECORDER_HELP) from None
        except fr.DumpError as exc:
            raise CommandError(pb.UNSUPPORTED, str(exc)) from None
        ident = agent.identity
        doc.update(pid=os.getpid(), rank=ident.rank, job=ident.job_id, host=ident.host)
        entries = {k: len(v.get("entries") or []) for k, v in doc["dumps"].items()}
        summary = json.dumps({"entries": entries, "functions": [v.get("_function") for v in doc["dumps"].values()]})
        if msg.output_path:
            fd, path = open_output(msg.output_path)
            with os.fdopen(fd, "w") as fh:
                json.dump(doc, fh, default=str)
            return "artifact", pb.ArtifactWritten(path=str(path), status="complete", summary_json=summary)
        writer = ArtifactStore().create(fr.KIND, job=ident.job_id, host=ident.host, rank=ident.rank)
        writer.write_json(f"rank{ident.rank}-pid{os.getpid()}.json", doc)
        rank = ident.rank if ident.rank is not None else 0
        analysis = fr.analyze({rank: doc})
        writer.write_json("analysis.json", analysis)
        writer.write_text("analysis.txt", fr.render_analysis(analysis))
        art = writer.finish("complete", summary=json.loads(summary))
        return "artifact", pb.ArtifactWritten(path=str(art.path), status="complete", summary_json=summary)

    agent.handlers["flight_recorder_dump"] = flight_recorder_dump
