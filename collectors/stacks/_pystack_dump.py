"""Read a process's (or a core file's) stacks with pystack and print them as a process dump
(``dynprof.stacks.process``, :meth:`collectors.stacks.model.ProcessStacks.to_json`).

Runs as a subprocess of the CLI (``python -m collectors.stacks._pystack_dump --pid PID [--native]``) so a
failure inside pystack's native reader can never take the CLI down, and so several targets are
read in parallel. Exit 0 with JSON on stdout, or exit 1 with one line on stderr.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any


def _frames(thread: Any, native: bool) -> list[dict[str, Any]]:
    """Frames innermost first; with ``native``, C frames merged in at the interpreter's eval loops."""
    from pystack.types import NativeFrame, frame_type

    def py(frame: Any) -> dict[str, Any]:
        loc = dict(frame.arguments or {})
        loc.update(frame.locals or {})
        return {
            "function": frame.code.scope,
            "file": frame.code.filename,
            "line": int(frame.code.location.lineno),
            "native": False,
            "library": None,
            "locals": {str(k): str(v) for k, v in loc.items()} or None,
        }

    def c(nf: Any) -> dict[str, Any]:
        return {
            "function": nf.symbol,
            "file": nf.path,
            "line": int(nf.linenumber or 0),
            "native": True,
            "library": nf.library,
            "locals": None,
        }

    py_frames = [f for f in thread.all_frames]
    outer_first: list[dict[str, Any]] = []
    eval_count = sum(
        1 for f in thread.native_frames if frame_type(f, thread.python_version) == NativeFrame.FrameType.EVAL
    )
    entry_count = sum(1 for f in py_frames if f.is_entry)
    if native and thread.native_frames and eval_count == entry_count:
        it = iter(py_frames)
        current = next(it, None)
        for nf in thread.native_frames:
            kind = frame_type(nf, thread.python_version)
            if kind == NativeFrame.FrameType.EVAL:
                # One eval-loop frame runs an entry frame and the frames it calls in-line.
                while current is not None:
                    if not current.is_shim:
                        outer_first.append(py(current))
                    current = next(it, None)
                    if current is not None and current.is_entry:
                        break
            elif kind == NativeFrame.FrameType.OTHER:
                outer_first.append(c(nf))
    else:
        outer_first = [py(f) for f in py_frames if not f.is_shim]
        if native and thread.native_frames:
            # Could not interleave: keep the C frames innermost, after the Python ones.
            outer_first += [
                c(nf)
                for nf in thread.native_frames
                if frame_type(nf, thread.python_version) == NativeFrame.FrameType.OTHER
            ]
    return list(reversed(outer_first))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    target = parser.add_mutually_exclusive_group(required=True)
    target.add_argument("--pid", type=int)
    target.add_argument("--core")
    parser.add_argument("--executable")
    parser.add_argument("--native", action="store_true")
    parser.add_argument("--locals", action="store_true")
    args = parser.parse_args(argv)
    try:
        from pystack.engine import NativeReportingMode, get_process_threads, get_process_threads_for_core
    except ImportError as exc:
        print(f"pystack is not installed (pip install pystack): {exc}", file=sys.stderr)
        return 1
    mode = NativeReportingMode.PYTHON if args.native else NativeReportingMode.OFF
    t0 = time.time()
    try:
        if args.pid is not None:
            threads = list(get_process_threads(args.pid, stop_process=True, native_mode=mode, locals=args.locals))
            pid = args.pid
            method = "pystack"
        else:
            from pystack.engine import CoreFileAnalyzer

            executable = args.executable
            if not executable:
                executable = str(CoreFileAnalyzer(args.core).extract_executable())
            pid = 0
            try:
                pid = int(CoreFileAnalyzer(args.core, executable).extract_pid())
            except Exception:
                pass
            threads = list(get_process_threads_for_core(args.core, executable, native_mode=mode, locals=args.locals))
            method = "pystack-core"
    except Exception as exc:
        print(f"{type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    out = []
    for t in threads:
        gil = t.holds_the_gil
        out.append(
            {
                "tid": int(t.tid),
                "name": t.name,
                "main": int(t.tid) == pid,
                "holds_gil": None if gil is None or gil < 0 else bool(gil),
                "active": None,
                "frames": _frames(t, args.native),
            }
        )
    if out and not any(t["main"] for t in out):
        out[0]["main"] = True
    json.dump(
        {
            "schema": "dynprof.stacks.process",  # what collectors.stacks.model reads (kept free of its imports)
            "schema_version": 2,
            "pid": pid,
            "method": method,
            "native": args.native,
            "threads": out,
            "captured_at": t0,
            "notes": [f"core file {args.core}"] if args.core else [],
        },
        sys.stdout,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
