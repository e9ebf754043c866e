"""``stop``: end this node's running traces, each followed until its artifact is written
(:func:`collect`); a whole job's, rank by rank, is the job layer's per-rank merge of the
nodes' answers, each read with :meth:`Stopped.from_json` (the sidecar's ``stop`` row names it).
``dynprof stop`` and the sidecar's ``stop`` action answer with these.

The processes stop at their next step boundary (or at once on the main thread when they have
no optimizer steps), then export the trace in the background.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, ClassVar

from collectors.torch_trace import WRITING_AT_EXIT, result_from_store
from dynprof import errors
from dynprof.agents import parallel, resolve
from dynprof.client import AgentClient
from dynprof.job.answers import ProcessResults
from dynprof.node_requests import StopRequest
from dynprof.output import Progress, printable
from dynprof.proto import pb


@dataclass
class Stopped(ProcessResults):
    """One node's ``stop`` answer (``dynprof stop --json``, the sidecar's ``stop`` action): a row
    per process (``results``: pid, rank, status, artifact, error; read back with
    :meth:`~dynprof.job.answers.ProcessResults.from_json`); ``none_stopping`` when no process had
    a trace to stop (its text is then the errors; not part of the document)."""

    none_stopping: bool = False
    WHAT: ClassVar[str] = "stop"


def collect(request: StopRequest, progress: Progress | None = None) -> Stopped:
    """This node's stop of ``request``'s traces, each followed until written unless
    ``no_wait`` (``progress``: where it says so meanwhile)."""
    records = resolve(pids=list(request.pids) or None, job=request.job)
    clients = [AgentClient.for_record(r) for r in records]
    replies = parallel(lambda c: c.request(stop_trace=pb.StopTraceRequest()), clients)
    at_exit: dict[int, str | None] = {}  # pid -> where its trace is being written at exit
    stopping = []
    results: list[dict[str, Any]] = []
    messages: list[str] = []
    for record, client, reply in zip(records, clients, replies):
        if isinstance(reply, Exception):
            not_running = getattr(reply, "code", None) == pb.NOT_RUNNING
            results.append(
                {
                    "pid": record.pid,
                    "rank": record.rank,
                    "status": "not-running" if not_running else "failed",
                    "artifact": None,
                    "error": str(reply),
                }
            )
        else:
            trace = reply.trace_stopped.trace
            stopping.append((record, client, trace.group_id))
            if trace.state == "exporting" and trace.last_artifact_status == WRITING_AT_EXIT:
                where = f" to {trace.last_artifact}" if trace.last_artifact else " into the store"
                messages.append(
                    printable(f"pid {record.pid}: the job is exiting and its trace is being written at exit{where}")
                )
                at_exit[record.pid] = trace.last_artifact or None
    if not stopping:
        return Stopped(exit_code=1, results=results, none_stopping=True)
    if not request.no_wait:
        if progress is None:
            progress = Progress(enabled=False)
        deadline = time.monotonic() + request.timeout
        pending = list(stopping)
        while pending:
            states = parallel(lambda p: p[1].status().trace, pending)
            still = []
            for item, st in zip(pending, states):
                record, _, group = item
                if isinstance(st, Exception):
                    # The process went away (it exited once its loop ended, say) after the
                    # stop was accepted: the agent finishes the export on the way out, so
                    # the artifact of this request's group may well be in the store.
                    found = result_from_store(record, group, 0)
                    if found is None and isinstance(st, (errors.Timeout, errors.Busy)) and record.is_alive():
                        still.append(item)  # a busy agent, not a lost one: ask again
                        continue
                    results.append(
                        {
                            "pid": record.pid,
                            "rank": record.rank,
                            "status": found["status"],
                            "artifact": found["artifact"],
                            "error": found["error"],
                        }
                        if found is not None
                        else {
                            "pid": record.pid,
                            "rank": record.rank,
                            "status": "failed",
                            "artifact": None,
                            "error": f"lost contact with the process before it wrote a trace: {st}",
                        }
                    )
                elif st.state == "idle" and st.group_id == group:
                    results.append(
                        {
                            "pid": record.pid,
                            "rank": record.rank,
                            "status": st.last_artifact_status or "failed",
                            "artifact": st.last_artifact or None,
                            "error": st.last_error or None,
                        }
                    )
                else:
                    still.append(item)
            pending = still
            if pending:
                if time.monotonic() > deadline:
                    progress.done()
                    raise errors.Timeout(
                        f"the trace of {len(pending)} process(es) was not written within {request.timeout:g} s",
                        help="See `dynprof ps` and `dynprof ls`.",
                    )
                progress.update(f"stopping: waiting for {len(pending)} artifact(s)")
                time.sleep(0.1)
        progress.done()
    else:
        results.extend(
            {
                "pid": r.pid,
                "rank": r.rank,
                "status": WRITING_AT_EXIT if r.pid in at_exit else "stopping",
                "artifact": at_exit.get(r.pid),
                "error": None,
            }
            for r, _, _ in stopping
        )
    ok = all(r["status"] in ("complete", "partial", "stopping", WRITING_AT_EXIT) for r in results)
    return Stopped(exit_code=0 if ok else 1, messages=messages, results=results)
