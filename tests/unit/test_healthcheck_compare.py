"""healthcheck.compare: measurements judged against the SKU's baseline (fail below 90 %, warn
below 95 %) and against the device's peers on the node (fail 8 % slower, warn 5 %)."""

from __future__ import annotations

import pytest

from healthcheck.baseline import Baseline, MetricBaseline
from healthcheck.compare import DeviceMeasurement, Thresholds, judge, needs_retry
from healthcheck.functional.measurement import Measurement
from healthcheck.result import CheckResult, Status

SKU = "NVIDIA H200 140GiB"
METRIC = "gemm_bf16_tflops"


def gemm(device: int | None, value: float, ok: bool = True, sku: str = SKU, metric: str | None = METRIC):
    return DeviceMeasurement(device, sku, Measurement("gemm_bf16", metric, value, "TFLOP/s", ok=ok))


def baseline(median: float) -> dict[str, Baseline | None]:
    return {SKU: Baseline("NVIDIA H200", 140, {METRIC: MetricBaseline(median, "TFLOP/s")})}


@pytest.mark.parametrize(
    ("ratio", "status"),
    [(1.0, Status.PASS), (0.951, Status.PASS), (0.94, Status.WARN), (0.901, Status.WARN), (0.89, Status.FAIL)],
)
def test_baseline_ratio_decides_pass_warn_fail(ratio, status):
    # GIVEN one device measuring ``ratio`` of its SKU's baseline median (no peers)
    # WHEN judged with the default thresholds
    [result] = judge([gemm(0, 500.0 * ratio)], baseline(500.0), Thresholds())
    # THEN below 95 % warns, below 90 % fails (and a failure drains)
    assert result.status is status
    assert result.action == ("drain" if status is Status.FAIL else None)
    assert result.details["baseline_median"] == 500.0
    assert result.expected == ">= 450.0 TFLOP/s"


def test_without_a_baseline_the_reason_says_so_and_the_device_passes_alone():
    [result] = judge([gemm(0, 100.0)], {}, Thresholds())
    assert result.status is Status.PASS
    assert f"no {SKU} baseline for {METRIC}" in result.reason


def test_a_zero_baseline_median_is_not_divided_by():
    [result] = judge([gemm(0, 100.0)], baseline(0.0), Thresholds())
    assert result.status is Status.PASS and "baseline_ratio" not in result.details


def test_a_device_ten_percent_slower_than_its_peers_fails_without_a_baseline():
    # GIVEN four devices, one 10 % slower than the other three
    items = [gemm(0, 700.0), gemm(1, 700.0), gemm(2, 630.0), gemm(3, 700.0)]
    # WHEN judged
    results = judge(items, {}, Thresholds())
    # THEN only the slow one fails, against the median of its three peers
    assert [r.status for r in results] == [Status.PASS, Status.PASS, Status.FAIL, Status.PASS]
    assert results[2].details["peers"] == 3 and results[2].details["peer_median"] == 700.0
    assert "slower than its 3 peers" in results[2].reason


def test_a_device_six_percent_slower_than_its_peers_warns():
    results = judge([gemm(0, 100.0), gemm(1, 94.0)], {}, Thresholds())
    assert results[1].status is Status.WARN
    assert results[0].status is Status.PASS, "a faster device is never judged slow"


def test_peers_are_only_devices_of_the_same_sku_and_metric_with_correct_results():
    # GIVEN a device whose only would-be peers are of another SKU, another metric, wrong, or the node
    items = [
        gemm(0, 50.0),
        gemm(1, 100.0, sku="NVIDIA A100 80GiB"),
        gemm(2, 100.0, metric="other_metric"),
        gemm(3, 100.0, ok=False),
        gemm(None, 100.0),
    ]
    # WHEN judged
    first = judge(items, {}, Thresholds())[0]
    # THEN it has no peers and is not called slow
    assert first.status is Status.PASS
    assert "peers" not in first.details


def test_a_node_measurement_is_not_compared_with_the_devices():
    results = judge([gemm(None, 10.0), gemm(0, 100.0), gemm(1, 100.0)], {}, Thresholds())
    assert results[0].status is Status.PASS and "peers" not in results[0].details


def test_a_wrong_result_always_fails_and_drains_whatever_its_speed():
    # GIVEN a fast device whose result is wrong
    wrong = DeviceMeasurement(0, SKU, Measurement("gemm_bf16", METRIC, 9999.0, "TFLOP/s", ok=False, reason="mismatch"))
    # WHEN judged against a baseline it beats
    [result] = judge([wrong], baseline(500.0), Thresholds())
    # THEN it fails with its own reason, and records that it was not correct
    assert (result.status, result.action, result.reason) == (Status.FAIL, "drain", "mismatch")
    assert result.details["correct"] is False


def test_a_wrong_result_without_a_reason_says_wrong_results():
    [result] = judge([gemm(0, 1.0, ok=False)], {}, Thresholds())
    assert result.reason == "wrong results"


def test_a_pass_fail_measurement_without_a_metric_passes_with_no_errors():
    [result] = judge([gemm(0, 0.0, metric=None)], baseline(500.0), Thresholds())
    assert (result.status, result.reason) == (Status.PASS, "no errors")


def test_the_worse_of_baseline_and_peers_wins():
    # GIVEN a device at 93 % of the baseline (a warning) and 20 % slower than its peer (a failure)
    items = [gemm(0, 465.0), gemm(1, 581.25)]
    # WHEN judged
    result = judge(items, baseline(500.0), Thresholds())[0]
    # THEN it fails, and both reasons are given
    assert result.status is Status.FAIL
    assert "baseline" in result.reason and "peers" in result.reason


def test_custom_thresholds_are_used():
    strict = Thresholds(fail_below=0.99, warn_below=0.995, peer_fail=0.5, peer_warn=0.4)
    [result] = judge([gemm(0, 98.0)], baseline(100.0), strict)
    assert result.status is Status.FAIL


def test_attempts_are_recorded_only_when_the_measurement_was_repeated():
    once = gemm(0, 100.0)
    once.attempts = [100.0]
    twice = gemm(1, 100.0)
    twice.attempts = [80.12345, 100.0]
    results = judge([once, twice], {}, Thresholds())
    assert "attempts" not in results[0].details
    assert results[1].details["attempts"] == [80.123, 100.0]


def test_the_value_is_rounded_and_carries_unit_and_metric():
    [result] = judge([gemm(3, 123.456789)], {}, Thresholds())
    assert (result.device, result.value, result.unit, result.metric) == (3, 123.457, "TFLOP/s", METRIC)


def test_only_a_slow_correct_failure_is_retried():
    # GIVEN a slow failure, a wrong failure, a warning and a pass/fail failure
    slow = judge([gemm(0, 400.0)], baseline(500.0), Thresholds())[0]
    wrong = judge([gemm(0, 400.0, ok=False)], {}, Thresholds())[0]
    warned = judge([gemm(0, 470.0)], baseline(500.0), Thresholds())[0]
    pattern = CheckResult("pattern", Status.FAIL, "errors", details={"correct": True})
    # THEN only the slow, correct one is repeated
    assert needs_retry(slow) is True
    assert needs_retry(wrong) is False
    assert needs_retry(warned) is False
    assert needs_retry(pattern) is False, "without a metric there is nothing to re-measure"
