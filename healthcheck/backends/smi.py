"""A backend for nvidia-smi-style tools in query/CSV mode (``nvidia-smi``, T-Head ``ppu-smi``).

The tool is asked which query fields it knows (``--help-query-gpu``) and only those are
queried, so a tool that lacks a field does not fail the whole query: the field is simply
"not available" and the checks that need it report "unknown". Values such as ``[N/A]`` are
not available either; ``[Not Supported]`` marks a feature the device does not have.
"""

from __future__ import annotations

import csv
import io
import re
import subprocess
import threading
from collections.abc import Callable
from typing import Any

from healthcheck.backends.base import NoAccelerator, XidEvent
from healthcheck.readings import DeviceProcess, DeviceReadings
from healthcheck.timeouts import InFlight

# Every probe runs under this limit (see healthcheck.timeouts.PROBE_TIMEOUT_S).
TOOL_TIMEOUT_S = 10.0


def _int(text: str) -> int:
    return int(float(text))


def _hex_or_int(text: str) -> int:
    return int(text, 16) if text.lower().startswith("0x") else int(text)


def _enabled(text: str) -> bool:
    lowered = text.strip().lower()
    if lowered in ("enabled", "yes", "on", "1", "true"):
        return True
    if lowered in ("disabled", "no", "off", "0", "false"):
        return False
    raise ValueError(f"not a yes/no value: {text!r}")


def _mib(text: str) -> int:
    return int(float(text.split()[0]) * 1024**2)


# (readings field, [query fields the tool may know it by, first known wins], parser)
FIELDS: list[tuple[str, list[str], Callable[[str], Any]]] = [
    ("name", ["name"], str),
    ("uuid", ["uuid"], str),
    ("pci_bus_id", ["pci.bus_id"], str),
    ("memory_total_bytes", ["memory.total"], _mib),
    ("driver_version", ["driver_version"], str),
    ("persistence_mode", ["persistence_mode"], _enabled),
    ("ecc_enabled", ["ecc.mode.current"], _enabled),
    ("ecc_pending_enabled", ["ecc.mode.pending"], _enabled),
    ("ecc_uncorrected_volatile", ["ecc.errors.uncorrected.volatile.total"], _int),
    ("ecc_uncorrected_aggregate", ["ecc.errors.uncorrected.aggregate.total"], _int),
    ("ecc_corrected_volatile", ["ecc.errors.corrected.volatile.total"], _int),
    ("retired_pages_sbe", ["retired_pages.single_bit_ecc.count", "retired_pages.sbe"], _int),
    ("retired_pages_dbe", ["retired_pages.double_bit.count", "retired_pages.dbe"], _int),
    ("retired_pages_pending", ["retired_pages.pending"], _enabled),
    ("pcie_gen_current", ["pcie.link.gen.gpucurrent", "pcie.link.gen.current"], _int),
    ("pcie_gen_max", ["pcie.link.gen.max"], _int),
    ("pcie_width_current", ["pcie.link.width.current"], _int),
    ("pcie_width_max", ["pcie.link.width.max"], _int),
    ("clock_event_reasons", ["clocks_event_reasons.active", "clocks_throttle_reasons.active"], _hex_or_int),
    ("sm_clock_mhz", ["clocks.sm"], _int),
    ("sm_clock_max_mhz", ["clocks.max.sm"], _int),
    ("temperature_c", ["temperature.gpu"], _int),
    ("remapped_rows_correctable", ["remapped_rows.correctable"], _int),
    ("remapped_rows_uncorrectable", ["remapped_rows.uncorrectable"], _int),
    ("remap_pending", ["remapped_rows.pending"], _enabled),
    ("remap_failure", ["remapped_rows.failure"], _enabled),
    ("reset_required", ["reset_status.reset_required"], _enabled),
    ("drain_and_reset_recommended", ["reset_status.drain_and_reset_recommended"], _enabled),
]

# Readings of the deeper checks that no query field is known for: skipped as "not exposed".
NOT_EXPOSED = ("pcie_replay_count", "recovery_action", "nvlink_counters")
# Readings taken again at the end of the check (for what may change during it).
COUNTER_FIELDS = ("reset_required", "drain_and_reset_recommended")

REMAP_FIELDS: list[tuple[str, str, Callable[[str], Any]]] = [
    ("remapped_rows_correctable", "remapped_rows.correctable", _int),
    ("remapped_rows_uncorrectable", "remapped_rows.uncorrectable", _int),
    ("remap_pending", "remapped_rows.pending", _enabled),
    ("remap_failure", "remapped_rows.failure", _enabled),
]

_NOT_SUPPORTED = {"[not supported]", "not supported"}
_NOT_AVAILABLE = {"[n/a]", "n/a", "[unknown error]", "unknown error", "", "[insufficient permissions]"}


def parse_help_fields(text: str) -> set[str]:
    """The query field names listed by ``TOOL --help-query-gpu`` (quoted, one or more a line)."""
    return set(re.findall(r'^"([A-Za-z0-9_.]+)"', text, flags=re.MULTILINE)) | set(
        re.findall(r'^"[A-Za-z0-9_.]+"\s+or\s+"([A-Za-z0-9_.]+)"', text, flags=re.MULTILINE)
    )


def parse_csv(text: str) -> list[list[str]]:
    return [[cell.strip() for cell in row] for row in csv.reader(io.StringIO(text)) if row]


class SmiBackend:
    def __init__(self, tool: str, known_fields: set[str] | None) -> None:
        self.tool = tool
        self.name = f"smi:{tool}"
        self._known = known_fields
        self._rows: dict[int, DeviceReadings] | None = None
        self._end_rows: dict[int, DeviceReadings] | None = None
        self._lock = threading.Lock()
        self.in_flight = InFlight()

    @classmethod
    def open(cls, tool: str) -> SmiBackend:
        try:
            help_out = subprocess.run(
                [tool, "--help-query-gpu"], capture_output=True, text=True, timeout=TOOL_TIMEOUT_S
            )
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise NoAccelerator(f"cannot run {tool}: {exc}") from None
        known = parse_help_fields(help_out.stdout) if help_out.returncode == 0 else set()
        backend = cls(tool, known or None)
        backend._load()
        return backend

    def call_in_flight(self, thread_id: int | None) -> str | None:
        """The tool run thread ``thread_id`` waits for now (to name one that did not return)."""
        return self.in_flight.of(thread_id)

    def _run(self, *args: str) -> str:
        self.in_flight.enter(f"{self.tool} {' '.join(args)[:200]}")
        try:
            proc = subprocess.run([self.tool, *args], capture_output=True, text=True, timeout=TOOL_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            raise NoAccelerator(f"{self.tool} did not answer within {TOOL_TIMEOUT_S:.0f} s") from None
        except OSError as exc:
            raise NoAccelerator(f"cannot run {self.tool}: {exc}") from None
        finally:
            self.in_flight.leave()
        if proc.returncode != 0:
            message = (proc.stderr or proc.stdout).strip().splitlines()
            raise NoAccelerator(f"{self.tool} {' '.join(args)} failed: {message[-1] if message else proc.returncode}")
        return proc.stdout

    def _choose(self, candidates: list[str]) -> str | None:
        if self._known is None:
            return candidates[0]
        return next((c for c in candidates if c in self._known), None)

    def _query(self, fields: list[str]) -> list[list[str]]:
        return parse_csv(self._run(f"--query-gpu={','.join(fields)}", "--format=csv,noheader,nounits"))

    def _load(self) -> None:
        chosen = [(attr, self._choose(names), parse) for attr, names, parse in FIELDS]
        queried = [(attr, q, parse) for attr, q, parse in chosen if q is not None]
        fields = ["index", *[q for _, q, _ in queried]]
        try:
            rows = self._query(fields)
        except NoAccelerator:
            if self._known is not None:
                raise
            rows = self._query_one_by_one(fields)
        readings: dict[int, DeviceReadings] = {}
        for row in rows:
            if not row or not row[0].strip().isdigit():
                continue
            r = DeviceReadings(index=int(row[0]))
            for (attr, query, parse), cell in zip(queried, row[1:], strict=False):
                self._set(r, attr, query, cell, parse)
            readings[r.index] = r
        if not readings:
            raise NoAccelerator(f"{self.tool} lists no devices")
        unqueried = {attr for attr, q, _ in chosen if q is None}
        for r in readings.values():
            r.not_exposed.update(NOT_EXPOSED)
            r.not_exposed.update(unqueried & set(COUNTER_FIELDS))
        self._rows = readings
        if not any(q and q.startswith("remapped_rows.") for _, q, _ in queried):
            self._load_remapped_rows()
        self._load_processes()

    def _query_one_by_one(self, fields: list[str]) -> list[list[str]]:
        """Without a field list, query each field alone; a field the tool rejects is ``[N/A]``."""
        columns: list[list[str]] = []
        count = len(self._query(["index"]))
        for f in fields:
            try:
                values = [row[0] if row else "" for row in self._query([f])]
            except NoAccelerator:
                values = ["[N/A]"] * count
            columns.append(values)
        return [list(cells) for cells in zip(*columns, strict=False)]

    def _set(self, r: DeviceReadings, attr: str, query: str, cell: str, parse: Callable[[str], Any]) -> None:
        lowered = cell.strip().lower()
        if lowered in _NOT_SUPPORTED:
            r.not_supported.add(attr)
        elif lowered in _NOT_AVAILABLE:
            r.errors[attr] = f"{self.tool} reports {cell.strip() or 'nothing'} for {query}"
        else:
            try:
                setattr(r, attr, parse(cell))
            except ValueError:
                r.errors[attr] = f"{self.tool}: cannot read {query}={cell!r}"

    def _load_remapped_rows(self) -> None:
        assert self._rows is not None
        try:
            out = self._run(
                "--query-remapped-rows=gpu_bus_id," + ",".join(q for _, q, _ in REMAP_FIELDS),
                "--format=csv,noheader,nounits",
            )
        except NoAccelerator:
            return  # the tool has no such query: the fields stay not available
        by_bus = {r.pci_bus_id: r for r in self._rows.values() if r.pci_bus_id}
        for row in parse_csv(out):
            r = by_bus.get(row[0])
            if r is None:
                continue
            for (attr, query, parse), cell in zip(REMAP_FIELDS, row[1:], strict=False):
                self._set(r, attr, query, cell, parse)

    def _load_processes(self) -> None:
        assert self._rows is not None
        try:
            out = self._run("--query-compute-apps=gpu_uuid,pid,used_memory", "--format=csv,noheader,nounits")
        except NoAccelerator:
            return
        by_uuid = {r.uuid: r for r in self._rows.values() if r.uuid}
        for r in self._rows.values():
            r.processes = []
        for row in parse_csv(out):
            if len(row) < 3 or row[0] not in by_uuid:
                continue
            procs = by_uuid[row[0]].processes
            assert procs is not None
            try:
                used: int | None = _mib(row[2])
            except ValueError:
                used = None
            procs.append(DeviceProcess(pid=int(row[1]), used_memory_bytes=used))

    # -- Backend interface -----------------------------------------------------------------
    def device_count(self) -> int:
        return len(self._rows or {})

    def driver_version(self) -> str | None:
        for r in (self._rows or {}).values():
            return r.driver_version
        return None

    def read(self, index: int) -> DeviceReadings:
        assert self._rows is not None
        return self._rows[index]

    def read_pcie(self, index: int) -> tuple[int | None, int | None]:
        gen_field = self._choose(["pcie.link.gen.gpucurrent", "pcie.link.gen.current"])
        width_field = self._choose(["pcie.link.width.current"])
        if gen_field is None or width_field is None:
            return None, None
        try:
            out = self._run(f"--id={index}", f"--query-gpu={gen_field},{width_field}", "--format=csv,noheader,nounits")
            gen, width = parse_csv(out)[0][:2]
            return int(gen), int(width)
        except (NoAccelerator, ValueError, IndexError):
            return None, None

    def read_counters(self, index: int) -> DeviceReadings:
        """The readings that may change during the check, read again (only those the tool has;
        one query for every device, taken by the first call)."""
        with self._lock:
            if self._end_rows is None:
                self._end_rows = self._query_counters()
            template = self._end_rows.get(index)
        r = DeviceReadings(index=index, not_exposed=set(NOT_EXPOSED))
        if template is None:
            r.errors.update({attr: f"{self.tool} did not list device {index} again" for attr in COUNTER_FIELDS})
            return r
        for attr in COUNTER_FIELDS:
            setattr(r, attr, getattr(template, attr))
        r.not_exposed |= template.not_exposed
        r.not_supported |= template.not_supported
        r.errors.update(template.errors)
        return r

    def _query_counters(self) -> dict[int, DeviceReadings]:
        wanted = [(attr, self._choose(names), parse) for attr, names, parse in FIELDS if attr in COUNTER_FIELDS]
        queried = [(attr, q, parse) for attr, q, parse in wanted if q is not None]
        rows: dict[int, DeviceReadings] = {}
        for i in self._rows or {}:
            rows[i] = DeviceReadings(index=i, not_exposed={attr for attr, q, _ in wanted if q is None})
        if not queried:
            return rows
        try:
            out = self._query(["index", *[q for _, q, _ in queried]])
        except NoAccelerator as exc:
            for r in rows.values():
                r.errors.update({attr: exc.message for attr, _, _ in queried})
            return rows
        listed: set[int] = set()
        for row in out:
            if not row or not row[0].strip().isdigit() or int(row[0]) not in rows:
                continue
            listed.add(int(row[0]))
            r = rows[int(row[0])]
            for (attr, query, parse), cell in zip(queried, row[1:], strict=False):
                self._set(r, attr, query, cell, parse)
        for i, r in rows.items():
            if i not in listed:  # gone from the tool's list since the check began: say so, never blank
                r.errors.update({attr: f"{self.tool} did not list device {i} again" for attr, _, _ in queried})
        return rows

    def watch_xid(self) -> bool:
        return False

    def xid_events(self) -> list[XidEvent]:
        return []

    def close(self) -> None:
        pass
