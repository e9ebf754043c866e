"""``--on-verdict CMD``: the user's hook, run on each verdict the watch says."""

from __future__ import annotations

from dataclasses import dataclass

from dynprof.procs import kill_group
from dynprof.watch.model import Verdict

DEFAULT_HOOK_TIMEOUT_S = 30.0


@dataclass
class HookResult:
    ok: bool
    exit_code: int | None
    message: str


def run_hook(command: str, verdict: Verdict, path: str | None, timeout: float = DEFAULT_HOOK_TIMEOUT_S) -> HookResult:
    """``--on-verdict CMD``: ``/bin/sh -c CMD`` with the verdict's JSON on its stdin and
    ``DYNPROF_VERDICT_FILE`` (the artifact's verdict.json, "" when not saved),
    ``DYNPROF_VERDICT_KIND`` and ``DYNPROF_VERDICT_JOB`` in its environment; killed past
    ``timeout``. Its failure is reported, never raised."""
    import json
    import os
    import subprocess

    env = dict(os.environ)
    env.update(
        {
            "DYNPROF_VERDICT_FILE": os.path.join(path, "verdict.json") if path else "",
            "DYNPROF_VERDICT_DIR": path or "",
            "DYNPROF_VERDICT_KIND": verdict.kind,
            "DYNPROF_VERDICT_JOB": verdict.job,
        }
    )
    try:
        proc = subprocess.Popen(
            ["/bin/sh", "-c", command],
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            env=env,
            start_new_session=True,
        )
    except OSError as exc:
        return HookResult(False, None, f"--on-verdict could not start: {exc}")
    try:
        _, err = proc.communicate(json.dumps(verdict.to_json()).encode(), timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_group(proc)
        proc.communicate()
        return HookResult(False, None, f"--on-verdict ran past {timeout:g} s and was killed")
    except BrokenPipeError:
        proc.wait()
        err = b""
    if proc.returncode != 0:
        tail = err.decode("utf-8", "replace").strip().splitlines()[-1:] if err else []
        return HookResult(
            False, proc.returncode, f"--on-verdict exited {proc.returncode}" + (f": {tail[0][:300]}" if tail else "")
        )
    return HookResult(True, 0, "--on-verdict ran")
