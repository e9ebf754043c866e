"""XID errors: the policy table, and finding them in the kernel log.

The driver reports a fault as a kernel-log line such as::

    NVRM: Xid (PCI:0000:3b:00): 79, pid=1234, name=python, GPU has fallen off the bus.

:data:`POLICY` is the one table that says, for each XID, whether the node is drained, the
device reset, or the XID only reported — and why (after NVIDIA's XID catalogue). It is
rendered into docs/healthcheck.md; an XID that is not in it is a warning that names it.
"""

from __future__ import annotations

import os
import re
import subprocess
import time
from dataclasses import dataclass

from healthcheck.pci import normalize_bus_id

DRAIN = "drain"
RESET = "reset"
WARN = "warn"


@dataclass(frozen=True)
class XidPolicy:
    action: str
    meaning: str
    why: str


POLICY: dict[int, XidPolicy] = {
    13: XidPolicy(WARN, "Graphics engine exception", "usually the application (illegal instruction or address)"),
    31: XidPolicy(WARN, "GPU memory page fault", "usually the application (illegal memory access)"),
    43: XidPolicy(WARN, "GPU stopped processing", "the application's context was killed; the GPU recovers"),
    45: XidPolicy(WARN, "Preemptive cleanup", "follows other errors or a killed process; look at the XIDs before it"),
    48: XidPolicy(
        RESET, "Double-bit ECC error", "uncorrectable memory error; a reset remaps the row or retires the page"
    ),
    61: XidPolicy(RESET, "Internal micro-controller breakpoint", "firmware fault; the GPU needs a reset"),
    62: XidPolicy(RESET, "Internal micro-controller halt", "firmware halted; the GPU needs a reset"),
    63: XidPolicy(
        WARN, "ECC row remapping / page retirement recorded", "memory repair recorded; applied at the next reset"
    ),
    64: XidPolicy(DRAIN, "ECC row remapping / page retirement failed", "memory cannot be repaired; replace the GPU"),
    68: XidPolicy(WARN, "Video processor exception", "decoder fault, does not affect training kernels"),
    69: XidPolicy(WARN, "Graphics engine class error", "usually the application"),
    74: XidPolicy(RESET, "NVLink error", "link fault; reset the GPU (and NVSwitch fabric); drain if it repeats"),
    79: XidPolicy(DRAIN, "GPU has fallen off the bus", "the GPU is unreachable; the node needs service"),
    92: XidPolicy(WARN, "High single-bit ECC error rate", "memory is degrading; watch row remapping"),
    94: XidPolicy(RESET, "Contained ECC error", "the faulting application was stopped; reset to remap the row"),
    95: XidPolicy(RESET, "Uncontained ECC error", "every application on the GPU is affected; reset the GPU"),
    109: XidPolicy(RESET, "Context switch timeout", "the GPU stopped responding to the scheduler"),
    119: XidPolicy(RESET, "GSP RPC timeout", "the GPU System Processor stopped answering; reset the GPU"),
    120: XidPolicy(RESET, "GSP error", "GPU System Processor fault; reset the GPU"),
    121: XidPolicy(WARN, "C2C link corrected error", "corrected; watch for repeats"),
    140: XidPolicy(RESET, "Unrecovered ECC error", "uncorrectable memory error outside a contained context"),
    154: XidPolicy(RESET, "GPU recovery action changed", "the driver names the action: reset, reboot or drain"),
}

ACTION_ORDER = {WARN: 0, RESET: 1, DRAIN: 2}


def policy_for(xid: int, message: str = "") -> XidPolicy:
    """The policy for ``xid``; for XID 154 the action the driver named in ``message`` wins."""
    if xid == 154:
        lowered = message.lower()
        if "reboot" in lowered or "drain" in lowered:
            return XidPolicy(DRAIN, POLICY[154].meaning, "the driver asks for a node reboot or drain")
        if "reset" in lowered:
            return POLICY[154]
        if "none" in lowered.rsplit(" to ", 1)[-1]:
            return XidPolicy(WARN, POLICY[154].meaning, "the driver no longer asks for an action")
    return POLICY.get(xid, XidPolicy(WARN, "not in dynprof's policy table", "look it up in NVIDIA's XID catalogue"))


# "NVRM: Xid (PCI:0000:3b:00): 79, pid=1234, name=python, GPU has fallen off the bus."
_XID_LINE = re.compile(r"NVRM: Xid \((?:PCI:)?([0-9a-fA-F:.]+)\): (\d+),?\s*(.*)")
# /dev/kmsg record: "<prio>,<seq>,<usec since boot>,<flags>[,...];<message>"
_KMSG = re.compile(r"^\d+,\d+,(\d+),[^;]*;(.*)$")
# dmesg: "[ 1234.567890] message"
_DMESG = re.compile(r"^\[\s*(\d+\.\d+)\]\s*(.*)$")
# journalctl -o short-unix: "1709633521.123456 host kernel: message"
_UNIX = re.compile(r"^(\d{9,}\.\d+)\s+\S+\s+kernel:\s*(.*)$")


@dataclass
class XidRecord:
    xid: int
    bus_id: str | None
    message: str
    # Seconds since the epoch when the log gave a time, else None.
    time: float | None = None
    line: str = ""

    @property
    def policy(self) -> XidPolicy:
        return policy_for(self.xid, self.message)


def parse_xid_line(line: str, boot_time: float | None = None) -> XidRecord | None:
    """Parse one kernel-log line in /dev/kmsg, dmesg, journalctl short-unix or syslog form."""
    # A /dev/kmsg record may carry continuation lines (" SUBSYSTEM=..."): the first one is the message.
    text = line.split("\n", 1)[0]
    when: float | None = None
    kmsg = _KMSG.match(text)
    dmesg = _DMESG.match(text)
    unix = _UNIX.match(text)
    if kmsg:
        if boot_time is not None:
            when = boot_time + int(kmsg.group(1)) / 1e6
        text = kmsg.group(2)
    elif dmesg:
        if boot_time is not None:
            when = boot_time + float(dmesg.group(1))
        text = dmesg.group(2)
    elif unix:
        when = float(unix.group(1))
        text = unix.group(2)
    match = _XID_LINE.search(text)
    if not match:
        return None
    bus, xid, rest = match.groups()
    return XidRecord(
        xid=int(xid), bus_id=normalize_bus_id(bus), message=rest.strip(), time=when, line=line.split("\n", 1)[0]
    )


def boot_time() -> float:
    with open("/proc/uptime") as fh:
        uptime = float(fh.read().split()[0])
    return time.time() - uptime


class KernelLogUnreadable(Exception):
    pass


def read_kernel_log_xids(window_s: float, now: float | None = None) -> tuple[list[XidRecord], str]:
    """XID records of the last ``window_s`` seconds and the source they were read from.

    Tries /dev/kmsg (needs CAP_SYSLOG or kernel.dmesg_restrict=0), then ``journalctl -k``.
    Raises :class:`KernelLogUnreadable` with the reasons when neither can be read.
    """
    now = time.time() if now is None else now
    since = now - window_s
    reasons = []
    try:
        records = _read_kmsg()
        return [r for r in records if r.time is None or r.time >= since], "/dev/kmsg"
    except OSError as exc:
        reasons.append(f"/dev/kmsg: {exc.strerror or exc}")
    try:
        proc = subprocess.run(
            ["journalctl", "-k", "-o", "short-unix", "--no-pager", "-q", f"--since=@{int(since)}"],
            capture_output=True,
            text=True,
            timeout=10,
        )
        if proc.returncode == 0 and proc.stdout.strip():
            found = [parse_xid_line(line) for line in proc.stdout.splitlines()]
            return [r for r in found if r is not None], "journalctl -k"
        reasons.append(f"journalctl -k: {(proc.stderr.strip() or 'no kernel messages').splitlines()[0]}")
    except (OSError, subprocess.TimeoutExpired) as exc:
        reasons.append(f"journalctl -k: {exc}")
    raise KernelLogUnreadable("; ".join(reasons))


def _read_kmsg() -> list[XidRecord]:
    booted = boot_time()
    records = []
    fd = os.open("/dev/kmsg", os.O_RDONLY | os.O_NONBLOCK)
    try:
        while True:
            try:
                data = os.read(fd, 8192)
            except BlockingIOError:
                break  # end of the ring buffer
            except OSError as exc:
                if exc.errno == 32:  # EPIPE: a record was overwritten while reading; go on
                    continue
                raise
            if not data:
                break
            record = parse_xid_line(data.decode(errors="replace"), boot_time=booted)
            if record is not None:
                records.append(record)
    finally:
        os.close(fd)
    return records
