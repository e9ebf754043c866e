"""Reading a CUDA GPU core dump (collectors/gpu_coredump.py) and taking one through the driver's
pipe: on synthetic dumps built in cudacoredump.h's layout (tests/unit/_cudacore.py), damaged
and crafted ones, and a stand-in driver that reads a real named pipe. The real dump of an H200
is read in tests/gpu/test_gpu_coredump_device.py."""

from __future__ import annotations

import gzip
import json
import os
import random
import re
import subprocess
import sys
import threading
import time

import pytest

from collectors import gpu_coredump as gc
from tests.unit import _cudacore as cc

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _write(tmp_path, data: bytes, name: str = "core.nvcudmp"):
    path = tmp_path / name
    path.write_bytes(data)
    return path


def test_the_running_kernels_are_named_with_their_launch_and_warps(tmp_path):
    # GIVEN a dump of one device: an endless kernel active, a matmul pending, two warps each
    dump = gc.read_dump(_write(tmp_path, cc.dump()))
    # THEN both grids are read, named from the module's image, demangled where c++filt is here
    assert [g.grid_id for g in dump.grids] == [7, 8]
    spin, gemm = dump.grids
    assert spin.mangled == cc.SPIN and spin.status == "active" and spin.warps == 2
    assert (spin.grid_dim, spin.block_dim) == ((1, 1, 1), (1, 1, 1))
    assert gemm.mangled == cc.GEMM and gemm.status == "pending" and gemm.grid_dim == (64, 1, 1)
    if spin.kernel != spin.mangled:  # c++filt on PATH
        assert spin.kernel == "at::cuda::(anonymous namespace)::spin_kernel(long)"
    assert dump.devices == [{"device": 0, "name": "NVIDIA H200", "sm": "sm_90", "pci_bus": 0x19}]
    assert spin.describe().endswith("<<<(1,1,1),(1,1,1)>>>")
    assert [g.grid_id for g in dump.running()] == [7, 8]
    json.dumps(dump.to_dict())


def test_without_a_demangler_the_names_stay_as_the_image_has_them(tmp_path):
    dump = gc.read_dump(_write(tmp_path, cc.dump()), demangle=lambda names: list(names))
    assert [g.kernel for g in dump.grids] == [cc.SPIN, cc.GEMM]


def test_a_grid_whose_module_has_no_image_says_so_and_a_dump_without_grids_says_that(tmp_path):
    missing = gc.read_dump(_write(tmp_path, cc.dump(image=cc.cubin({0x1000: "other"}))), demangle=list)
    assert missing.grids[0].kernel == "<kernel at 0x7f0000001000: no symbol at its entry>"
    empty = gc.read_dump(_write(tmp_path, cc.dump(grids=[]), "empty"))
    assert empty.grids == [] and "no kernel ran" in empty.notes[0]


def test_a_gzip_compressed_dump_is_read_too(tmp_path):
    dump = gc.read_dump(_write(tmp_path, gzip.compress(cc.dump()), "core.gz"), demangle=list)
    assert [g.kernel for g in dump.grids] == [cc.SPIN, cc.GEMM]


@pytest.mark.parametrize(
    "data,says",
    [
        (b"", "empty"),
        (b"not an elf at all, but long enough for a header" * 2, "not an ELF file"),
        (b"\x28\xb5\x2f\xfd" + b"\0" * 100, "zstd"),
        (cc.dump(osabi=0), "not a CUDA core dump"),
        (cc.dump()[:200], "outside the file"),
        (b"\x7fELF\x01\x01" + b"\0" * 58, "not a 64-bit little-endian"),
    ],
    ids=["empty", "not-elf", "zstd", "plain-elf", "truncated", "32-bit"],
)
def test_what_is_not_a_readable_dump_is_a_clear_error(tmp_path, data, says):
    with pytest.raises(gc.DumpError, match=says):
        gc.read_dump(_write(tmp_path, data))


def test_a_directory_or_a_missing_file_is_a_clear_error(tmp_path):
    with pytest.raises(gc.DumpError):
        gc.read_dump(tmp_path)
    with pytest.raises(gc.DumpError, match="No such file"):
        gc.read_dump(tmp_path / "absent")


def test_damaged_dumps_give_a_dump_or_a_dump_error_never_another_exception(tmp_path):
    # GIVEN 400 copies of a dump, each with a few bytes overwritten at random (a fixed seed)
    good = cc.dump()
    rng = random.Random(26)
    outcomes = {"read": 0, "refused": 0}
    for n in range(400):
        data = bytearray(good)
        for _ in range(rng.randint(1, 8)):
            data[rng.randrange(len(data))] = rng.randrange(256)
        path = _write(tmp_path, bytes(data), f"d{n % 4}")
        # THEN each is read or refused with a DumpError
        try:
            gc.read_dump(path, demangle=list)
            outcomes["read"] += 1
        except gc.DumpError:
            outcomes["refused"] += 1
    assert outcomes["read"] > 0 and outcomes["refused"] > 0, outcomes


def test_counts_a_crafted_header_claims_are_bounded(tmp_path):
    # GIVEN a header that claims 2**32 section headers of 2**16 bytes
    data = bytearray(cc.dump())
    data[0x3C:0x3E] = (0).to_bytes(2, "little")  # e_shnum 0: the count is in section 0
    shoff = int.from_bytes(data[0x28:0x30], "little")
    data[shoff + 32 : shoff + 40] = (1 << 40).to_bytes(8, "little")  # section 0's sh_size
    with pytest.raises(gc.DumpError, match="sections"):
        gc.read_dump(_write(tmp_path, bytes(data)))


# -- taking one ------------------------------------------------------------------------------------
def _sleeper(env: dict[str, str]) -> subprocess.Popen:
    """A process started with ``env``, returned once it runs Python: before its exec, its
    /proc/PID/environ is still the test's own (seen on a loaded machine)."""
    code = "import sys, time; print('up', flush=True); time.sleep(60)"
    proc = subprocess.Popen([sys.executable, "-c", code], env={**os.environ, **env}, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline() == "up\n"
    return proc


def test_a_process_not_armed_is_refused_with_how_to_arm_it():
    proc = _sleeper({"CUDA_ENABLE_USER_TRIGGERED_COREDUMP": "0"})
    try:
        with pytest.raises(gc.TriggerError, match="not started with CUDA_ENABLE_USER_TRIGGERED_COREDUMP=1") as e:
            gc.armed(proc.pid)
        assert "dynprof run --gpu-coredump" in e.value.help
    finally:
        proc.kill()
        proc.wait()


def test_the_pipe_and_dump_paths_come_from_the_process_environment_expanded(tmp_path):
    env = {
        "CUDA_ENABLE_USER_TRIGGERED_COREDUMP": "1",
        "CUDA_COREDUMP_PIPE": f"{tmp_path}/corepipe.cuda.%h.%p",
        "CUDA_COREDUMP_FILE": f"{tmp_path}/core.cuda.%h.%p.%t",
    }
    proc = _sleeper(env)
    try:
        target = gc.armed(proc.pid)
        host = os.uname().nodename
        assert target.pipe == f"{tmp_path}/corepipe.cuda.{host}.{proc.pid}"
        assert target.file_pattern == f"{tmp_path}/core.cuda.{host}.{proc.pid}.*"
    finally:
        proc.kill()
        proc.wait()


def _driver(pipe: str, dump_path: str, data: bytes, got: list[int]) -> threading.Thread:
    """A stand-in for the CUDA driver: reads the pipe; on a write, writes a dump in two parts, with
    a pause after the ELF header longer than a second (an H200's driver paused so, and a dump
    read then was cut at 68 KiB of 87 MB)."""

    def run() -> None:
        fd = os.open(pipe, os.O_RDONLY)
        try:
            chunk = os.read(fd, 1 << 20)
            got.append(len(chunk))
        finally:
            os.close(fd)
        with open(dump_path, "wb") as fh:
            fh.write(data[:100])
            fh.flush()
            time.sleep(1.5)
            fh.write(data[100:])

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def test_a_write_into_the_pipe_makes_the_driver_dump_and_the_finished_dump_is_returned(tmp_path):
    # GIVEN an armed target whose "driver" reads its pipe
    pipe = tmp_path / "corepipe"
    os.mkfifo(pipe, 0o600)
    target = gc.Armed(pid=1, pipe=str(pipe), file_pattern=str(tmp_path / "core.1.*"), host="h")
    got: list[int] = []
    driver = _driver(str(pipe), str(tmp_path / "core.1.1764000000"), cc.dump(), got)
    time.sleep(0.1)
    # WHEN dynprof triggers it
    said: list[str] = []
    path = gc.trigger(target, timeout=30, progress=said.append)
    driver.join(10)
    # THEN the driver got dynprof's trigger, and the whole dump, readable, is the answer
    assert got == [gc.TRIGGER_BYTES]
    assert path == str(tmp_path / "core.1.1764000000")
    assert len(gc.read_dump(path, demangle=list).grids) == 2
    assert "requested" in said[0]


def test_the_length_a_dump_will_have_comes_from_its_header_and_section_table(tmp_path):
    data = cc.dump()
    whole = _write(tmp_path, data)
    assert gc.dump_length(str(whole)) == len(data)
    # while only the ELF header is there, at least the end of its section header table
    head = _write(tmp_path, data[:100], "head")
    assert gc.dump_length(str(head)) is not None and gc.dump_length(str(head)) > 100
    # not an ELF file, or a truncated header: no length yet
    assert gc.dump_length(str(_write(tmp_path, b"\x7fEL", "short"))) is None
    assert gc.dump_length(str(_write(tmp_path, b"x" * 200, "text"))) is None
    assert gc.dump_length(str(tmp_path / "absent")) is None


def _gone_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


@pytest.mark.parametrize(
    "case, flags, why",
    [
        ("alive", ("skip_abort", "skip_global_memory", "skip_constbank_memory"), "raise --timeout"),
        ("alive", ("skip_abort", "skip_global_memory"), "but not the constant banks.*add skip_constbank_memory"),
        ("exited", (), "exited before its driver finished"),
    ],
)
def test_a_dump_the_driver_does_not_finish_says_why_it_may_have_stopped(tmp_path, case, flags, why):
    # GIVEN a driver that stops after the dump's header, in a process that lives or has exited
    pipe = tmp_path / "corepipe"
    os.mkfifo(pipe, 0o600)
    reader = os.open(pipe, os.O_RDONLY | os.O_NONBLOCK)
    pid = 1 if case == "alive" else _gone_pid()
    try:
        now = [0.0]

        def clock() -> float:
            now[0] += 0.5
            if now[0] == 1.0:
                _write(tmp_path, cc.dump()[:100], "c.1")
            return now[0]

        target = gc.Armed(pid=pid, pipe=str(pipe), file_pattern=str(tmp_path / "c.*"), host="h", flags=flags)
        # WHEN the trigger waits for it; THEN the error says how far it got and the likely cause
        with pytest.raises(gc.TriggerError) as err:
            gc.trigger(target, timeout=5, clock=clock)
        said = f"{err.value} {err.value.help}"
        assert "was not finished within 5 s (100 of the" in said
        assert re.search(why, said, re.IGNORECASE | re.DOTALL), said
    finally:
        os.close(reader)


def test_a_dump_the_driver_does_not_finish_within_the_timeout_is_not_returned(tmp_path):
    pipe = tmp_path / "corepipe"
    os.mkfifo(pipe, 0o600)
    reader = os.open(pipe, os.O_RDONLY | os.O_NONBLOCK)
    try:
        now = [0.0]

        def clock() -> float:
            now[0] += 0.5
            if now[0] == 1.0:  # the driver starts the dump and stops after its header
                _write(tmp_path, cc.dump()[:100], "c.1")
            return now[0]

        target = gc.Armed(pid=1, pipe=str(pipe), file_pattern=str(tmp_path / "c.*"), host="h")
        with pytest.raises(gc.TriggerError, match=r"was not finished within 5 s \(100 of the \d+ bytes"):
            gc.trigger(target, timeout=5, clock=clock)
    finally:
        os.close(reader)


def test_a_pipe_that_is_missing_not_a_fifo_or_unread_is_refused(tmp_path):
    target = gc.Armed(pid=1, pipe=str(tmp_path / "none"), file_pattern=str(tmp_path / "c.*"), host="h")
    with pytest.raises(gc.TriggerError, match="has no GPU core dump pipe"):
        gc.trigger(target, timeout=1)
    (tmp_path / "file").write_text("")
    target.pipe = str(tmp_path / "file")
    with pytest.raises(gc.TriggerError, match="not a named pipe"):
        gc.trigger(target, timeout=1)
    os.symlink(tmp_path / "file", tmp_path / "link")
    target.pipe = str(tmp_path / "link")
    with pytest.raises(gc.TriggerError, match="not a named pipe"):
        gc.trigger(target, timeout=1)
    os.mkfifo(tmp_path / "fifo", 0o600)
    target.pipe = str(tmp_path / "fifo")  # nobody reads it: the process has exited
    with pytest.raises(gc.TriggerError, match="no driver reads it"):
        gc.trigger(target, timeout=1)


def test_no_dump_within_the_timeout_says_so(tmp_path):
    pipe = tmp_path / "corepipe"
    os.mkfifo(pipe, 0o600)
    reader = os.open(pipe, os.O_RDONLY | os.O_NONBLOCK)  # a driver that reads and never dumps
    try:
        now = [0.0]

        def clock() -> float:
            now[0] += 0.5
            return now[0]

        target = gc.Armed(pid=1, pipe=str(pipe), file_pattern=str(tmp_path / "c.*"), host="h")
        with pytest.raises(gc.TriggerError, match="within 5 s"):
            gc.trigger(target, timeout=5, clock=clock)
    finally:
        os.close(reader)


# -- the command -------------------------------------------------------------------------------------
def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "dynprof", "gpu-coredump", *args], capture_output=True, text=True, cwd=ROOT, timeout=60
    )


def test_the_command_takes_no_dump_without_yes_and_says_what_a_dump_costs():
    proc = _sleeper({})
    try:
        out = _cli("--pid", str(proc.pid))
    finally:
        proc.kill()
        proc.wait()
    assert out.returncode == 2, out.stderr
    assert "ends the process's GPU work" in out.stderr and "--yes" in out.stderr


def test_the_command_refuses_a_process_not_armed_with_exit_7():
    proc = _sleeper({})
    try:
        out = _cli("--pid", str(proc.pid), "--yes")
    finally:
        proc.kill()
        proc.wait()
    assert out.returncode == 7, out.stderr
    assert "dynprof run --gpu-coredump" in out.stderr


def test_the_command_reads_a_dump_file_as_text_and_json(tmp_path):
    path = _write(tmp_path, cc.dump())
    text = _cli("--read", str(path))
    assert text.returncode == 0, text.stderr
    assert "2 kernels running on its GPU" in text.stdout and "grid (1, 1, 1) block (1, 1, 1) on cuda:0" in text.stdout
    doc = json.loads(_cli("--read", str(path), "--json").stdout)
    assert [g["mangled"] for g in doc["dump"]["grids"]] == [cc.SPIN, cc.GEMM]
    bad = _cli("--read", str(tmp_path / "absent"))
    assert bad.returncode == 1 and "No such file" in bad.stderr and "Traceback" not in bad.stderr
