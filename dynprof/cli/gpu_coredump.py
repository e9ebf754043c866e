"""Dump the GPU state of a process and name the kernels it runs: it ENDS the process's GPU work.

    dynprof gpu-coredump --pid 4242 --yes
    dynprof gpu-coredump --read core.cuda.vm.4242.1764000000   # name the kernels of a dump

For a rank that waits for its GPU behind a kernel that does not end: the CUDA driver dumps
the GPU's state (grids, blocks, warps, modules) and dynprof reads which kernels were running,
with their launch sizes and how many warps each had on the GPU. The process must have been
started with `dynprof run --gpu-coredump` (the driver's user-triggered core dump, armed through
its environment when CUDA starts). The dump is kept as a `gpu-coredump` artifact (cuda-gdb
reads it too: `cuda-gdb -ex "target cudacore FILE"`).

The dump is destructive: after it, the process's next CUDA call fails (on an H200, driver 580:
`unspecified launch failure`). Take it of a job you are going to restart, never of one you
hope recovers; `--yes` says you know.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from dynprof import errors
from dynprof.arguments import seconds
from dynprof.cli._common import add_json, printable_lines
from dynprof.result import Result

WHY_YES = (
    "a GPU core dump ends the process's GPU work: its next CUDA call fails (on an H200: `unspecified launch "
    "failure`), so the job must be restarted"
)


def _pid(text: str) -> int:
    try:
        pid = int(text, 10)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a process id: {text!r}") from None
    if not 0 < pid < 1 << 22:
        raise argparse.ArgumentTypeError(f"not a process id: {text!r}")
    return pid


class GpuCoredumpCommand:
    """Dump the GPU state of a process and name the kernels it runs: it ENDS the process's GPU work."""

    def prepare_parser(self, parser: argparse.ArgumentParser) -> None:
        what = parser.add_mutually_exclusive_group(required=True)
        what.add_argument("--pid", type=_pid, help="the process (started with `dynprof run --gpu-coredump`)")
        what.add_argument("--read", metavar="FILE", help="only read a GPU core dump file and name its kernels")
        parser.add_argument("--yes", action="store_true", help="take the dump although it ends the GPU work")
        parser.add_argument(
            "--timeout", type=seconds, default=60.0, metavar="SEC", help="wait this long for the dump (default 60)"
        )
        add_json(parser)

    def collect(self, args: argparse.Namespace) -> Result:
        from collectors import gpu_coredump as gc

        if args.read:
            try:
                dump = gc.read_dump(args.read)
            except gc.DumpError as exc:
                raise errors.ArtifactError(str(exc)) from None
            return Result(doc={"pid": None, "artifact": None, "dump": dump.to_dict()})
        if not args.yes:
            raise errors.UsageError(
                f"not taken: {WHY_YES}",
                help=f"Say --yes to take it: `dynprof gpu-coredump --pid {args.pid} --yes`.",
            )
        return take(args.pid, args.timeout, progress=lambda m: print(f"dynprof: {m}", file=sys.stderr))

    def render(self, result: Result) -> str:
        return render_dump(result.doc)


_EXIT = {
    "no-process": errors.ProcessNotFound,
    "permission": errors.PermissionDenied,
    "not-armed": errors.Unsupported,
    "timeout": errors.Timeout,
}


def take(pid: int, timeout: float, progress: Any = None) -> Result:
    """Dump process ``pid``'s GPUs, keep the dump as an artifact, and name its kernels."""
    from collectors import gpu_coredump as gc

    try:
        doc = gc.take(pid, timeout=timeout, progress=progress)
    except gc.TriggerError as exc:
        raise _EXIT.get(exc.kind, errors.DynprofError)(exc.message, help=exc.help) from None
    if doc.get("dump") is None:
        return Result(
            doc=doc,
            exit_code=1,
            messages=[f"the dump was taken ({doc['artifact']}) but dynprof cannot read it: {doc.get('error')}"],
        )
    return Result(doc=doc)


def render_dump(doc: dict[str, Any]) -> str:
    dump = doc.get("dump")
    if not dump:
        return printable_lines(str(doc.get("error") or "no dump"))
    lines = []
    head = f"process {doc['pid']}: " if doc.get("pid") else ""
    running = [g for g in dump["grids"] if g["warps"] > 0 or g["status"] == "active"]
    if not running:
        lines.append(f"{head}no kernel was running on its GPU when it was dumped")
    else:
        lines.append(f"{head}{len(running)} kernel{'s' if len(running) != 1 else ''} running on its GPU:")
    for g in running:
        grid, block = tuple(g["grid"]), tuple(g["block"])
        lines.append(f"  {g['kernel']}")
        lines.append(
            f"      grid {grid} block {block} on cuda:{g['device']}, {g['warps']} warps resident, "
            f"grid {g['grid_id']} {g['status']}"
        )
    for note in dump.get("notes") or []:
        lines.append(f"  note: {note}")
    if doc.get("artifact"):
        lines.append(f"dump kept in {doc['artifact']} ({dump['size_bytes']} bytes; cuda-gdb reads it too)")
    return "\n".join(printable_lines(line) for line in lines)
