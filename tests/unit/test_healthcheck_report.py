"""Report formats (table, JSON schema, Prometheus), exit codes, host checks, peers and baselines."""

from __future__ import annotations

import json
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from healthcheck.backends.smi import SmiBackend, parse_help_fields
from healthcheck.baseline import find_baseline, learn, load_baselines, parse_baselines, read_results
from healthcheck.checks.host import (
    IbPort,
    ProcState,
    check_disk,
    check_ib_ports,
    check_memory,
    check_process_states,
    check_shm,
)
from healthcheck.compare import DeviceMeasurement, Thresholds, judge
from healthcheck.functional.measurement import Measurement
from healthcheck.report import Report, render_prometheus, render_table, write_atomically
from healthcheck.result import CheckResult, Status, exit_code

GIB = 1024**3


def result(status: Status, critical: bool = False, **kw) -> CheckResult:
    return CheckResult("x", status, "why", critical=critical, **kw)


# -- exit codes ------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("statuses", "code"),
    [
        ([Status.PASS, Status.SKIPPED], 0),
        ([Status.PASS, Status.WARN], 1),
        ([Status.PASS, Status.UNKNOWN], 1),
        ([Status.PASS, (Status.UNKNOWN, True)], 3),
        ([Status.WARN, (Status.UNKNOWN, True), Status.FAIL], 2),
        ([], 3),
    ],
)
def test_exit_codes(statuses, code):
    results = [result(*s) if isinstance(s, tuple) else result(s) for s in statuses]
    assert exit_code(results) == code


def sample_report() -> Report:
    checks = [
        CheckResult("devices", Status.PASS, "2 found", value=2, expected="2", critical=True),
        CheckResult("ecc_errors", Status.FAIL, "3 uncorrectable", device=1, value=3, expected="0", action="reset"),
        CheckResult(
            "gemm_bf16",
            Status.PASS,
            "99% of baseline",
            device=0,
            value=712.34,
            unit="TFLOP/s",
            metric="gemm_bf16_tflops",
        ),
        CheckResult("disk_free", Status.WARN, "/: low", value=4.2, unit="GiB", details={"path": "/"}),
        CheckResult("nvlink", Status.SKIPPED, "no NVLink", device=0),
    ]
    return Report(
        level="standard",
        backend="nvml",
        started_at="2026-01-01T00:00:00Z",
        duration_s=12.5,
        checks=checks,
        host='node"7',
    )


def test_json_is_versioned_and_carries_verdict_actions_and_checks():
    data = json.loads(json.dumps(sample_report().to_json()))
    assert data["schema"] == "dynprof.healthcheck" and data["schema_version"] == 1
    assert (data["verdict"], data["exit_code"]) == ("unhealthy", 2)
    assert data["actions"] == {"1": "reset"}
    assert data["counts"] == {"pass": 2, "warn": 1, "fail": 1, "unknown": 0, "skipped": 1}
    ecc = next(c for c in data["checks"] if c["name"] == "ecc_errors")
    assert set(ecc) >= {
        "name",
        "status",
        "reason",
        "device",
        "value",
        "expected",
        "unit",
        "metric",
        "action",
        "critical",
        "duration_s",
        "details",
    }
    assert ecc["status"] == "fail"


def test_table_has_a_row_per_check_and_the_verdict():
    text = render_table(sample_report())
    assert "ecc_errors  1       FAIL" in text
    assert "712.3 TFLOP/s" in text
    assert "verdict: UNHEALTHY (exit 2)" in text and "device 1: reset" in text
    brief = render_table(sample_report(), show_passed=False)
    assert "gemm_bf16" not in brief and "disk_free" in brief


def _prometheus_samples(text: str) -> list[tuple[str, dict[str, str], float]]:
    from prometheus_client.parser import text_string_to_metric_families

    return [(x.name, x.labels, x.value) for f in text_string_to_metric_families(text) for x in f.samples]


def test_prometheus_text_format():
    # GIVEN a report; WHEN it is written in the Prometheus text format (by prometheus_client)
    text = render_prometheus(sample_report())
    # THEN Prometheus's own parser reads the same names, labels and values as before
    samples = _prometheus_samples(text)
    host = 'node"7'
    assert ("dynprof_healthcheck_exit_code", {"host": host, "level": "standard"}, 2.0) in samples
    assert ("dynprof_healthcheck_check_status", {"host": host, "check": "ecc_errors", "device": "1"}, 2.0) in samples
    assert ("dynprof_healthcheck_check_status", {"host": host, "check": "nvlink", "device": "0"}, -1.0) in samples
    assert (
        "dynprof_healthcheck_check_status",
        {"host": host, "check": "disk_free", "device": "node", "path": "/"},
        1.0,
    ) in samples
    assert (
        "dynprof_healthcheck_measurement",
        {"host": host, "metric": "gemm_bf16_tflops", "device": "0"},
        712.34,
    ) in samples
    lines = text.splitlines()
    assert 'dynprof_healthcheck_exit_code{host="node\\"7",level="standard"} 2.0' in lines  # escaped, as before
    assert "# TYPE dynprof_healthcheck_check_status gauge" in lines
    assert all(line.startswith(("# HELP", "# TYPE", "dynprof_healthcheck_")) for line in lines)


def test_prometheus_file_is_replaced_atomically(tmp_path):
    target = tmp_path / "dynprof.prom"
    write_atomically(target, "a 1\n")
    write_atomically(target, "a 2\n")
    assert target.read_text() == "a 2\n"
    assert [p.name for p in tmp_path.iterdir()] == ["dynprof.prom"]


def test_a_fifo_or_device_target_is_written_in_place_never_replaced(tmp_path):
    # GIVEN a FIFO where the Prometheus file would go (as /dev/stdout or /dev/null would be)
    import os
    import stat
    import threading

    fifo = tmp_path / "out.prom"
    os.mkfifo(fifo)
    got: list[str] = []
    reader = threading.Thread(target=lambda: got.append(fifo.read_text()))
    reader.start()

    # WHEN the report is written there
    write_atomically(fifo, "a 1\n")
    reader.join(timeout=10)

    # THEN the text went through the FIFO, which is still a FIFO (not renamed over)
    assert got == ["a 1\n"]
    assert stat.S_ISFIFO(fifo.stat().st_mode)


# -- host checks ------------------------------------------------------------------------------
def test_host_decisions():
    assert check_disk("/", 100 * GIB, 50 * GIB, 10).status is Status.PASS
    assert check_disk("/", 100 * GIB, 5 * GIB, 10).status is Status.WARN
    assert check_disk("/", 100 * GIB, GIB // 4, 10).status is Status.FAIL
    assert check_shm(64 * 1024**2).status is Status.FAIL  # docker's default
    assert check_shm(4 * GIB).status is Status.WARN
    assert check_shm(None).status is Status.FAIL
    assert check_memory(1000 * GIB, 500 * GIB).status is Status.PASS
    assert check_memory(1000 * GIB, 70 * GIB).status is Status.WARN
    assert check_memory(1000 * GIB, 10 * GIB).status is Status.FAIL


def test_processes_stuck_in_the_gpu_driver_fail_others_warn():
    nv = ProcState(10, "python", "D", 1, "nv_wait_for_gpu")
    io = ProcState(11, "rsync", "D", 1, "io_schedule")
    zombies = [ProcState(i, "defunct", "Z", 5) for i in range(25)]
    assert check_process_states([], [nv, io]).status is Status.FAIL
    assert check_process_states([], [io]).status is Status.WARN
    assert check_process_states(zombies, []).status is Status.WARN
    assert check_process_states(zombies[:3], []).status is Status.PASS


def test_ib_ports_down_or_slower_than_peers_warn():
    ports = [
        IbPort("mlx5_0", "1", "4: ACTIVE", "5: LinkUp", "400 Gb/sec (4X NDR)", "InfiniBand"),
        IbPort("mlx5_1", "1", "4: ACTIVE", "5: LinkUp", "200 Gb/sec (4X HDR)", "InfiniBand"),
        IbPort("mlx5_2", "1", "1: DOWN", "3: Disabled", "10 Gb/sec (4X SDR)", "InfiniBand"),
        IbPort("mlx5_3", "1", "4: ACTIVE", "5: LinkUp", "100 Gb/sec (2X HDR)", "Ethernet"),
    ]
    results = check_ib_ports(ports)
    assert [r.status for r in results] == [Status.PASS, Status.WARN, Status.WARN, Status.PASS]
    assert "slower than its peers" in results[1].reason and "DOWN" in results[2].reason
    assert check_ib_ports([])[0].status is Status.SKIPPED


# -- peers and baselines ---------------------------------------------------------------------
def gemm(device: int, value: float, ok: bool = True) -> DeviceMeasurement:
    m = Measurement("gemm_bf16", "gemm_bf16_tflops", value, "TFLOP/s", ok, "" if ok else "wrong results")
    return DeviceMeasurement(device, "NVIDIA H200 140GiB", m, [value])


def test_a_device_10_percent_slower_than_its_peers_fails_without_a_baseline():
    # GIVEN eight devices, one 10 % slower (the simulated result of a slow device)
    items = [gemm(i, 700.0 + i) for i in range(7)] + [gemm(7, 0.90 * 703)]
    # WHEN judged with no baseline
    results = judge(items, {}, Thresholds())
    # THEN that one fails against its 7 peers, the others pass
    assert results[7].status is Status.FAIL and "slower than its 7 peers" in results[7].reason
    assert all(r.status is Status.PASS for r in results[:7])


def test_two_devices_the_slower_is_compared_with_the_other():
    results = judge([gemm(0, 700.0), gemm(1, 650.0)], {}, Thresholds())
    assert results[0].status is Status.PASS
    assert results[1].status is Status.WARN  # 7 % slower: between peer_warn and peer_fail


def baseline_file(median: float) -> dict:
    return {
        "schema": "dynprof.healthcheck.baseline",
        "schema_version": 1,
        "baselines": [
            {
                "sku": {"name": "NVIDIA H200", "memory_gib": 140},
                "metrics": {"gemm_bf16_tflops": {"median": median, "unit": "TFLOP/s", "samples": 4}},
            }
        ],
    }


@pytest.mark.parametrize(("ratio", "status"), [(1.0, Status.PASS), (0.93, Status.WARN), (0.85, Status.FAIL)])
def test_baseline_thresholds(ratio, status):
    (b,) = parse_baselines(baseline_file(700.0))
    results = judge([gemm(0, 700.0 * ratio)], {"NVIDIA H200 140GiB": b}, Thresholds())
    assert results[0].status is status
    assert results[0].details["baseline_ratio"] == pytest.approx(ratio)


def test_wrong_results_fail_whatever_the_speed():
    results = judge([gemm(0, 900.0, ok=False), gemm(1, 700.0)], {}, Thresholds())
    assert results[0].status is Status.FAIL and results[0].reason == "wrong results"


def test_baselines_match_by_name_and_memory_and_the_shipped_h200_one_loads():
    (b,) = parse_baselines(baseline_file(700.0))
    assert find_baseline([b], "NVIDIA H200", 141) is b
    assert find_baseline([b], "NVIDIA H200", 96) is None
    assert find_baseline([b], "NVIDIA H100 80GB HBM3", 80) is None
    shipped = load_baselines()
    h200 = find_baseline(shipped, "NVIDIA H200", 140)
    assert h200 is not None and "gemm_bf16_tflops" in h200.metrics


def test_learn_takes_median_and_spread_over_nodes(tmp_path):
    # GIVEN results of two nodes with two H200s each
    def node(host: str, values: list[float]) -> dict:
        return {
            "schema": "dynprof.healthcheck",
            "host": host,
            "devices": [{"index": i, "name": "NVIDIA H200", "memory_gib": 140} for i in range(len(values))],
            "checks": [
                {
                    "name": "gemm_bf16",
                    "metric": "gemm_bf16_tflops",
                    "device": i,
                    "value": v,
                    "unit": "TFLOP/s",
                    "status": "pass",
                    "details": {"correct": True},
                }
                for i, v in enumerate(values)
            ]
            + [
                {
                    "name": "gemm_bf16",
                    "metric": "gemm_bf16_tflops",
                    "device": 0,
                    "value": None,
                    "status": "unknown",
                    "details": {},
                }
            ],
        }

    (tmp_path / "a.json").write_text(json.dumps(node("a", [700.0, 710.0])))
    (tmp_path / "b.json").write_text(json.dumps(node("b", [690.0, 720.0])))
    # WHEN a baseline is learned from them
    data = learn(read_results([str(tmp_path)]))
    # THEN it holds the median and spread, and loads back
    (entry,) = data["baselines"]
    m = entry["metrics"]["gemm_bf16_tflops"]
    assert (m["median"], m["min"], m["max"], m["samples"], m["nodes"]) == (705.0, 690.0, 720.0, 4, 2)
    assert parse_baselines(data)[0].metrics["gemm_bf16_tflops"].median == 705.0


# -- the smi backend against an nvidia-smi-style tool ---------------------------------------------
FAKE_SMI = textwrap.dedent("""\
    #!{python}
    import sys
    args = " ".join(sys.argv[1:])
    if args == "--help-query-gpu":
        print('"index"\\n    Zero based index.\\n"name" or "gpu_name"\\n    Product name.')
        for f in ["uuid", "pci.bus_id", "memory.total", "driver_version", "persistence_mode", "ecc.mode.current",
                  "ecc.errors.uncorrected.volatile.total", "ecc.errors.uncorrected.aggregate.total",
                  "pcie.link.gen.max", "pcie.link.width.current", "pcie.link.width.max", "temperature.gpu"]:
            print('"%s"\\n    doc' % f)
        print('"pcie.link.gen.current" or "pcie.link.gen.gpucurrent"\\n    doc')
    elif args.startswith("--query-gpu="):
        devices = [
            {{"index": "0", "name": "PPU-ZW810E", "uuid": "PPU-0001", "pci.bus_id": "00000000:3B:00.0",
             "memory.total": "98304", "driver_version": "1.5.0", "persistence_mode": "Enabled",
             "ecc.mode.current": "Enabled", "ecc.errors.uncorrected.volatile.total": "0",
             "ecc.errors.uncorrected.aggregate.total": "0", "pcie.link.gen.gpucurrent": "5", "pcie.link.gen.max": "5",
             "pcie.link.width.current": "16", "pcie.link.width.max": "16", "temperature.gpu": "41"}},
            {{"index": "1", "name": "PPU-ZW810E", "uuid": "PPU-0002", "pci.bus_id": "00000000:5E:00.0",
             "memory.total": "98304", "driver_version": "1.5.0", "persistence_mode": "Disabled",
             "ecc.mode.current": "Enabled", "ecc.errors.uncorrected.volatile.total": "2",
             "ecc.errors.uncorrected.aggregate.total": "[N/A]", "pcie.link.gen.gpucurrent": "4",
             "pcie.link.gen.max": "5", "pcie.link.width.current": "16", "pcie.link.width.max": "16",
             "temperature.gpu": "40"}},
        ]
        fields = sys.argv[1].split("=", 1)[1].split(",")
        unknown = [f for f in fields if f not in devices[0]]
        if unknown:
            print('Field "%s" is not a valid field to query.' % unknown[0], file=sys.stderr)
            sys.exit(2)
        for d in devices:
            print(", ".join(d[f] for f in fields))
    elif args.startswith("--query-compute-apps"):
        print("PPU-0002, 4242, 1024")
    else:
        print("Invalid combination of input arguments", file=sys.stderr)
        sys.exit(2)
""")


def test_smi_backend_reads_what_the_tool_knows_and_nothing_else(tmp_path):
    # GIVEN a ppu-smi-like tool that lacks remapped rows, clocks and NVLink queries
    tool = tmp_path / "ppu-smi"
    tool.write_text(FAKE_SMI.format(python=sys.executable))
    tool.chmod(tool.stat().st_mode | stat.S_IXUSR)
    # WHEN the smi backend reads it
    backend = SmiBackend.open(str(tool))
    r0, r1 = backend.read(0), backend.read(1)
    # THEN the fields it has are parsed and the rest are not available (so their checks are unknown)
    assert backend.device_count() == 2 and backend.driver_version() == "1.5.0"
    assert (r0.name, r0.memory_gib, r0.ecc_enabled, r0.pcie_gen_current, r0.pcie_gen_max) == (
        "PPU-ZW810E",
        96,
        True,
        5,
        5,
    )
    assert r1.persistence_mode is False and r1.ecc_uncorrected_volatile == 2
    assert r1.ecc_uncorrected_aggregate is None and "ecc_uncorrected_aggregate" in r1.errors
    assert r0.remap_pending is None and r0.clock_event_reasons is None and r0.nvlinks is None
    assert [p.pid for p in r1.processes or []] == [4242] and r0.processes == []
    assert "gpu_name" in parse_help_fields('"name" or "gpu_name"\n')


def test_dynprof_cli_runs_baseline_learn(tmp_path):
    results = tmp_path / "r.json"
    results.write_text(
        json.dumps(
            {
                "schema": "dynprof.healthcheck",
                "host": "n1",
                "devices": [{"index": 0, "name": "NVIDIA H200", "memory_gib": 140}],
                "checks": [
                    {
                        "name": "gemm_bf16",
                        "metric": "gemm_bf16_tflops",
                        "device": 0,
                        "value": 701.5,
                        "unit": "TFLOP/s",
                        "status": "pass",
                        "details": {"correct": True},
                    }
                ],
            }
        )
    )
    out = tmp_path / "baseline.json"
    proc = subprocess.run(
        [sys.executable, "-m", "healthcheck", "baseline", "learn", str(results), "-o", str(out)],
        capture_output=True,
        text=True,
        cwd=str(Path(__file__).resolve().parents[2]),
    )
    assert proc.returncode == 0, proc.stderr
    assert json.loads(out.read_text())["baselines"][0]["metrics"]["gemm_bf16_tflops"]["median"] == 701.5


def test_prometheus_exports_the_worst_status_of_a_check_with_several_results():
    report = sample_report()
    report.checks += [
        CheckResult("xid_kernel_log", Status.PASS, "none"),
        CheckResult("xid_kernel_log", Status.WARN, "XID 13 on a device not checked here"),
    ]
    samples = _prometheus_samples(render_prometheus(report))
    assert [x for x in samples if x[1].get("check") == "xid_kernel_log"] == [
        ("dynprof_healthcheck_check_status", {"host": 'node"7', "check": "xid_kernel_log", "device": "node"}, 1.0)
    ]
