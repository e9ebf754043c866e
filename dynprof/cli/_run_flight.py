"""`dynprof run --flight-recorder [N]`: turn on PyTorch's flight recorder for the job.

Which variables to set depends on the torch version (they were renamed over time): they are
detected in the installed torch's libraries (collectors.flight_recorder.detect_environment).
Dumps go inside the artifact store (``<store>/<job>/<host>/.flight-recorder/``, where torch's
dump-on-timeout writes too) and the on-demand dump pipes into the runtime directory.
"""

from __future__ import annotations

import argparse
import socket
import sys

from dynprof import errors
from dynprof.cli._run_options import RUN_OPTIONS
from dynprof.paths import ensure_private_dir, run_dir

MAX_ENTRIES = 1_000_000


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from collectors.flight_recorder import DEFAULT_ENTRIES

    group = parser.add_argument_group("NCCL flight recorder")
    group.add_argument(
        "--flight-recorder",
        type=int,
        nargs="?",
        const=DEFAULT_ENTRIES,
        metavar="N",
        help="record the last N collectives of every process group with PyTorch's flight "
        f"recorder (default N: {DEFAULT_ENTRIES}); read them with `dynprof nccl`. "
        "Put -- before the command.",
    )


def apply(args: argparse.Namespace, env: dict[str, str]) -> None:
    entries = getattr(args, "flight_recorder", None)
    if entries is None:
        return
    if not 0 < entries <= MAX_ENTRIES:
        raise errors.UsageError(f"--flight-recorder takes 1..{MAX_ENTRIES} entries, not {entries}")
    from collectors import flight_recorder as fr
    from dynprof.store import ArtifactStore, safe_segment

    job = env.get("DYNPROF_JOB_ID") or "nojob"
    host = socket.gethostname()
    pipe_dir = run_dir() / "flight" / safe_segment(job)
    dump_dir = ArtifactStore().private_dir(safe_segment(job), safe_segment(host), ".flight-recorder")
    try:
        ensure_private_dir(pipe_dir.parent)
        ensure_private_dir(pipe_dir)
    except OSError as exc:
        raise errors.DynprofError(f"cannot create the flight-recorder directories: {exc}") from None
    det = fr.detect_environment()
    env.update(fr.recorder_environment(entries, str(dump_dir / "nccl_trace_rank_"), str(pipe_dir / "rank_"), det))
    env["DYNPROF_FLIGHT_RECORDER"] = str(entries)
    if not det.detected:
        print(
            f"dynprof: flight recorder: torch not found from {sys.executable}; setting every known variable "
            f"({', '.join(fr.KNOWN_VARS)})",
            file=sys.stderr,
        )
    elif not getattr(args, "quiet", False):
        names = sorted(n for n in fr.KNOWN_VARS if n in env)
        print(
            f"dynprof: flight recorder: {entries} entries (torch {det.torch_version}: {', '.join(names)})",
            file=sys.stderr,
        )


RUN_OPTIONS.append((add_arguments, apply))
