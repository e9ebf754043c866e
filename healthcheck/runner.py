"""One healthcheck run: host checks, passive device checks, functional checks, judgement.

Levels:

* ``quick``: passive checks only (driver state, counters, kernel log, links, host);
* ``standard``: ``quick`` plus the functional micro-benchmarks, judged against the SKU's
  baseline and the device's peers;
* ``full``: ``standard`` with longer runs and a larger memory test.

Every probe (a driver call, an smi tool run, a sysfs or kernel-log read, a shared filesystem)
runs under a time limit (``Options.probe_timeout_s``, 10 s): one that does not return makes
its check ``unknown`` with the call named, and the run goes on. Error counters are read at the
start and again at the end of the run, and judged on what moved in between.
"""

from __future__ import annotations

import functools
import os
import time
from collections.abc import Callable
from typing import Any

import healthcheck.xid as xidlog
from dynprof.store import utcnow_iso
from healthcheck.backends import Backend, NoAccelerator, open_backend
from healthcheck.baseline import Baseline, find_baseline, load_baselines
from healthcheck.checks.counters import counter_checks
from healthcheck.checks.device import check_clocks, check_devices, check_pcie_link
from healthcheck.checks.ib_counters import IbPortCounters, check_ib_counters, read_ib_counters
from healthcheck.checks.shared_fs import SharedFsProbe, start_probes
from healthcheck.checks.table import host_probes, passive_device_checks
from healthcheck.checks.xid import check_kernel_log_xids, check_live_xids
from healthcheck.compare import DeviceMeasurement, judge, needs_retry
from healthcheck.functional import launcher
from healthcheck.functional.table import Scope, checks_of, find, row_of_result
from healthcheck.options import LEVELS, Options, expected_devices, visible_cuda_count
from healthcheck.pci import normalize_bus_id
from healthcheck.pcie_load import loaded_links
from healthcheck.readings import DeviceReadings
from healthcheck.report import DeviceSummary, Report
from healthcheck.result import CheckResult, Status
from healthcheck.timeouts import Call, TimedOut, call_with_timeout, did_not_return


class _Run:
    def __init__(self, options: Options, progress: Callable[[str], None] | None) -> None:
        self.o = options
        self.progress = progress or (lambda _text: None)
        self.results: list[CheckResult] = []
        self.timings: dict[str, float] = {}
        self.backend: Backend | None = None
        self.readings: list[DeviceReadings] = []
        self.count = 0
        self.counted = False
        self.driver_version: str | None = None
        # Devices whose read did not return, with the reason (no further call is made to them).
        self.hung: dict[int, str] = {}
        # Set when any call to the backend did not return: what can wait is not asked again.
        self.driver_hung = False
        self.counters_read_at = 0.0

    def probe(self, fn: Callable[[], Any], what: str) -> tuple[Any, str | None]:
        """``(fn(), None)``, or ``(None, why)`` if it raised or did not return within the limit;
        a backend that knows which call its thread is in names it."""
        call: Call[Any] = Call(fn, name="healthcheck-probe")
        limit = self.o.probe_timeout_s
        try:
            return call.result(limit), None
        except TimedOut:
            self.driver_hung = True
            return None, did_not_return(self._in_flight(call) or what, limit)
        except Exception as exc:
            return None, f"{what} failed: {type(exc).__name__}: {exc}"

    def _in_flight(self, call: Call[Any]) -> str | None:
        named = getattr(self.backend, "call_in_flight", None)
        return named(call.thread_id) if callable(named) else None

    def add(self, results: list[CheckResult] | CheckResult) -> None:
        self.results.extend(results if isinstance(results, list) else [results])

    def timed(self, name: str, start: float) -> None:
        self.timings[name] = time.monotonic() - start

    # -- steps -------------------------------------------------------------------------------
    def open_backend(self) -> None:
        expected, source = expected_devices(self.o)
        t0 = time.monotonic()
        try:
            self.backend = call_with_timeout(
                lambda: open_backend(self.o.backend, self.o.smi_tool), self.o.probe_timeout_s
            )
        except (NoAccelerator, TimedOut) as exc:
            message = exc.message if isinstance(exc, NoAccelerator) else f"opening the backend {exc}"
            if expected == 0:
                self.add(
                    CheckResult(
                        "accelerators", Status.PASS, f"none expected ({source}); {message}", value=0, expected="0"
                    )
                )
            else:
                self.add(
                    CheckResult(
                        "accelerators",
                        Status.UNKNOWN,
                        message,
                        value=0,
                        expected=str(expected) if expected is not None else ">= 1",
                        critical=True,
                        details={"help": NoAccelerator.default_help},
                    )
                )
            return
        finally:
            self.timed("open_backend", t0)
        name = self.backend.name
        got, why = self.probe(self.backend.device_count, f"{name}: counting the devices")
        if why is not None:
            self.add(CheckResult("devices", Status.UNKNOWN, why, value=0, critical=True))
            return
        count = self.count = int(got)
        self.counted = True
        self.add(check_devices(count, expected, source, name))
        driver, why = self.probe(self.backend.driver_version, f"{name}: reading the driver version")
        if why is not None:
            self.add(CheckResult("driver", Status.UNKNOWN, why))
        elif driver:
            self.driver_version = str(driver)
            self.add(CheckResult("driver", Status.PASS, f"driver {driver} reachable through {name}", value=driver))
        else:
            self.add(CheckResult("driver", Status.UNKNOWN, f"driver version not readable through {name}"))

    def read_devices(self) -> None:
        assert self.backend is not None
        backend = self.backend
        t0 = time.monotonic()
        self.counters_read_at = time.monotonic()
        calls = [(i, Call(functools.partial(backend.read, i))) for i in range(self.count)]
        limit = self.o.probe_timeout_s
        deadline = time.monotonic() + limit
        for index, call in calls:
            try:
                self.readings.append(call.result(max(0.0, deadline - time.monotonic())))
            except TimedOut:
                what = self._in_flight(call) or f"reading device {index} through {backend.name}"
                self.hung[index] = did_not_return(what, limit)
                self.driver_hung = True
                self.add(
                    CheckResult(
                        "device_read",
                        Status.UNKNOWN,
                        f"{self.hung[index]} (driver hung?)",
                        device=index,
                        critical=True,
                    )
                )
            except Exception as exc:
                self.add(
                    CheckResult(
                        "device_read", Status.UNKNOWN, f"reading the device failed: {exc}", device=index, critical=True
                    )
                )
        self.timed("read_devices", t0)

    def passive(self) -> None:
        assert self.backend is not None
        source = self.backend.name
        active_links: dict[str, int] = {}
        for r in self.readings:
            if r.nvlinks:
                active_links[r.sku] = max(active_links.get(r.sku, 0), sum(1 for link in r.nvlinks if link.active))
        for r in self.readings:
            self.add(
                passive_device_checks(
                    r, source, peer_nvlinks=active_links.get(r.sku), own_pids=frozenset({os.getpid()}) | self.o.job_pids
                )
            )

    def kernel_log(self) -> None:
        t0 = time.monotonic()
        devices = {
            bus: r.index for r in self.readings if r.pci_bus_id for bus in [normalize_bus_id(r.pci_bus_id)] if bus
        }
        try:
            records, source = call_with_timeout(
                lambda: xidlog.read_kernel_log_xids(self.o.xid_window_s), self.o.probe_timeout_s
            )
        except xidlog.KernelLogUnreadable as exc:
            self.add(
                CheckResult(
                    "xid_kernel_log",
                    Status.UNKNOWN,
                    f"kernel log not readable ({exc}): run as root or with CAP_SYSLOG, or set kernel.dmesg_restrict=0",
                )
            )
        except TimedOut as exc:
            self.add(CheckResult("xid_kernel_log", Status.UNKNOWN, f"reading the kernel log {exc}"))
        else:
            self.add(check_kernel_log_xids(records, devices, self.o.xid_window_s, source))
        self.timed("kernel_log", t0)

    def counters_at_end(self) -> None:
        """Read the error counters again and judge what moved since the devices were read."""
        assert self.backend is not None
        backend = self.backend
        source = backend.name
        wanted = [r for r in self.readings if r.index not in self.hung]
        if not wanted or {"recovery_action", "pcie_replay", "nvlink_errors"} <= self.o.skip:
            return
        wait = self.counters_read_at + self.o.counter_window_s - time.monotonic()
        if wait > 0:
            self.progress(f"waiting {wait:.1f} s for the error counters' window")
            time.sleep(wait)
        t0 = time.monotonic()
        reader = getattr(backend, "read_counters", None)
        calls = {r.index: Call(functools.partial(reader, r.index)) for r in wanted} if callable(reader) else {}
        limit = self.o.probe_timeout_s
        deadline = time.monotonic() + limit
        for r in wanted:
            end: DeviceReadings | None = None
            why: str | None = None
            call = calls.get(r.index)
            if call is None:
                why = f"{source} cannot read the counters again"
            else:
                try:
                    end = call.result(max(0.0, deadline - time.monotonic()))
                except TimedOut:
                    why = did_not_return(self._in_flight(call) or f"reading device {r.index}'s counters", limit)
                    self.hung[r.index] = why
                    self.driver_hung = True
                except Exception as exc:
                    why = f"reading the counters again failed: {type(exc).__name__}: {exc}"
            window = (t0 if end is None else time.monotonic()) - self.counters_read_at
            self.add(counter_checks(r, source, end, window, why))
        self.timed("counters_at_end", t0)

    def pcie_quick(self) -> None:
        """PCIe at the quick level: links below their maximum while idle are re-read under load."""
        assert self.backend is not None
        source = self.backend.name
        idle_low = [
            r
            for r in self.readings
            if None not in (r.pcie_gen_current, r.pcie_gen_max, r.pcie_width_current, r.pcie_width_max)
            and (
                (r.pcie_gen_current or 0) < (r.pcie_gen_max or 0)
                or (r.pcie_width_current or 0) < (r.pcie_width_max or 0)
            )
        ]
        loaded: dict[int, tuple[int, int]] = {}
        error: str | None = None
        if idle_low:
            t0 = time.monotonic()

            backend = self.backend
            try:
                loaded, error = call_with_timeout(lambda: loaded_links(backend, self.readings), 60)
            except TimedOut as exc:
                error = f"loading the links {exc}"
            except Exception as exc:
                error = f"loading the links failed: {type(exc).__name__}: {exc}"
            self.timed("pcie_load", t0)
        for r in self.readings:
            gen, width = loaded.get(r.index, (None, None))
            self.add(check_pcie_link(r, source, gen, width, error))

    def functional(self, baselines: list[Baseline]) -> bool:
        """Run the functional checks; True if they also judged the PCIe links (under load)."""

        assert self.backend is not None
        source = self.backend.name
        count = visible_cuda_count(len(self.readings))
        level = self.o.level
        checks = [c.name for c in checks_of(Scope.DEVICE, level) if not self._skipped(c.name)]
        if count > 1:
            checks += [c.name for c in checks_of(Scope.NODE, level) if not self._skipped(c.name)]
        if not checks or count == 0:
            return False
        plan = launcher.level_plan(self.o.level)
        t0 = time.monotonic()
        self.progress(f"functional checks on {count} devices")
        outcomes, identities = launcher.run_workers(
            list(range(count)), checks, plan, timeout_scale=self.o.timeout_scale, progress=self.progress
        )
        self.timed("functional", t0)
        # Map worker (torch ordinal) to the backend's device index by UUID.
        by_uuid = {r.uuid: r for r in self.readings if r.uuid}
        reading_of: dict[int, DeviceReadings | None] = {}
        for ident in identities:
            r = by_uuid.get(ident.uuid or "")
            if r is None and len(identities) == len(self.readings):
                r = self.readings[ident.local_rank]
            reading_of[ident.local_rank] = r
        sku_baselines = {r.sku: find_baseline(baselines, r.name, r.memory_gib) for r in self.readings}
        node_sku = self.readings[0].sku if self.readings else "unknown"
        items: list[DeviceMeasurement] = []
        for outcome in outcomes:
            r = reading_of.get(outcome.local_rank)
            index = r.index if r is not None else outcome.local_rank
            row = find(outcome.check)
            if row is not None and row.scope is Scope.NODE:
                if outcome.local_rank != 0:
                    continue
                index_or_none: int | None = None
            else:
                index_or_none = index
            if outcome.error is not None:
                names = row.result_names if row is not None else (outcome.check,)
                for name in names:
                    self.add(
                        CheckResult(
                            name,
                            Status.UNKNOWN,
                            outcome.error,
                            device=index_or_none,
                            critical=True,
                            duration_s=outcome.duration_s,
                        )
                    )
                continue
            sku = r.sku if r is not None else node_sku
            for m in outcome.measurements:
                items.append(
                    DeviceMeasurement(
                        index_or_none, sku if index_or_none is not None else node_sku, m, [m.value], outcome.duration_s
                    )
                )
        judged = judge(items, sku_baselines, self.o.thresholds)
        retry = [(item, result) for item, result in zip(items, judged, strict=False) if needs_retry(result)]
        if retry:
            self._retry(retry, items, plan, identities, reading_of)
            judged = judge(items, sku_baselines, self.o.thresholds)
        self.add(judged)
        # Clocks and PCIe, as read while the benchmarks ran.
        by_index = {r.index: r for r in self.readings}
        loaded_pcie: dict[int, tuple[int, int]] = {}
        for item in items:
            r = by_index.get(item.device) if item.device is not None else None
            if r is None:
                continue
            d = item.measurement.details
            if item.measurement.check == "gemm_bf16" and "clock_event_reasons" in d:
                loaded = DeviceReadings(
                    index=r.index,
                    clock_event_reasons=d["clock_event_reasons"],
                    sm_clock_mhz=d.get("sm_clock_mhz"),
                    sm_clock_max_mhz=r.sm_clock_max_mhz,
                )
                self.add(check_clocks(loaded, source, name="clocks_under_load"))
            if item.measurement.check == "h2d_bandwidth" and "pcie_gen_under_load" in d:
                loaded_pcie[r.index] = (d["pcie_gen_under_load"], d["pcie_width_under_load"])
        if "host_transfer" not in checks:
            return False
        for r in self.readings:
            gen, width = loaded_pcie.get(r.index, (None, None))
            why = None if gen is not None else "no reading during the host-transfer test"
            self.add(check_pcie_link(r, source, gen, width, why))
        return True

    def _retry(
        self,
        retry: list[tuple[DeviceMeasurement, CheckResult]],
        items: list[DeviceMeasurement],
        plan: Any,
        identities: Any,
        reading_of: dict[int, DeviceReadings | None],
    ) -> None:
        """Repeat each slow measurement once (all flagged devices together); keep the better value."""

        def check_of(result: str) -> str:
            row = row_of_result(result)
            return row.name if row is not None else result

        ordinal_of = {r.index: o for o, r in reading_of.items() if r is not None}
        node_retry = [item for item, _ in retry if item.device is None]
        device_retry = [item for item, _ in retry if item.device is not None]
        t0 = time.monotonic()
        self.progress("repeating slow measurements once")
        if device_retry:
            ordinals = sorted(
                {ordinal_of.get(item.device, item.device) for item in device_retry if item.device is not None}
            )
            checks = sorted({check_of(item.measurement.check) for item in device_retry})
            outcomes, _ = launcher.run_workers(ordinals, checks, plan, timeout_scale=self.o.timeout_scale)
            self._merge(device_retry, outcomes, ordinal_of)
        if node_retry:
            count = visible_cuda_count(len(self.readings))
            checks = sorted({check_of(item.measurement.check) for item in node_retry})
            outcomes, _ = launcher.run_workers(list(range(count)), checks, plan, timeout_scale=self.o.timeout_scale)
            self._merge(node_retry, [o for o in outcomes if o.local_rank == 0], None)
        self.timed("retry", t0)

    @staticmethod
    def _merge(targets: list[DeviceMeasurement], outcomes: Any, ordinal_of: dict[int, int] | None) -> None:
        for item in targets:
            ordinal = None if item.device is None or ordinal_of is None else ordinal_of.get(item.device, item.device)
            for outcome in outcomes:
                if ordinal is not None and outcome.local_rank != ordinal:
                    continue
                for m in outcome.measurements:
                    if m.metric != item.measurement.metric:
                        continue
                    item.attempts.append(m.value)
                    if m.value > item.measurement.value and m.ok:
                        item.measurement = m

    def host_functional(self) -> None:
        """The host's CPU and memory figures, in one worker on the CPU device; judged like the
        other functional figures (no shipped baseline: the job-wide peer comparison uses them)."""

        checks = [c.name for c in checks_of(Scope.HOST, self.o.level) if not self._skipped(c.name)]
        if not checks:
            return
        t0 = time.monotonic()
        self.progress("host CPU and memory figures")
        outcomes, _ = launcher.run_workers(
            [0], checks, launcher.level_plan(self.o.level), device_type="cpu", timeout_scale=self.o.timeout_scale
        )
        self.timed("host_functional", t0)
        items: list[DeviceMeasurement] = []
        for outcome in outcomes:
            if outcome.error is not None:
                self.add(CheckResult(outcome.check, Status.UNKNOWN, outcome.error, duration_s=outcome.duration_s))
                continue
            items.extend(
                DeviceMeasurement(None, "host", m, [m.value], outcome.duration_s) for m in outcome.measurements
            )
        self.add(judge(items, {}, self.o.thresholds))

    def _skipped(self, check: str) -> bool:
        """Whether ``--skip`` names ``check`` or, for a functional check, any of its results."""
        row = find(check)
        names = set(row.result_names) if row is not None else {check}
        return bool(names & self.o.skip)

    def devices_summary(self, baselines: list[Baseline]) -> list[DeviceSummary]:
        out = []
        for r in self.readings:
            b = find_baseline(baselines, r.name, r.memory_gib)
            out.append(
                DeviceSummary(
                    r.index,
                    r.name,
                    r.uuid,
                    r.pci_bus_id,
                    r.memory_total_bytes,
                    r.memory_gib,
                    r.sku,
                    baseline=(b.path or b.source) if b else None,
                )
            )
        return out


def _ib_counters(
    start_call: Call[dict[str, IbPortCounters]] | None, started: float, root: str, limit: float
) -> list[CheckResult]:
    if start_call is None:
        return [CheckResult("ib_counters", Status.SKIPPED, "skipped (--skip)")]
    try:
        start = start_call.result(max(0.0, started + limit - time.monotonic()))
    except TimedOut:
        return check_ib_counters(None, None, 0.0, did_not_return(f"reading {root}/*/ports/*/counters", limit))
    except Exception as exc:
        return check_ib_counters(None, None, 0.0, f"{type(exc).__name__}: {exc}")
    if not start:
        return check_ib_counters(start, None, 0.0)
    try:
        end = call_with_timeout(lambda: read_ib_counters(root), limit)
    except TimedOut:
        return check_ib_counters(start, None, 0.0, did_not_return(f"reading {root}/*/ports/*/counters", limit))
    except Exception as exc:
        return check_ib_counters(start, None, 0.0, f"{type(exc).__name__}: {exc}")
    return check_ib_counters(start, end, time.monotonic() - started)


def _shared_fs(probes: list[SharedFsProbe]) -> list[CheckResult]:
    return [probe.result() for probe in probes]


def run(options: Options, progress: Callable[[str], None] | None = None) -> Report:
    if options.level not in LEVELS:
        raise ValueError(f"level must be one of {LEVELS}")
    started_at = utcnow_iso()
    t_start = time.monotonic()
    state = _Run(options, progress)
    host_calls = [
        (name, what, Call(probe, name="healthcheck-host"), time.monotonic())
        for name, what, probe in host_probes(options.disk_paths, options.min_disk_gib, options.ib_root)
    ]
    shared_fs = (
        start_probes(options.shared_fs_paths(), options.probe_timeout_s) if "shared_fs" not in options.skip else []
    )
    ib_at = time.monotonic()
    ib_start: Call[dict[str, IbPortCounters]] | None = None
    if "ib_counters" not in options.skip:
        ib_start = Call(lambda: read_ib_counters(options.ib_root), name="healthcheck-ib")
    baselines = load_baselines(options.baseline_paths) if options.level != "quick" else []
    state.progress("opening the accelerator backend")
    state.open_backend()
    backend = state.backend
    watching = False
    driver_version = None
    if backend is not None and state.counted:
        watched, watch_why = state.probe(backend.watch_xid, f"{backend.name}: registering for XID events")
        watching = bool(watched)
        state.progress("reading devices")
        state.read_devices()
        state.passive()
        state.kernel_log()
        # The functional checks run at the levels their rows name (none at quick).
        pcie_judged = state.functional(baselines)
        if not pcie_judged and not state._skipped("pcie_link"):
            state.pcie_quick()
        state.counters_at_end()
        indices = [r.index for r in state.readings]
        if watch_why is not None:
            state.add(CheckResult("xid_live", Status.UNKNOWN, watch_why))
        elif state.driver_hung and watching:
            # A driver that hung once is not asked again for what can wait (each call would
            # cost its whole limit): the events are not read, NVML is not shut down.
            state.add(CheckResult("xid_live", Status.UNKNOWN, "not read: an earlier driver call did not return"))
        else:
            events, why = (
                state.probe(backend.xid_events, f"{backend.name}: reading XID events") if watching else ([], None)
            )
            if why is not None:
                state.add(CheckResult("xid_live", Status.UNKNOWN, why))
            else:
                state.add(check_live_xids(events, watching, indices))
        driver_version = state.driver_version
    if backend is not None and not state.driver_hung:
        # Closing is bounded like every other call.
        _, why = state.probe(backend.close, f"{backend.name}: closing")
        if why is not None:
            state.timings["close_did_not_return"] = options.probe_timeout_s
    state.host_functional()
    for name, what, call, started in host_calls:
        limit = options.probe_timeout_s
        try:
            state.add(call.result(max(0.0, started + limit - time.monotonic())))
        except TimedOut:
            state.add(CheckResult(name, Status.UNKNOWN, did_not_return(what, limit)))
        except Exception as exc:
            state.add(CheckResult(name, Status.UNKNOWN, f"{what} failed: {type(exc).__name__}: {exc}"))
    state.add(_ib_counters(ib_start, ib_at, options.ib_root, options.probe_timeout_s))
    state.add(_shared_fs(shared_fs))
    results = [
        CheckResult(r.name, Status.SKIPPED, "skipped (--skip)", device=r.device) if r.name in options.skip else r
        for r in state.results
    ]
    return Report(
        level=options.level,
        backend=backend.name if backend is not None else None,
        started_at=started_at,
        duration_s=time.monotonic() - t_start,
        checks=results,
        devices=state.devices_summary(baselines),
        driver_version=driver_version,
        options=options.to_json(),
        timings=state.timings,
    )
