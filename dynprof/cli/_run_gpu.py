"""`dynprof run --gpu-coredump`: arm the CUDA driver's user-triggered GPU core dump in the job.

The driver reads these variables when CUDA starts in each process: with
``CUDA_ENABLE_USER_TRIGGERED_COREDUMP=1`` it creates the pipe ``CUDA_COREDUMP_PIPE`` (here in
dynprof's runtime directory, one per host and process: ``%h``, ``%p``), and a write into that
pipe makes it dump the GPU's state (the kernels that run, where each warp is) to
``CUDA_COREDUMP_FILE`` (here inside the artifact store). ``CUDA_COREDUMP_GENERATION_FLAGS``
asks for a light dump (no GPU memory, no constant banks) and no host ``abort()`` afterwards; the
process's GPU work still ends with the dump (on an H200 its next CUDA call failed, docs/watch.md).
``skip_constbank_memory`` must go with ``skip_global_memory``: on an H200 (driver 580.159) a dump
that skips global memory but not the constant banks stops after its 68 KiB header, for good,
whenever a kernel is running (5 of 5 tries); with both skipped it is whole in 0.3 s (4.8 MB).

This arms it; ``dynprof gpu-coredump`` and ``dynprof watch --gpu-coredump`` write into the pipe
and read the dump (collectors/gpu_coredump.py). A variable the user already set is kept as it
is, and said.
"""

from __future__ import annotations

import argparse
import socket
import sys

from dynprof import errors
from dynprof.cli._run_options import RUN_OPTIONS
from dynprof.paths import ensure_private_dir, run_dir

GENERATION_FLAGS = (
    "skip_abort,skip_nonrelocated_elf_images,skip_global_memory,skip_shared_memory,skip_local_memory,"
    "skip_constbank_memory"
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("GPU core dump")
    group.add_argument(
        "--gpu-coredump",
        action="store_true",
        help="arm the CUDA driver's user-triggered GPU core dump in every process of the job "
        "(CUDA_ENABLE_USER_TRIGGERED_COREDUMP=1, its pipe in dynprof's runtime directory, its "
        "dumps in the store): `dynprof gpu-coredump --pid PID --yes` and `dynprof watch --gpu-coredump` take "
        "one and name the kernels (a dump ends the process's GPU work). Put -- before the command.",
    )


def coredump_environment(pipe_dir: str, dump_dir: str) -> dict[str, str]:
    """The variables that arm the dump, pipes in ``pipe_dir`` and dumps in ``dump_dir``."""
    return {
        "CUDA_ENABLE_USER_TRIGGERED_COREDUMP": "1",
        "CUDA_COREDUMP_PIPE": f"{pipe_dir}/corepipe.cuda.%h.%p",
        "CUDA_COREDUMP_FILE": f"{dump_dir}/core.cuda.%h.%p.%t",
        "CUDA_COREDUMP_GENERATION_FLAGS": GENERATION_FLAGS,
    }


def apply(args: argparse.Namespace, env: dict[str, str]) -> None:
    if not getattr(args, "gpu_coredump", False):
        return
    from dynprof.store import ArtifactStore, safe_segment

    job = env.get("DYNPROF_JOB_ID") or "nojob"
    pipe_dir = run_dir() / "gpu-coredump" / safe_segment(job)
    try:
        ensure_private_dir(pipe_dir.parent)
        ensure_private_dir(pipe_dir)
        dump_dir = ArtifactStore().private_dir(safe_segment(job), safe_segment(socket.gethostname()), ".gpu-coredump")
    except (OSError, errors.DynprofError) as exc:
        raise errors.DynprofError(
            f"cannot create the GPU core dump directories: {exc}",
            help="Check DYNPROF_RUN_DIR and DYNPROF_ARTIFACT_DIR, or run without --gpu-coredump.",
        ) from None
    kept = []
    for name, value in coredump_environment(str(pipe_dir), str(dump_dir)).items():
        if env.get(name, value) != value:
            kept.append(f"{name}={env[name]}")
            continue
        env[name] = value
    env["DYNPROF_GPU_COREDUMP"] = "1"
    if kept:
        print(f"dynprof: GPU core dump: kept your {', '.join(kept)}", file=sys.stderr)
    flags = env.get("CUDA_COREDUMP_GENERATION_FLAGS", "").split(",")
    if "skip_global_memory" in flags and "skip_constbank_memory" not in flags:
        print(
            "dynprof: GPU core dump: your CUDA_COREDUMP_GENERATION_FLAGS skip global memory but not the constant "
            "banks; on an H200 (driver 580) such a dump stops after its header while a kernel runs: add "
            "skip_constbank_memory",
            file=sys.stderr,
        )
    if not getattr(args, "quiet", False):
        print(f"dynprof: GPU core dump armed: pipes in {pipe_dir}, dumps in {dump_dir}", file=sys.stderr)


RUN_OPTIONS.append((add_arguments, apply))
