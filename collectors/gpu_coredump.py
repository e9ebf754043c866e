"""The CUDA driver's user-triggered GPU core dump: take one of a process, and read which kernels ran.

Taking it (:func:`trigger`): a process started with ``CUDA_ENABLE_USER_TRIGGERED_COREDUMP=1``
(``dynprof run --gpu-coredump``) has a named pipe, ``CUDA_COREDUMP_PIPE``, that its CUDA driver
reads; a write into it makes the driver dump the state of the process's GPUs (the grids that
run, their blocks and warps, the modules they come from) into ``CUDA_COREDUMP_FILE``. The names
come from the process's own environment (``/proc/PID/environ``), with the driver's ``%h``
(host), ``%p`` (pid) and ``%t`` (time) expanded. **The dump ends the process's GPU work**: on an
H200 (driver 580, CUDA 13) the process's next CUDA call failed with ``unspecified launch
failure``. Only a user who says so takes one.

Reading it (:func:`read_dump`): the dump is an ELF file (OS ABI 0x33, CUDA) whose sections are
tables (``cudacoredump.h``'s ``CUDBG_SHT_*`` types): devices, grids (each with its kernel's entry
address and module), CTAs and warps (each warp's grid), modules, and each module's relocated
device image, itself an ELF whose symbols name the kernels at those addresses. Nothing in the
file is trusted: every offset, size and count is checked against the file, the counts are
bounded, and a malformed dump is a :class:`DumpError` that says what is wrong, never a traceback.
"""

from __future__ import annotations

import gzip
import mmap
import os
import re
import shutil
import socket
import stat
import struct
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# CUDBG_SHT_* section types (SHT_LOUSER + n)
_LOUSER = 0x80000000
SHT_RELF_IMG = _LOUSER + 7
SHT_DEV_TABLE = _LOUSER + 9
SHT_CTX_TABLE = _LOUSER + 10
SHT_GRID_TABLE = _LOUSER + 12
SHT_CTA_TABLE = _LOUSER + 13
SHT_WP_TABLE = _LOUSER + 14
SHT_MOD_TABLE = _LOUSER + 16
_SHT_SYMTAB = 2
_STT_FUNC = 2
ELFOSABI_CUDA = 0x33
# CUDBGGridStatus
GRID_STATUS = {0: "invalid", 1: "pending", 2: "active", 3: "sleeping", 4: "terminated", 5: "undetermined"}

MAX_DUMP_BYTES = 8 << 30  # a dump without GPU memory is a few MB; one with it may be GBs
MAX_SECTIONS = 4_000_000  # one per warp and lane at most on the largest GPUs
MAX_ENTRIES = 10_000_000
MAX_GRIDS = 4096  # grids reported (of an endless kernel, one or a few run)
MAX_NAME = 4096
MAX_IMAGE_SYMBOLS = 2_000_000

_EHDR = struct.Struct("<16sHHIQQQIHHHHHH")
_SHDR = struct.Struct("<IIQQQQIIQQ")
_SYM = struct.Struct("<IBBHQQ")
_GRID = struct.Struct("<QQQQQQQIIIIIIIIII")  # CudbgGridTableEntry up to blockDimZ
_DEV = struct.Struct("<QQQIII")  # CudbgDeviceTableEntry up to pciDevId
_CTA = struct.Struct("<Q")  # CudbgCTATableEntry.gridId64
_MOD = struct.Struct("<Q")  # CudbgModuleTableEntry.moduleHandle
_CTX = struct.Struct("<QQQQII")  # CudbgContextTableEntry


class DumpError(Exception):
    """The file is not a GPU core dump dynprof can read; the message says why."""


class TriggerError(Exception):
    """No dump could be taken of the process; the message says why, ``help`` what to do."""

    def __init__(self, message: str, help: str = "", kind: str = "failed") -> None:
        super().__init__(message)
        self.message = message
        self.help = help
        self.kind = kind  # "no-process", "permission", "not-armed", "timeout" or "failed"


@dataclass
class Grid:
    """One grid (kernel launch) the dump holds."""

    grid_id: int
    device: int
    status: str
    kernel: str  # demangled where a demangler is on PATH, else as the image names it
    mangled: str
    grid_dim: tuple[int, int, int]
    block_dim: tuple[int, int, int]
    warps: int  # warps of this grid resident on the device when it was dumped
    function_entry: int
    module: int

    def to_dict(self) -> dict[str, Any]:
        return {
            "grid_id": self.grid_id,
            "device": self.device,
            "status": self.status,
            "kernel": self.kernel,
            "mangled": self.mangled,
            "grid": list(self.grid_dim),
            "block": list(self.block_dim),
            "warps": self.warps,
            "function_entry": f"0x{self.function_entry:x}",
            "module": f"0x{self.module:x}",
        }

    def describe(self) -> str:
        g, b = self.grid_dim, self.block_dim
        return f"{self.kernel}<<<({g[0]},{g[1]},{g[2]}),({b[0]},{b[1]},{b[2]})>>>"


@dataclass
class Dump:
    """What :func:`read_dump` found."""

    path: str
    size: int
    devices: list[dict[str, Any]] = field(default_factory=list)
    grids: list[Grid] = field(default_factory=list)
    grids_omitted: int = 0
    notes: list[str] = field(default_factory=list)

    def running(self) -> list[Grid]:
        """The grids that had warps on the GPU, or were active, when it was dumped."""
        return [g for g in self.grids if g.warps > 0 or g.status == "active"]

    def to_dict(self) -> dict[str, Any]:
        return {
            "path": self.path,
            "size_bytes": self.size,
            "devices": self.devices,
            "grids": [g.to_dict() for g in self.grids],
            "grids_omitted": self.grids_omitted,
            "running": [g.describe() for g in self.running()],
            "notes": self.notes,
        }


# -- reading -------------------------------------------------------------------------------------
class _Elf:
    """Section headers of one ELF64 little-endian image in ``buf[base:base+size]``, checked."""

    def __init__(self, buf: Any, base: int, size: int, what: str) -> None:
        self.buf, self.base, self.size, self.what = buf, base, size, what
        if size < _EHDR.size:
            raise DumpError(f"{what}: {size} bytes, too short for an ELF header")
        ident, _t, _m, _v, _e, _ph, shoff, _f, _eh, _phs, _phn, shentsize, shnum, shstrndx = _EHDR.unpack_from(
            buf, base
        )
        if ident[:4] != b"\x7fELF":
            raise DumpError(f"{what}: not an ELF file")
        if ident[4] != 2 or ident[5] != 1:
            raise DumpError(f"{what}: not a 64-bit little-endian ELF file")
        self.osabi = ident[7]
        if shoff == 0:
            self.sections: list[tuple[int, ...]] = []
            return
        if shentsize < _SHDR.size:
            raise DumpError(f"{what}: section headers of {shentsize} bytes (at least {_SHDR.size})")
        first = self._header(shoff, 0, shentsize)
        if shnum == 0:  # more than 0xff00 sections: the count is section 0's sh_size
            shnum = first[5]
        if shstrndx == 0xFFFF:
            shstrndx = first[6]
        if not 0 < shnum <= MAX_SECTIONS:
            raise DumpError(f"{what}: {shnum} sections (at most {MAX_SECTIONS})")
        self.sections = [self._header(shoff, i, shentsize) for i in range(shnum)]
        self.shstrndx = shstrndx if shstrndx < shnum else 0

    def _header(self, shoff: int, i: int, entsize: int) -> tuple[int, ...]:
        at = shoff + i * entsize
        if at < 0 or at + _SHDR.size > self.size:
            raise DumpError(f"{self.what}: section header {i} lies outside the file")
        return _SHDR.unpack_from(self.buf, self.base + at)

    def data(self, index: int) -> tuple[int, int]:
        """(absolute offset, size) of section ``index``'s bytes, inside the image."""
        sh = self.sections[index]
        offset, size = sh[4], sh[5]
        if offset > self.size or size > self.size - offset:
            raise DumpError(f"{self.what}: section {index} lies outside the file")
        return self.base + offset, size

    def string(self, table: int, offset: int) -> str:
        if not 0 <= table < len(self.sections):
            return ""
        start, size = self.data(table)
        if offset >= size:
            return ""
        end = self.buf.find(b"\0", start + offset, start + min(size, offset + MAX_NAME))
        raw = self.buf[start + offset : end if end >= 0 else start + min(size, offset + MAX_NAME)]
        return bytes(raw).decode("utf-8", "replace")

    def name(self, index: int) -> str:
        return self.string(self.shstrndx, self.sections[index][0])

    def entries(self, index: int, layout: struct.Struct) -> list[tuple[int, ...]]:
        start, size = self.data(index)
        entsize = self.sections[index][9]
        if entsize < layout.size:
            raise DumpError(f"{self.what}: section {index} has entries of {entsize} bytes (at least {layout.size})")
        count = size // entsize
        if count > MAX_ENTRIES:
            raise DumpError(f"{self.what}: section {index} has {count} entries (at most {MAX_ENTRIES})")
        return [layout.unpack_from(self.buf, start + i * entsize) for i in range(count)]

    def of_type(self, sh_type: int) -> list[int]:
        return [i for i, sh in enumerate(self.sections) if sh[1] == sh_type]


def _image_symbols(buf: Any, base: int, size: int, what: str) -> tuple[dict[int, str], list[tuple[int, int, str]]]:
    """A device image's function symbols: {address: name} and [(start, end, name)]; and its
    ``.text.NAME`` sections the same way where it has no symbol table."""
    elf = _Elf(buf, base, size, what)
    exact: dict[int, str] = {}
    ranges: list[tuple[int, int, str]] = []
    for idx in elf.of_type(_SHT_SYMTAB):
        strtab = elf.sections[idx][6]
        syms = elf.entries(idx, _SYM)
        if len(syms) > MAX_IMAGE_SYMBOLS:
            raise DumpError(f"{what}: {len(syms)} symbols (at most {MAX_IMAGE_SYMBOLS})")
        for st_name, st_info, _other, _shndx, value, sym_size in syms:
            if st_info & 0xF != _STT_FUNC or not value:
                continue
            name = elf.string(strtab, st_name)
            if name:
                exact.setdefault(value, name)
                ranges.append((value, value + max(1, sym_size), name))
    for i, sh in enumerate(elf.sections):
        addr, sec_size = sh[3], sh[5]
        name = elf.name(i)
        if addr and name.startswith(".text.") and len(name) > 6:
            exact.setdefault(addr, name[6:])
            ranges.append((addr, addr + max(1, sec_size), name[6:]))
    return exact, ranges


def read_dump(path: str | os.PathLike[str], demangle: Callable[[list[str]], list[str]] | None = None) -> Dump:
    """The grids of a GPU core dump and the kernels they run (see the module's docstring).
    A gzip-compressed dump is read too. Raises :class:`DumpError` for anything else."""
    p = Path(path)
    try:
        with open(p, "rb") as fh:
            head = fh.read(4)
            size = os.fstat(fh.fileno()).st_size
            if size > MAX_DUMP_BYTES:
                raise DumpError(f"{p}: {size} bytes, over the {MAX_DUMP_BYTES >> 30} GiB dynprof reads")
            if head[:2] == b"\x1f\x8b":
                fh.seek(0)
                with gzip.open(fh) as gz:
                    data: Any = gz.read(MAX_DUMP_BYTES + 1)
                if len(data) > MAX_DUMP_BYTES:
                    raise DumpError(f"{p}: over {MAX_DUMP_BYTES >> 30} GiB once decompressed")
                return _read(data, str(p), len(data), demangle)
            if head == b"\x28\xb5\x2f\xfd":
                raise DumpError(f"{p}: compressed with zstd; decompress it (zstd -d) and read the result")
            if size == 0:
                raise DumpError(f"{p}: empty")
            with mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as mm:
                return _read(mm, str(p), size, demangle)
    except OSError as exc:
        raise DumpError(f"{p}: {exc.strerror or exc}") from None
    except (struct.error, EOFError, gzip.BadGzipFile, ValueError, OverflowError) as exc:
        raise DumpError(f"{p}: malformed: {exc}") from None


def _read(buf: Any, path: str, size: int, demangle: Callable[[list[str]], list[str]] | None) -> Dump:
    elf = _Elf(buf, 0, size, path)
    if elf.osabi != ELFOSABI_CUDA:
        raise DumpError(f"{path}: an ELF file, but not a CUDA core dump (OS ABI {elf.osabi}, a dump says 51)")
    dump = Dump(path=path, size=size)
    strtab = next((i for i in range(len(elf.sections)) if elf.name(i) == ".strtab"), -1)
    # devices: per device table section, its entries in order (grids point at them by index)
    devices: dict[tuple[int, int], int] = {}
    for sec in elf.of_type(SHT_DEV_TABLE):
        for n, (dev_name, _dev_type, sm_type, dev_id, pci_bus, _pci_dev) in enumerate(elf.entries(sec, _DEV)):
            devices[(sec, n)] = dev_id
            if len(dump.devices) < 64:
                dump.devices.append(
                    {
                        "device": dev_id,
                        "name": elf.string(strtab, dev_name)[:200],
                        "sm": elf.string(strtab, sm_type)[:40],
                        "pci_bus": pci_bus,
                    }
                )
    dev_by_index = {n: d for (_s, n), d in devices.items()}
    # modules: (module table section, index) -> handle; relocated images by handle
    modules: dict[tuple[int, int], int] = {}
    for sec in elf.of_type(SHT_MOD_TABLE):
        for n, (handle,) in enumerate(elf.entries(sec, _MOD)):
            modules[(sec, n)] = handle
    images: dict[int, list[int]] = {}
    for sec in elf.of_type(SHT_RELF_IMG):
        sh = elf.sections[sec]
        owner = modules.get((sh[6], sh[7]))
        if owner is not None:
            images.setdefault(owner, []).append(sec)
    # warps resident per grid: warp table -> its CTA -> the CTA's grid
    ctas: dict[tuple[int, int], int] = {}
    for sec in elf.of_type(SHT_CTA_TABLE):
        for n, (grid_id,) in enumerate(elf.entries(sec, _CTA)):
            ctas[(sec, n)] = grid_id
    warps: dict[int, int] = {}
    for sec in elf.of_type(SHT_WP_TABLE):
        sh = elf.sections[sec]
        of_grid = ctas.get((sh[6], sh[7]))
        if of_grid is not None:
            count = sh[5] // sh[9] if sh[9] else 0
            warps[of_grid] = warps.get(of_grid, 0) + count
    # grids, their kernels named from their module's relocated image
    symbols: dict[int, tuple[dict[int, str], list[tuple[int, int, str]]]] = {}
    rows: list[tuple[tuple[int, ...], int]] = []
    for sec in elf.of_type(SHT_GRID_TABLE):
        device = dev_by_index.get(elf.sections[sec][7], elf.sections[sec][7])
        for entry in elf.entries(sec, _GRID):
            rows.append((entry, device))
    if not rows:
        dump.notes.append("the dump holds no grid: no kernel ran on the GPU when it was taken")
    for entry, device in rows[:MAX_GRIDS]:
        grid_id, _ctx, _function, entry_pc, module = entry[:5]
        status = GRID_STATUS.get(entry[9], str(entry[9]))
        name = ""
        for sec in images.get(module, []):
            if sec not in symbols:
                start, sec_size = elf.data(sec)
                try:
                    symbols[sec] = _image_symbols(buf, start, sec_size, f"{path}: module 0x{module:x}")
                except DumpError as exc:
                    dump.notes.append(str(exc))
                    symbols[sec] = ({}, [])
            exact, ranges = symbols[sec]
            name = exact.get(entry_pc) or next((n for a, b, n in ranges if a <= entry_pc < b), "")
            if name:
                break
        if not name:
            why = "its module's image is not in the dump" if module not in images else "no symbol at its entry"
            name = f"<kernel at 0x{entry_pc:x}: {why}>"
        dump.grids.append(
            Grid(
                grid_id=grid_id,
                device=device,
                status=status,
                kernel=name,
                mangled=name,
                grid_dim=(entry[11], entry[12], entry[13]),
                block_dim=(entry[14], entry[15], entry[16]),
                warps=warps.get(grid_id, 0),
                function_entry=entry_pc,
                module=module,
            )
        )
    dump.grids_omitted = max(0, len(rows) - MAX_GRIDS)
    names = [g.mangled for g in dump.grids]
    pretty = (demangle or demangle_names)(names)
    for g, nice in zip(dump.grids, pretty):
        g.kernel = nice
    return dump


_MANGLED = re.compile(r"^_Z[0-9A-Za-z_$.]{1,4000}$")


def demangle_names(names: list[str]) -> list[str]:
    """C++ names demangled by ``c++filt`` where it is on PATH (bounded: 10 s), else as they are."""
    todo = [n for n in names if _MANGLED.match(n)]
    exe = shutil.which("c++filt")
    if not todo or exe is None:
        return list(names)
    try:
        out = subprocess.run(
            [exe], input="\n".join(todo) + "\n", capture_output=True, text=True, timeout=10, check=False
        ).stdout.splitlines()
    except (OSError, subprocess.SubprocessError):
        return list(names)
    if len(out) != len(todo):
        return list(names)
    done = dict(zip(todo, out))
    return [done.get(n, n)[:MAX_NAME] for n in names]


# -- taking one -----------------------------------------------------------------------------------
ARM_VARIABLE = "CUDA_ENABLE_USER_TRIGGERED_COREDUMP"
PIPE_VARIABLE = "CUDA_COREDUMP_PIPE"
FILE_VARIABLE = "CUDA_COREDUMP_FILE"
FLAGS_VARIABLE = "CUDA_COREDUMP_GENERATION_FLAGS"
DEFAULT_PIPE = "corepipe.cuda.%h.%p"  # the driver's defaults, in the process's working directory
DEFAULT_FILE = "core_%t_%h_%p.nvcudmp"
TRIGGER_BYTES = 64 * 1024  # what was written into the pipe on the H200 (it dumped in under 1 s)
MAX_ENVIRON_BYTES = 4 << 20


def process_environment(pid: int) -> dict[str, str]:
    """The environment a process started with (``/proc/PID/environ``), bounded."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as fh:
            raw = fh.read(MAX_ENVIRON_BYTES)
    except FileNotFoundError:
        raise TriggerError(f"no process {pid}", kind="no-process") from None
    except PermissionError:
        raise TriggerError(
            f"cannot read the environment of process {pid} (another user's process?)",
            help="Run dynprof as the user who runs the job.",
            kind="permission",
        ) from None
    except OSError as exc:
        raise TriggerError(f"cannot read the environment of process {pid}: {exc}") from None
    env: dict[str, str] = {}
    for item in raw.split(b"\0"):
        key, sep, value = item.partition(b"=")
        if sep:
            env[key.decode("utf-8", "replace")] = value.decode("utf-8", "replace")
    return env


def _expand(template: str, host: str, pid: int, stamp: str) -> str:
    return template.replace("%h", host).replace("%p", str(pid)).replace("%t", stamp)


def _cwd(pid: int) -> str:
    try:
        return os.readlink(f"/proc/{pid}/cwd")
    except OSError:
        return ""


@dataclass
class Armed:
    """Where a process's driver reads its trigger and writes its dump."""

    pid: int
    pipe: str
    file_pattern: str  # the dump's path with %t as '*'
    host: str
    flags: tuple[str, ...] = ()  # its CUDA_COREDUMP_GENERATION_FLAGS


def armed(pid: int) -> Armed:
    """The process's pipe and dump path; :class:`TriggerError` where it is not armed."""
    env = process_environment(pid)
    if env.get(ARM_VARIABLE) != "1":
        raise TriggerError(
            f"process {pid} was not started with {ARM_VARIABLE}=1, so its CUDA driver takes no dump on request",
            help="Start the job with `dynprof run --gpu-coredump -- CMD` (it sets the driver's variables); "
            "a running process cannot be armed.",
            kind="not-armed",
        )
    host = socket.gethostname()
    cwd = _cwd(pid)
    pipe = _expand(env.get(PIPE_VARIABLE) or DEFAULT_PIPE, host, pid, "")
    dump = _expand(env.get(FILE_VARIABLE) or DEFAULT_FILE, host, pid, "*")
    if not os.path.isabs(pipe):
        pipe = os.path.join(cwd, pipe)
    if not os.path.isabs(dump):
        dump = os.path.join(cwd, dump)
    flags = tuple(f.strip() for f in env.get(FLAGS_VARIABLE, "").split(",") if f.strip())
    return Armed(pid=pid, pipe=pipe, file_pattern=dump, host=host, flags=flags)


def trigger(
    target: Armed,
    timeout: float = 60.0,
    progress: Callable[[str], None] | None = None,
    clock: Callable[[], float] = time.monotonic,
) -> str:
    """Make the process's driver dump its GPUs; the dump's path once it is written (its size
    unchanged for a second). :class:`TriggerError` where the pipe is missing or not ours, or no
    dump came within ``timeout`` seconds."""
    say = progress or (lambda _m: None)
    try:
        st = os.lstat(target.pipe)
    except FileNotFoundError:
        raise TriggerError(
            f"process {target.pid} has no GPU core dump pipe at {target.pipe}",
            help="The driver makes it when CUDA starts in the process: has the job used its GPU yet?",
        ) from None
    except OSError as exc:
        raise TriggerError(f"cannot look at {target.pipe}: {exc}") from None
    if not stat.S_ISFIFO(st.st_mode):
        raise TriggerError(f"{target.pipe} is not a named pipe; dynprof writes into nothing else")
    if st.st_uid != os.getuid() and os.getuid() != 0:
        raise TriggerError(f"{target.pipe} belongs to uid {st.st_uid}, not to you")
    before = set(_matches(target.file_pattern))
    try:
        fd = os.open(target.pipe, os.O_WRONLY | os.O_NONBLOCK | os.O_NOFOLLOW)
    except OSError as exc:
        raise TriggerError(
            f"cannot write into {target.pipe}: {exc.strerror or exc} (no driver reads it: has process "
            f"{target.pid} exited, or not started CUDA?)"
        ) from None
    try:
        try:
            os.write(fd, b"\0" * TRIGGER_BYTES)
        except BlockingIOError:
            pass  # the pipe is full: a trigger is already in it
        except OSError as exc:
            raise TriggerError(f"writing into {target.pipe} failed: {exc.strerror or exc}") from None
    finally:
        os.close(fd)
    say(f"GPU core dump of process {target.pid} requested; waiting for {target.file_pattern}")
    deadline = clock() + timeout
    newest, size, whole = "", 0, None
    while clock() < deadline:
        fresh = [p for p in _matches(target.file_pattern) if p not in before]
        if fresh:
            newest = max(fresh, key=lambda p: (os.path.getmtime(p) if os.path.exists(p) else 0.0, p))
            try:
                size = os.path.getsize(newest)
            except OSError:
                size = 0
            # The driver writes the ELF header first (with where its section headers will be),
            # pauses while it reads the GPU, then writes the rest; the section headers come last.
            whole = dump_length(newest)
            if whole is not None and size >= whole:
                return newest
        time.sleep(0.2)
    if newest:
        said = f"{size} of the {whole} bytes its header announces" if whole else f"{size} bytes, no ELF header yet"
        help_text = "A large GPU takes longer to dump: raise --timeout; the driver goes on writing it."
        if "skip_global_memory" in target.flags and "skip_constbank_memory" not in target.flags:
            help_text = (
                "Its CUDA_COREDUMP_GENERATION_FLAGS skip global memory but not the constant banks: on an H200 "
                "(driver 580) such a dump stops after its header while a kernel runs. Add skip_constbank_memory "
                "(`dynprof run --gpu-coredump` sets both)."
            )
        elif not os.path.exists(f"/proc/{target.pid}"):
            said += f"; process {target.pid} exited before its driver finished"
        raise TriggerError(
            f"the GPU core dump of process {target.pid} ({newest}) was not finished within {timeout:g} s ({said})",
            help=help_text,
            kind="timeout",
        )
    raise TriggerError(
        f"no GPU core dump of process {target.pid} appeared at {target.file_pattern} within {timeout:g} s",
        help="A large GPU takes longer to dump: raise --timeout. The process's CUDA_COREDUMP_FILE says where "
        "the driver writes.",
        kind="timeout",
    )


def dump_length(path: str) -> int | None:
    """The length a dump being written will have, from its ELF header and, once they are there,
    its section headers (the end of the header table or of the last section, whichever is
    later); None while the header is not there or not an ELF64 one."""
    try:
        with open(path, "rb") as fh:
            head = fh.read(_EHDR.size)
            if len(head) < _EHDR.size or head[:4] != b"\x7fELF" or head[4] != 2 or head[5] != 1:
                return None
            fields = _EHDR.unpack(head)
            shoff, shentsize, shnum = int(fields[6]), int(fields[11]), int(fields[12])
            if shoff == 0 or shentsize < _SHDR.size:
                return None
            fh.seek(shoff)
            first = fh.read(_SHDR.size)
            if len(first) < _SHDR.size:
                return shoff + max(1, shnum) * shentsize
            if shnum == 0:  # more than 0xff00 sections: the first header holds the count
                shnum = int(_SHDR.unpack(first)[5])
            if shnum <= 0 or shnum > 1 << 24:
                return None
            table_end = shoff + shnum * shentsize
            fh.seek(shoff)
            table = fh.read(shnum * shentsize)
    except OSError:
        return None
    if len(table) < shnum * shentsize:
        return table_end
    end = table_end
    for i in range(shnum):
        _name, kind, _flags, _addr, offset, size, *_rest = _SHDR.unpack_from(table, i * shentsize)
        if kind != 8:  # SHT_NOBITS takes no room in the file
            end = max(end, int(offset) + int(size))
    return end


def _matches(pattern: str) -> list[str]:
    import glob

    return [p for p in glob.glob(glob.escape(pattern).replace(glob.escape("*"), "*")) if os.path.isfile(p)]


KIND = "gpu-coredump"
DUMP_FILE = "gpucore.nvcudmp"


def take(pid: int, timeout: float = 60.0, progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Dump process ``pid``'s GPUs (it ends their work, see the module's docstring), keep the
    dump as a ``gpu-coredump`` artifact, and read its kernels: ``{"pid", "artifact", "dump_s",
    "dump"}`` (``dump``: :meth:`Dump.to_dict`, or None and ``error`` where it cannot be read).
    :class:`TriggerError` where no dump could be taken."""
    from dynprof.registry import read_record
    from dynprof.store import ArtifactStore

    if not os.path.exists(f"/proc/{pid}"):
        raise TriggerError(f"no process {pid}", kind="no-process")
    target = armed(pid)
    record = read_record(pid)
    t0 = time.monotonic()
    path = trigger(target, timeout=timeout, progress=progress)
    took = round(time.monotonic() - t0, 3)
    writer = ArtifactStore().create(
        KIND,
        job=record.job_id if record is not None else None,
        rank=record.rank if record is not None else None,
        pid=pid,
        options={"pid": pid, "source": path},
    )
    with writer:
        dest = writer.file_path(DUMP_FILE)
        try:
            os.replace(path, dest)
        except OSError:
            shutil.copyfile(path, dest)
        try:
            dump = read_dump(dest)
        except DumpError as exc:
            art = writer.finish("partial", summary={"dump_s": took, "read_error": str(exc)})
            return {"pid": pid, "artifact": str(art.path), "dump_s": took, "dump": None, "error": str(exc)}
        doc = dump.to_dict()
        art = writer.finish(
            "complete",
            summary={"dump_s": took, "running": doc["running"][:16], "grids": len(dump.grids), "size_bytes": dump.size},
        )
    doc["path"] = str(art.path / DUMP_FILE)
    return {"pid": pid, "artifact": str(art.path), "dump_s": took, "dump": doc}
