"""PyTorch's flight recorder (NCCL and, in newer torch, Gloo): set-up, capture and analysis.

Set-up (``dynprof run --flight-recorder N``): :func:`detect_environment` finds which variables
the installed torch reads by looking for their names in its libraries' read-only data (torch
renamed them over versions: ``TORCH_NCCL_TRACE_BUFFER_SIZE`` -> ``TORCH_FR_BUFFER_SIZE``,
``TORCH_NCCL_DEBUG_INFO_TEMP_FILE`` -> ``TORCH_FR_DUMP_TEMP_FILE``; the on-demand dump pipe
``TORCH_NCCL_DEBUG_INFO_PIPE_FILE`` and ``TORCH_NCCL_DUMP_ON_TIMEOUT`` exist in NCCL builds);
:func:`recorder_environment` sets those.

Capture: in the process (the agent calls :func:`dump_in_process`, which uses whichever of
``torch._C._distributed_c10d._dump_nccl_trace`` / ``_dump_fr_trace`` (and their ``_json``
forms) the torch version has), or from outside through the dump pipe (:func:`dump_through_pipe`,
no GIL needed; NCCL only).

Analysis (:func:`analyze`): per process group, the last collective sequence number each rank
enqueued / started / completed, the collective the furthest ranks wait in, and which ranks never
enqueued it.
"""

from __future__ import annotations

import ast
import importlib.util
import io
import json
import os
import pickle
import struct
import sys
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dynprof.safetext import one_line

KIND = "nccl"
SCHEMA = "dynprof.flight_recorder"
SCHEMA_VERSION = 1
DEFAULT_ENTRIES = 2000

BUFFER_VARS = ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE")
DUMP_FILE_VARS = ("TORCH_FR_DUMP_TEMP_FILE", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE")
PIPE_VARS = ("TORCH_NCCL_DEBUG_INFO_PIPE_FILE",)
ON_TIMEOUT_VARS = ("TORCH_NCCL_DUMP_ON_TIMEOUT",)
KNOWN_VARS = BUFFER_VARS + DUMP_FILE_VARS + PIPE_VARS + ON_TIMEOUT_VARS
DEFAULT_DUMP_PREFIX = "/tmp/nccl_trace_rank_"  # torch's default for the dump file


class NotEnabled(Exception):
    """The process was not started with the flight recorder on."""


class DumpError(Exception):
    pass


# -- which variables does this torch read? ------------------------------------------------------
@dataclass
class EnvDetection:
    torch_version: str | None
    libraries: list[str] = field(default_factory=list)
    names: set[str] = field(default_factory=set)
    detected: bool = False  # False: torch or its libraries not found; every known name is set

    def reads(self, name: str) -> bool:
        return name in self.names if self.detected else True


def torch_libraries() -> tuple[str | None, list[Path]]:
    """The installed torch's version and its libraries, found without importing torch."""
    try:
        from importlib.metadata import version

        torch_version: str | None = version("torch")
    except Exception:
        torch_version = None
    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.submodule_search_locations:
        return torch_version, []
    lib = Path(next(iter(spec.submodule_search_locations))) / "lib"
    names = ("libtorch_cuda.so", "libtorch_cpu.so", "libtorch_hip.so")
    return torch_version, [lib / n for n in names if (lib / n).exists()]


def elf_rodata(path: Path) -> bytes:
    """The read-only data sections of an ELF64 little-endian shared library."""
    with open(path, "rb") as fh:
        head = fh.read(64)
        if head[:4] != b"\x7fELF" or head[4] != 2 or head[5] != 1:
            raise ValueError(f"{path} is not an ELF64 little-endian file")
        (shoff,) = struct.unpack_from("<Q", head, 0x28)
        shentsize, shnum, shstrndx = struct.unpack_from("<HHH", head, 0x3A)
        fh.seek(shoff)
        table = fh.read(shentsize * shnum)
        sections = [struct.unpack_from("<IIQQQQIIQQ", table, i * shentsize) for i in range(shnum)]
        strtab = sections[shstrndx]
        fh.seek(strtab[4])
        names = fh.read(strtab[5])
        chunks = []
        for sec in sections:
            name = names[sec[0] : names.index(b"\0", sec[0])]
            if name.startswith(b".rodata") and sec[1] != 8:  # 8: SHT_NOBITS
                fh.seek(sec[4])
                chunks.append(fh.read(sec[5]))
        return b"\0".join(chunks)


def names_in(data: bytes, candidates: Iterable[str]) -> set[str]:
    found = set()
    for name in candidates:
        needle = name.encode() + b"\0"
        start = 0
        while True:
            i = data.find(needle, start)
            if i < 0:
                break
            if i == 0 or not (chr(data[i - 1]).isalnum() or data[i - 1] == ord("_")):
                found.add(name)
                break
            start = i + 1
    return found


def detect_environment() -> EnvDetection:
    torch_version, libs = torch_libraries()
    det = EnvDetection(torch_version=torch_version, libraries=[str(p) for p in libs])
    for lib in libs:
        try:
            det.names |= names_in(elf_rodata(lib), KNOWN_VARS)
            det.detected = True
        except (OSError, ValueError, struct.error):
            continue
    return det


def recorder_environment(entries: int, dump_prefix: str, pipe_prefix: str, det: EnvDetection) -> dict[str, str]:
    """The variables that turn the recorder on for this torch, dump into ``dump_prefix<rank>``
    and open the on-demand pipe ``pipe_prefix<rank>.pipe``."""
    env: dict[str, str] = {}
    for name in BUFFER_VARS:
        if det.reads(name):
            env[name] = str(entries)
    for name in DUMP_FILE_VARS:
        if det.reads(name):
            env[name] = dump_prefix
    for name in PIPE_VARS:
        if det.reads(name):
            env[name] = pipe_prefix
    for name in ON_TIMEOUT_VARS:
        if det.reads(name):
            env[name] = "1"
    return env


def buffer_entries(environ: dict[str, str] | os._Environ[str]) -> int:
    for name in BUFFER_VARS:
        try:
            value = int(environ.get(name, "0") or 0)
        except ValueError:
            continue
        if value > 0:
            return value
    return 0


# -- capture ----------------------------------------------------------------------------------
class _DataOnly(pickle.Unpickler):
    """Unpickles plain data (dict, list, str, numbers) and refuses every class."""

    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(f"refusing {module}.{name} in a flight-recorder dump")


def load_dump_bytes(data: bytes) -> dict[str, Any]:
    text = data.lstrip()
    if text.startswith(b"{"):
        return dict(json.loads(data))
    return dict(_DataOnly(io.BytesIO(data)).load())


FAMILIES = (
    ("nccl", ("_dump_nccl_trace", "_dump_nccl_trace_json")),
    ("fr", ("_dump_fr_trace", "_dump_fr_trace_json")),
)


def dump_in_process(include_stack_traces: bool = True, only_active: bool = False) -> dict[str, Any]:
    """Every recorder this torch has, as data. Runs inside the training process (agent thread)."""
    if "torch" not in sys.modules:
        raise DumpError("torch is not imported in this process")
    if not buffer_entries(os.environ):
        raise NotEnabled("the flight recorder is off in this process (" + "/".join(BUFFER_VARS) + " unset or 0)")
    torch = sys.modules["torch"]
    dist = getattr(torch, "distributed", None)
    if dist is None or not dist.is_available() or not dist.is_initialized():
        raise DumpError("torch.distributed is not initialised in this process")
    c10d = torch._C._distributed_c10d
    dumps: dict[str, Any] = {}
    errors: dict[str, str] = {}
    for family, (pickled, as_json) in FAMILIES:
        for name in (pickled, as_json):
            fn = getattr(c10d, name, None)
            if fn is None:
                continue
            try:
                if name == pickled:
                    raw = fn(True, include_stack_traces, only_active)
                else:
                    raw = fn(True, only_active)
                dumps[family] = load_dump_bytes(raw if isinstance(raw, bytes) else str(raw).encode())
                dumps[family]["_function"] = name
                break
            except Exception as exc:  # one family failing leaves the others
                errors[name] = f"{type(exc).__name__}: {exc}"
    if not dumps:
        raise DumpError(
            "no flight-recorder dump function worked: "
            + ("; ".join(f"{k}: {v}" for k, v in errors.items()) or f"torch {torch.__version__} has none")
        )
    return {
        "schema": SCHEMA,
        "schema_version": SCHEMA_VERSION,
        "torch_version": str(torch.__version__),
        "method": "agent",
        "dumps": dumps,
        "errors": errors,
        "captured_at": time.time(),
    }


def process_environ(pid: int) -> dict[str, str]:
    with open(f"/proc/{pid}/environ", "rb") as fh:
        raw = fh.read()
    env = {}
    for item in raw.split(b"\0"):
        if b"=" in item:
            k, v = item.split(b"=", 1)
            env[k.decode(errors="replace")] = v.decode(errors="replace")
    return env


def dump_through_pipe(pid: int, rank: int, timeout: float = 10.0) -> tuple[bytes, str]:
    """Ask torch's own watchdog thread for a dump by writing to its pipe; no GIL needed.

    Returns the raw dump and the path torch wrote it to.
    """
    try:
        env = process_environ(pid)
    except OSError as exc:
        raise DumpError(f"cannot read the environment of pid {pid}: {exc.strerror}") from None
    if not buffer_entries(env):
        raise NotEnabled(f"pid {pid} was not started with the flight recorder")
    stem = next((env[v] for v in PIPE_VARS if env.get(v)), "")
    if not stem:
        raise DumpError(f"pid {pid} has no flight-recorder dump pipe ({PIPE_VARS[0]} unset)")
    prefix = next((env[v] for v in DUMP_FILE_VARS if env.get(v)), DEFAULT_DUMP_PREFIX)
    pipe, out = f"{stem}{rank}.pipe", Path(f"{prefix}{rank}")
    before = out.stat().st_mtime_ns if out.exists() else 0
    try:
        fd = os.open(pipe, os.O_WRONLY | os.O_NONBLOCK)
    except OSError as exc:
        raise DumpError(f"cannot open the dump pipe {pipe}: {exc.strerror} (a NCCL process group must exist)") from None
    try:
        os.write(fd, b"1\n")
    finally:
        os.close(fd)
    deadline = time.monotonic() + timeout
    last_size = -1
    while time.monotonic() < deadline:
        time.sleep(0.1)
        try:
            st = out.stat()
        except OSError:
            continue
        if st.st_mtime_ns != before and st.st_size > 0:
            if st.st_size == last_size:
                return out.read_bytes(), str(out)
            last_size = st.st_size
    raise DumpError(f"torch wrote no dump to {out} within {timeout:g} s of the request on {pipe}")


# -- analysis ---------------------------------------------------------------------------------
def _int(value: Any, default: int = -1) -> int:
    try:
        return int(value)
    except (TypeError, ValueError):
        return default


def _ranks_of(config: dict[str, Any]) -> list[int]:
    ranks = config.get("ranks")
    if isinstance(ranks, str):
        try:
            ranks = ast.literal_eval(ranks)
        except (ValueError, SyntaxError):
            return []
    return [int(r) for r in ranks] if isinstance(ranks, (list, tuple)) else []


@dataclass
class RankState:
    rank: int
    enqueued: int = -1
    started: int = -1
    completed: int = -1
    entries: dict[int, dict[str, Any]] = field(default_factory=dict)  # collective seq -> entry


def _pg_key(entry: dict[str, Any]) -> str:
    pg = entry.get("process_group")
    if isinstance(pg, (list, tuple)) and pg:
        return str(pg[0])
    return str(entry.get("pg_id", "?"))


def _user_frame(entry: dict[str, Any]) -> str | None:
    from collectors.stacks import is_library_path, short_path

    for f in entry.get("frames") or []:
        name, filename, line = f.get("name"), str(f.get("filename", "")), f.get("line")
        if filename and not is_library_path(filename) and "torch/" not in filename:
            return f"{name} ({short_path(filename)}:{line})"
    return None


def describe(entry: dict[str, Any]) -> str:
    sizes = entry.get("input_sizes")
    dtypes = entry.get("input_dtypes")
    text = f"#{_int(entry.get('collective_seq_id'))} {entry.get('profiling_name', '?')}"
    if sizes:
        text += f" {sizes}"
    if dtypes:
        text += f" {','.join(map(str, dtypes))}"
    where = _user_frame(entry)
    if where:
        text += f" from {where}"
    return text


def analyze(per_rank: dict[int, dict[str, Any]]) -> dict[str, Any]:
    """Analyse every rank's dump (``{global rank: dump document}``), per process group."""
    groups: dict[str, dict[str, Any]] = {}
    for rank, doc in per_rank.items():
        for family, dump in (doc.get("dumps") or {}).items():
            entries = [e for e in dump.get("entries") or [] if not e.get("is_p2p")]
            status = dump.get("pg_status") or {}
            configs = dump.get("pg_config") or {}
            pg_ids: dict[str, str] = {}
            for e in entries:
                pg_ids.setdefault(str(e.get("pg_id", "?")), _pg_key(e))
            for pg_id in status:
                pg_ids.setdefault(str(pg_id), str(pg_id))
            for pg_id, name in pg_ids.items():
                key = f"{family}:{name}"
                g = groups.setdefault(
                    key, {"family": family, "name": name, "pg_id": pg_id, "desc": "", "ranks": [], "states": {}}
                )
                cfg = configs.get(name) or (next(iter(configs.values())) if len(configs) == 1 else {})
                if cfg and not g["ranks"]:
                    g["ranks"] = _ranks_of(cfg)
                    g["desc"] = cfg.get("desc") or g["desc"]
                st = RankState(rank)
                for e in entries:
                    if str(e.get("pg_id", "?")) != pg_id:
                        continue
                    if (
                        not g["desc"]
                        and isinstance(e.get("process_group"), (list, tuple))
                        and len(e["process_group"]) > 1
                    ):
                        g["desc"] = str(e["process_group"][1])
                    seq = _int(e.get("collective_seq_id"))
                    st.entries[seq] = e
                    st.enqueued = max(st.enqueued, seq)
                    if e.get("state") in ("started", "completed"):
                        st.started = max(st.started, seq)
                    if e.get("state") == "completed" or e.get("retired"):
                        st.completed = max(st.completed, seq)
                s = status.get(pg_id) or status.get(int(pg_id) if pg_id.isdigit() else pg_id) or {}
                if s:
                    st.enqueued = _int(s.get("last_enqueued_collective"), st.enqueued)
                    st.started = _int(s.get("last_started_collective"), st.started)
                    st.completed = _int(s.get("last_completed_collective"), st.completed)
                g["states"][rank] = st
    result = []
    for key, g in sorted(groups.items()):
        states: dict[int, RankState] = g["states"]
        members = sorted(set(g["ranks"]) | set(states)) if g["ranks"] else sorted(states)
        no_dump = [r for r in members if r not in states]
        top = max((s.enqueued for s in states.values()), default=-1)
        waiting = sorted(r for r, s in states.items() if s.enqueued == top and s.completed < top)
        missing = sorted(r for r, s in states.items() if s.enqueued < top)
        entry = next((s.entries[top] for s in states.values() if top in s.entries), None)
        mismatched = []
        if entry is not None:
            for r, s in states.items():
                e = s.entries.get(top)
                if e is not None and (
                    e.get("profiling_name") != entry.get("profiling_name")
                    or e.get("input_sizes") != entry.get("input_sizes")
                ):
                    mismatched.append({"rank": r, "collective": describe(e)})
        last_of_missing = {
            r: describe(states[r].entries[states[r].enqueued])
            if states[r].enqueued in states[r].entries
            else f"#{states[r].enqueued}"
            for r in missing
        }
        hung = bool(waiting) and (bool(missing) or bool(no_dump) or bool(mismatched))
        all_done = not waiting
        if all_done:
            verdict = f"all ranks completed collective #{top}" if top >= 0 else "no collectives recorded"
        else:
            verdict = f"{_ranks(waiting)} wait in {describe(entry) if entry else f'#{top}'}"
            if missing:
                verdict += (
                    f"; missing: {_ranks(missing)} (never enqueued it; last: "
                    + "; ".join(f"rank {r} {d}" for r, d in last_of_missing.items())
                    + ")"
                )
            if no_dump:
                verdict += f"; no dump from {_ranks(no_dump)}"
            if mismatched:
                verdict += "; mismatched: " + "; ".join(f"rank {m['rank']} {m['collective']}" for m in mismatched)
            if not hung:
                verdict += " (every rank enqueued it: the collective is in flight or slow)"
        result.append(
            {
                "key": key,
                "family": g["family"],
                "process_group": g["name"],
                "desc": g["desc"],
                "ranks": members,
                "per_rank": [
                    {"rank": r, "last_enqueued": s.enqueued, "last_started": s.started, "last_completed": s.completed}
                    for r, s in sorted(states.items())
                ],
                "collective": describe(entry) if entry else None,
                "collective_seq": top,
                "waiting": waiting,
                "missing": missing,
                "missing_last": {str(k): v for k, v in last_of_missing.items()},
                "no_dump": no_dump,
                "mismatched": mismatched,
                "hung": hung,
                "verdict": verdict,
            }
        )
    return {"schema": SCHEMA + ".analysis", "schema_version": SCHEMA_VERSION, "process_groups": result}


def _ranks(ranks: list[int]) -> str:
    return ("ranks " if len(ranks) > 1 else "rank ") + ",".join(str(r) for r in ranks)


def _seq(n: int) -> str:
    return "-" if n < 0 else str(n)


def render_analysis(analysis: dict[str, Any]) -> str:
    lines = []
    pgs = analysis.get("process_groups") or []
    if not pgs:
        return "no process group recorded any collective\n"
    for pg in pgs:
        desc = f' "{pg["desc"]}"' if pg.get("desc") else ""
        lines.append(f"process group {pg['process_group']}{desc} ({pg['family']} recorder), ranks {pg['ranks']}")
        lines.append("    rank  last enqueued  last started  last completed")
        for r in pg["per_rank"]:
            lines.append(
                f"    {r['rank']:<4}  {_seq(r['last_enqueued']):<13}  {_seq(r['last_started']):<12}  "
                f"{_seq(r['last_completed'])}"
            )
        lines.append(("  HUNG: " if pg["hung"] else "  ") + pg["verdict"])
        lines.append("")
    return "\n".join(one_line(line) for line in lines)


def render_artifact(artifact: Any) -> tuple[dict[str, Any], str]:
    analysis = artifact.read_json("analysis.json")  # the artifact's own file, with limits
    summary = {
        "process_groups": [
            {k: pg[k] for k in ("process_group", "verdict", "hung", "missing", "waiting")}
            for pg in analysis.get("process_groups", [])
        ]
    }
    notes = (artifact.manifest.get("summary") or {}).get("notes") or []
    text = render_analysis(analysis) + "".join(one_line(f"note: {n}") + "\n" for n in notes)
    return summary, text
