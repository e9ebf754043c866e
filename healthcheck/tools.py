"""The processes the healthcheck starts (its own child, srun's tasks, a link test's side): tools,
not jobs, so no dynprof agent starts in them."""

from __future__ import annotations

import os
import subprocess


def tool_env() -> dict[str, str]:
    """This process's environment without DYNPROF: a tool, not a job: no agent in it."""
    env = dict(os.environ)
    env.pop("DYNPROF", None)
    return env


def start_tool(argv: list[str]) -> subprocess.Popen[bytes]:
    """``argv`` started in its own session (its process group ends with it), no stdin, its
    stdout and stderr piped, in :func:`tool_env`. OSError where it cannot start."""
    return subprocess.Popen(
        argv,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=tool_env(),
        start_new_session=True,
    )
