"""Run a command with the dynprof agent in every Python process it starts.

    dynprof run -- python train.py --lr 3e-4
    dynprof run -- torchrun --nproc-per-node 8 train.py

Sets DYNPROF=1 and puts a start-up hook on PYTHONPATH, so the launcher and every worker
(torchrun's, multiprocessing's) load the agent without a code change. The command replaces
this process (exec), so its exit code and signals are its own. All ranks share one job id
(printed here; see `dynprof ps`): the scheduler's (TORCHELASTIC_RUN_ID, SLURM_JOB_ID) or,
without one, a generated id.
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import sys
import time
from pathlib import Path

import dynprof
from dynprof import errors
from dynprof.cli._run_options import RUN_OPTIONS, load_run_options
from dynprof.paths import MAX_SOCKET_PATH, run_dir
from dynprof.safetext import one_line, shell_word, valid_text

BOOTSTRAP_DIR = Path(dynprof.__file__).resolve().parent / "_bootstrap"


def generated_job_id() -> str:
    host = socket.gethostname().split(".")[0]
    return f"{host}-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"


def build_environment(args: argparse.Namespace, base: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ if base is None else base)
    env["DYNPROF"] = "1"
    paths = [str(BOOTSTRAP_DIR)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
    env["DYNPROF_HOME"] = str(Path(dynprof.__file__).resolve().parent.parent)
    job = args.job_id or env.get("DYNPROF_JOB_ID")
    if not job:
        elastic = env.get("TORCHELASTIC_RUN_ID")
        job = env.get("SLURM_JOB_ID") or (elastic if elastic and elastic != "none" else None)
    env["DYNPROF_JOB_ID"] = job or generated_job_id()
    for apply in (a for _, a in RUN_OPTIONS):
        apply(args, env)
    return env


def banner(job: str, cmd: list[str]) -> str:
    """What ``dynprof run`` says before it runs ``cmd``: the job id as the agents record it
    (bytes that are not UTF-8 as ``\\xNN``, :func:`dynprof.safetext.valid_text`), and a ``ps``
    command line that finds it when pasted (:func:`dynprof.safetext.shell_word`)."""
    recorded = valid_text(job)
    lines = [f"dynprof: job {one_line(recorded, None)}: agent enabled for {one_line(' '.join(cmd), None)}"]
    if recorded != job:
        lines.append(
            "dynprof: the job id is not UTF-8: the agents record each byte that is not as \\xNN "
            "(four characters), and --job takes it so spelled or as the same bytes"
        )
    lines.append(f"dynprof: see it with `dynprof ps --job {shell_word(recorded)}`")
    return "\n".join(lines)


class RunCommand:
    """Run a command with the dynprof agent in every Python process it starts.

    dynprof run [--job-id ID] -- python train.py ...
    dynprof run -- torchrun --nproc-per-node 8 train.py ...
    """

    def prepare_parser(self, parser: argparse.ArgumentParser) -> None:
        load_run_options()
        parser.add_argument("--job-id", help="job id for `--job` selection (default: the scheduler's, or generated)")
        parser.add_argument("--quiet", "-q", action="store_true", help="do not print the job id banner")
        for add, _ in RUN_OPTIONS:
            add(parser)
        parser.add_argument("cmd", nargs=argparse.REMAINDER, metavar="-- CMD [ARGS...]", help="the command to run")

    def run(self, args: argparse.Namespace) -> int:
        cmd = list(args.cmd)
        if cmd and cmd[0] == "--":
            cmd = cmd[1:]
        if not cmd:
            raise errors.UsageError("no command given", help="Write it after --: dynprof run -- python train.py")
        exe = shutil.which(cmd[0])
        if exe is None:
            raise errors.UsageError(f"command not found: {cmd[0]}", help="Check the name and your PATH.")
        # An unusable runtime directory is said here, once, not by every process of the job.
        longest_socket = run_dir() / "agents" / "4194304.sock"
        if len(str(longest_socket).encode()) > MAX_SOCKET_PATH:
            raise errors.DynprofError(
                f"the dynprof runtime directory {run_dir(create=False)} is too long a path for the agents' "
                f"sockets (at most {MAX_SOCKET_PATH} bytes)",
                help="Set DYNPROF_RUN_DIR to a shorter path, such as /tmp/dynprof-$(id -u).",
            )
        env = build_environment(args)
        if not args.quiet:
            print(banner(env["DYNPROF_JOB_ID"], cmd), file=sys.stderr)
        sys.stdout.flush()
        sys.stderr.flush()
        try:
            os.execvpe(exe, cmd, env)
        except OSError as exc:
            raise errors.DynprofError(f"cannot run {cmd[0]}: {exc}") from None
        return 0  # not reached
