"""healthcheck.checks.ib_counters: InfiniBand / RoCE port counters read from a sysfs tree (here a
fake one in tmp_path) and judged on how much they moved during the check."""

from __future__ import annotations

from pathlib import Path

import pytest

from healthcheck.checks.ib_counters import (
    COUNTERS,
    FAIL_COUNTERS,
    WARN_COUNTERS,
    IbPortCounters,
    check_ib_counters,
    read_ib_counters,
)
from healthcheck.result import Status


def write_port(root: Path, device: str, port: str, values: dict[str, str], folder: str = "counters") -> Path:
    d = root / device / "ports" / port / folder
    d.mkdir(parents=True, exist_ok=True)
    for name, text in values.items():
        (d / name).write_text(text)
    return d


def port(values: dict[str, int], errors: dict[str, str] | None = None, device: str = "mlx5_0") -> IbPortCounters:
    return IbPortCounters(device, "1", dict(values), dict(errors or {}))


# -- reading ----------------------------------------------------------------------------------
def test_a_node_without_infiniband_has_no_ports(tmp_path):
    assert read_ib_counters(tmp_path / "absent") == {}


def test_counters_are_read_per_port_from_counters_and_hw_counters(tmp_path):
    # GIVEN two ports, one with a counter only under hw_counters/
    write_port(tmp_path, "mlx5_0", "1", {"symbol_error": "3\n", "link_downed": "0"})
    write_port(tmp_path, "mlx5_0", "1", {"port_xmit_discards": "0x10"}, folder="hw_counters")
    write_port(tmp_path, "mlx5_1", "1", {"link_downed": "1"})
    # WHEN read
    ports = read_ib_counters(tmp_path)
    # THEN each port is keyed DEVICE/PORT, with every counter it has (hex too)
    assert sorted(ports) == ["mlx5_0/1", "mlx5_1/1"]
    assert ports["mlx5_0/1"].values == {"symbol_error": 3, "link_downed": 0, "port_xmit_discards": 16}
    assert ports["mlx5_1/1"].values == {"link_downed": 1}


def test_counters_not_in_the_table_are_not_read(tmp_path):
    write_port(tmp_path, "mlx5_0", "1", {"port_rcv_data": "123456", "symbol_error": "0"})
    assert read_ib_counters(tmp_path)["mlx5_0/1"].values == {"symbol_error": 0}


@pytest.mark.parametrize(("text", "why"), [("garbage", "not a number"), ("-4", "negative"), ("", "not a number")])
def test_a_counter_file_with_nonsense_is_an_error_not_a_value(tmp_path, text, why):
    write_port(tmp_path, "mlx5_0", "1", {"symbol_error": text})
    reading = read_ib_counters(tmp_path)["mlx5_0/1"]
    assert "symbol_error" not in reading.values
    assert why in reading.errors["symbol_error"]


def test_a_huge_counter_file_is_read_only_in_part(tmp_path):
    # GIVEN a counter file of a megabyte of digits (a hostile or broken driver)
    write_port(tmp_path, "mlx5_0", "1", {"symbol_error": "9" * 1_000_000})
    # THEN only a bounded prefix is read: a value, not a hang or an exception
    reading = read_ib_counters(tmp_path)["mlx5_0/1"]
    assert reading.values["symbol_error"] == int("9" * 64)


def test_a_port_with_no_counters_is_listed_with_nothing_read(tmp_path):
    (tmp_path / "mlx5_0" / "ports" / "1").mkdir(parents=True)
    reading = read_ib_counters(tmp_path)["mlx5_0/1"]
    assert (reading.values, reading.errors, reading.label) == ({}, {}, "mlx5_0/1")


def test_every_counter_has_a_saturation_maximum():
    assert set(COUNTERS) == set(FAIL_COUNTERS) | set(WARN_COUNTERS)
    assert COUNTERS["link_downed"] == 255


# -- judging ----------------------------------------------------------------------------------
def judge(start: IbPortCounters, end: IbPortCounters | None, window_s: float = 30.0):
    [result] = check_ib_counters({start.label: start}, {start.label: end} if end else {}, window_s)
    return result


def test_a_link_downed_during_the_check_fails_and_drains():
    result = judge(port({"link_downed": 1, "symbol_error": 0}), port({"link_downed": 2, "symbol_error": 0}))
    assert (result.status, result.action, result.value) == (Status.FAIL, "drain", 1)
    assert "link_downed +1" in result.reason and "mlx5_0/1" in result.reason


def test_steady_counters_pass_however_high_their_totals():
    result = judge(port({"symbol_error": 900}), port({"symbol_error": 900}))
    assert (result.status, result.value) == (Status.PASS, 0)


def test_a_rising_congestion_counter_only_warns():
    result = judge(port({"port_xmit_discards": 5}), port({"port_xmit_discards": 50}))
    assert (result.status, result.value) == (Status.WARN, 45)
    assert result.action is None


def test_a_failure_wins_over_a_warning():
    start = port({"port_xmit_discards": 0, "port_rcv_errors": 0})
    end = port({"port_xmit_discards": 3, "port_rcv_errors": 1})
    assert judge(start, end).status is Status.FAIL


def test_a_saturated_counter_is_unknown_and_says_how_to_clear_it():
    # GIVEN link_downed stuck at its 8-bit maximum (an increase cannot show)
    result = judge(port({"link_downed": 255}), port({"link_downed": 255}))
    assert result.status is Status.UNKNOWN
    assert "saturated" in result.reason and "perfquery -x" in result.reason


def test_counters_cleared_during_the_check_are_unknown():
    result = judge(port({"symbol_error": 10}), port({"symbol_error": 0}))
    assert result.status is Status.UNKNOWN and "went backwards" in result.reason


def test_a_counter_unreadable_at_the_end_is_unknown():
    result = judge(port({"symbol_error": 0, "link_downed": 0}), port({"link_downed": 0}))
    assert result.status is Status.UNKNOWN and "symbol_error" in result.reason


def test_a_port_gone_at_the_end_is_unknown():
    assert judge(port({"symbol_error": 0}), None).status is Status.UNKNOWN


def test_a_port_whose_counters_all_failed_is_unknown_with_the_errors():
    result = judge(port({}, {"symbol_error": "counters/symbol_error: Permission denied"}), port({}))
    assert result.status is Status.UNKNOWN and "Permission denied" in result.reason


def test_a_port_without_error_counters_is_skipped():
    assert judge(port({}), port({})).status is Status.SKIPPED


def test_steady_counters_with_some_unreadable_ones_are_unknown_never_pass():
    start = port({"symbol_error": 0}, {"link_downed": "counters/link_downed: I/O error"})
    result = judge(start, port({"symbol_error": 0}))
    assert result.status is Status.UNKNOWN and "not readable: link_downed" in result.reason


def test_no_start_reading_is_one_unknown_result_with_the_error():
    [result] = check_ib_counters(None, None, 5.0, "sysfs read did not return in 10 s")
    assert result.status is Status.UNKNOWN and "did not return" in result.reason


def test_a_node_without_ports_is_skipped():
    [result] = check_ib_counters({}, {}, 5.0)
    assert result.status is Status.SKIPPED


def test_no_end_reading_makes_every_port_unknown():
    start = {"mlx5_0/1": port({"symbol_error": 0}), "mlx5_1/1": port({"symbol_error": 0}, device="mlx5_1")}
    results = check_ib_counters(start, None, 5.0, "hung")
    assert [r.status for r in results] == [Status.UNKNOWN, Status.UNKNOWN]
    assert [r.details["device"] for r in results] == ["mlx5_0", "mlx5_1"]


def test_read_then_judge_over_a_sysfs_tree(tmp_path):
    # GIVEN a port read, then its symbol errors rising by 7
    write_port(tmp_path, "mlx5_0", "1", {"symbol_error": "100"})
    start = read_ib_counters(tmp_path)
    write_port(tmp_path, "mlx5_0", "1", {"symbol_error": "107"})
    end = read_ib_counters(tmp_path)
    # WHEN judged
    [result] = check_ib_counters(start, end, 12.5)
    # THEN it fails naming the rise and the window
    assert result.status is Status.FAIL
    assert "symbol_error +7 in 12.5 s" in result.reason
