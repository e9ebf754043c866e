"""The child process of an action that runs apart from the sidecar, both sides of it.

The sidecar (:func:`run_child`) starts ``python -m dynprof.sidecar.child`` in a new session for
an action that must not run in its own process: ``healthcheck`` (it drives the GPUs and must
not leave CUDA state in the sidecar), ``link-test`` (one side of a link test, torch.distributed
with gloo or NCCL) and every job-wide action (a merge of up to 4096 nodes' answers must not
stay in the sidecar's heap, and a child, with its connections, can be killed past the action's
limit, which a thread cannot). Past the limit, its whole process group is killed.

The child (:func:`main`) reads one request from stdin, ``{"action": NAME, "options": {...},
"hosts": [HOST[:PORT], ...] or null, "cacert": FILE or null}`` (the options the sidecar
checked), reads the options as the action's request (its row of :data:`ACTIONS`) and collects
it, or, job-wide, calls the row's job-wide function (the same options sent to every node's
sidecar, reached with the token of $DYNPROF_TOKEN_FILE, the sidecar's own, and for https
trusting ``cacert``), and writes the answer on stdout as one JSON object:
``{"result": to_json(), "exit_code", "messages", "error": null or {type, message, help,
exit_code}}``. Nothing rendered is written.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from typing import Any

from dynprof import errors, jsontext
from dynprof.job.merge import Reach, client_of
from dynprof.nodes import parse_node
from dynprof.procs import kill_group
from dynprof.result import error_json
from dynprof.sidecar.outcome import MAX_OUTPUT_BYTES, Outcome, error_lines, failed, message_lines
from dynprof.sidecar.table import ACTIONS

CHILD_MODULE = "dynprof.sidecar.child"  # this module, as ``python -m`` runs it
MAX_REQUEST_CHARS = 1024 * 1024
SUBPROCESS_GRACE_S = 10.0


# -- the sidecar's side --------------------------------------------------------------------------
def run_child(
    name: str,
    checked: Any,
    timeout: float,
    extra_env: dict[str, str] | None = None,
    failed_exit: int = 1,
) -> Outcome:
    """``python -m dynprof.sidecar.child`` in a new session, asked (on its stdin) to run the
    action with the ``checked`` options (:meth:`Checked.to_json`); it answers the kind's answer
    as JSON on its stdout. Past ``timeout`` plus the grace period, the whole process group is
    killed (a healthcheck's own workers too)."""
    env = dict(os.environ)
    env.pop("DYNPROF", None)  # the child is a tool, not a job: no agent in it
    env.update(extra_env or {})
    limit = timeout + SUBPROCESS_GRACE_S
    request = json.dumps(checked.to_json(name))
    with _children_lock:
        if _closing:
            return failed(errors.Timeout("the sidecar is stopping"))
        proc = subprocess.Popen(
            [sys.executable, "-m", CHILD_MODULE],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            errors="replace",
            env=env,
            start_new_session=True,
        )
        _children.add(proc)
    try:
        out, err = proc.communicate(request, timeout=limit)
    except subprocess.TimeoutExpired:
        kill_group(proc)
        proc.communicate()
        return failed(errors.Timeout(f"{name} ran past {limit:g} s; it and its process group were killed"))
    except BaseException:
        kill_group(proc)
        proc.wait()
        raise
    finally:
        if proc.poll() is None:  # pragma: no cover - communicate() returned with the child alive
            kill_group(proc)
            proc.wait()
        kill_group(proc)  # workers the child left behind in its group
        with _children_lock:
            _children.discard(proc)
    if _closing and proc.returncode < 0:
        return failed(errors.Timeout("the sidecar stopped while this ran; it was killed"))
    extra = [line for line in err[-65536:].splitlines() if line.strip()]
    if proc.returncode < 0:
        return _killed(name, -proc.returncode, failed_exit, extra)
    outcome = child_answer(name, out, proc.returncode, failed_exit)
    outcome.messages.extend(extra)
    return outcome


def _killed(name: str, signum: int, exit_code: int, extra: list[str]) -> Outcome:
    try:
        what = signal.Signals(signum).name
    except ValueError:
        what = f"signal {signum}"
    exc = errors.DynprofError(
        f"{name} could not finish: its process was killed by {what} before it answered",
        help="SIGKILL usually means the kernel's out-of-memory killer (see `dmesg`) or an operator; "
        "run it again, or run `dynprof " + name + "` on the node to see it end.",
    )
    exc.exit_code = exit_code
    outcome = failed(exc)
    outcome.messages.extend(extra)
    return outcome


def child_answer(name: str, out: str, returncode: int, failed_exit: int) -> Outcome:
    """The child's answer (its stdout): ``{"result", "exit_code", "messages", "error"}``."""

    def broken(why: str) -> Outcome:
        exc = errors.DynprofError(f"{name} ended without an answer (exit {returncode}): {why}")
        exc.exit_code = failed_exit
        return failed(exc)

    if len(out) > MAX_OUTPUT_BYTES + 65536:
        return broken(f"its answer is over {MAX_OUTPUT_BYTES >> 20} MiB")
    if not out.strip():
        return broken("it wrote nothing")
    try:
        doc = json.loads(out)
    except (ValueError, RecursionError):
        return broken("its output is not JSON")
    if not isinstance(doc, dict):
        return broken("its output is not a JSON object")
    code = doc.get("exit_code")
    if isinstance(code, bool) or not isinstance(code, int):
        return broken("its answer has no exit code")
    error = doc.get("error")
    if isinstance(error, dict):
        message = str(error.get("message") or "")[:4000]
        help_text = str(error.get("help") or "")[:4000]
        doc_error = {
            "type": str(error.get("type") or "DynprofError")[:100],
            "message": message,
            "help": help_text,
            "exit_code": code,
        }
        return Outcome(code, {"error": doc_error}, error_lines(errors.DynprofError(message, help_text)), doc_error)
    return Outcome(code, doc.get("result"), message_lines(doc.get("messages")))


_children: set[subprocess.Popen[str]] = set()
_children_lock = threading.Lock()
_closing = False


def kill_children() -> int:
    """Kill the process groups of the actions' child processes still running (the sidecar is
    stopping: a healthcheck must not outlive it); no new ones start. Returns how many."""
    global _closing
    with _children_lock:
        _closing = True
        running = list(_children)
    for proc in running:
        kill_group(proc)
    return len(running)


# -- the child's side ----------------------------------------------------------------------------
def answer(name: str, options: dict[str, Any], hosts: list[str] | None, cacert: str | None) -> dict[str, Any]:
    """Run one action's row; its answer (or the error it stopped on) as the child's answer."""
    row = ACTIONS[name]
    try:
        if hosts is not None:
            if row.job is None:
                raise errors.UsageError(f"{name} runs on this node only")
            row.decode(options)  # a value the request refuses: the usage error, as on a node
            nodes = [parse_node(h) for h in hosts]
            result = row.job(options, nodes, Reach(client_of(None, cacert)))
        else:
            result = row.collect(row.decode(options))
    except errors.DynprofError as exc:
        return {"result": None, "exit_code": exc.exit_code, "messages": [], "error": error_json(exc)}
    return {"result": result.to_json(), "exit_code": result.exit_code, "messages": result.messages, "error": None}


def main() -> int:
    try:
        request = read_request(sys.stdin.read(MAX_REQUEST_CHARS + 1))
    except ValueError as exc:
        print(f"dynprof: bad action request: {exc}", file=sys.stderr)
        return 2
    out = sys.stdout
    sys.stdout = sys.stderr  # whatever the command prints stays out of the answer
    try:
        doc = answer(request["action"], request["options"], request["hosts"], request["cacert"])
    finally:
        sys.stdout = out
    text = jsontext.dumps(doc, default=str)
    if len(text) > MAX_OUTPUT_BYTES:
        too_large = errors.DynprofError(
            f"the answer of {request['action']} is over {MAX_OUTPUT_BYTES >> 20} MiB: refused",
            help="Narrow the request (--job, --pid, fewer hosts).",
        )
        text = jsontext.dumps({"result": None, "exit_code": 1, "messages": [], "error": error_json(too_large)})
    out.write(text)
    out.flush()
    return 0


def read_request(text: str) -> dict[str, Any]:
    """The request a sidecar writes (checked: the child is started by the sidecar alone, but
    a malformed request must end in a message, not a traceback)."""
    if len(text) > MAX_REQUEST_CHARS:
        raise ValueError("over 1 MiB")
    doc = json.loads(text)
    # an action that is not a string (a list, an object) is no known action, not a TypeError
    if not isinstance(doc, dict) or not isinstance(doc.get("action"), str) or doc["action"] not in ACTIONS:
        raise ValueError("no known action")
    options = doc.get("options")
    if not isinstance(options, dict) or not all(isinstance(k, str) for k in options):
        raise ValueError("options is not a JSON object")
    hosts = doc.get("hosts")
    if hosts is not None and (not isinstance(hosts, list) or not hosts or not all(isinstance(h, str) for h in hosts)):
        raise ValueError("hosts is not a list of HOST[:PORT]")
    cacert = doc.get("cacert")
    if cacert is not None and not isinstance(cacert, str):
        raise ValueError("cacert is not a file name")
    return {"action": doc["action"], "options": options, "hosts": hosts, "cacert": cacert}


if __name__ == "__main__":
    sys.exit(main())
