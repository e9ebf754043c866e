"""healthcheck.result: a check's verdict as JSON, and the exit code of a whole run (a stable
contract: 0 healthy, 1 warning, 2 unhealthy, 3 could not run)."""

from __future__ import annotations

import json

import pytest

from healthcheck.result import (
    ACTIONS,
    EXIT_COULD_NOT_RUN,
    EXIT_HEALTHY,
    EXIT_UNHEALTHY,
    EXIT_WARNING,
    OTHERWISE,
    CheckResult,
    Status,
    decide,
    exit_code,
    row,
    verdict,
)


def result(status: Status, critical: bool = False) -> CheckResult:
    return CheckResult("some_check", status, "why", critical=critical)


def test_the_exit_codes_are_the_documented_numbers():
    # GIVEN the documented contract
    # THEN the constants keep their values (schedulers and scripts rely on them)
    assert (EXIT_HEALTHY, EXIT_WARNING, EXIT_UNHEALTHY, EXIT_COULD_NOT_RUN) == (0, 1, 2, 3)


def test_a_run_without_results_could_not_run():
    # GIVEN no results at all
    # WHEN the exit code is computed
    # THEN nothing was checked, which is never "healthy"
    assert exit_code([]) == EXIT_COULD_NOT_RUN


def test_passes_and_skips_are_healthy():
    assert exit_code([result(Status.PASS), result(Status.SKIPPED)]) == EXIT_HEALTHY


def test_a_warning_makes_the_run_a_warning():
    assert exit_code([result(Status.PASS), result(Status.WARN)]) == EXIT_WARNING


def test_an_unknown_non_critical_check_is_a_warning_never_a_pass():
    assert exit_code([result(Status.PASS), result(Status.UNKNOWN)]) == EXIT_WARNING


def test_an_unknown_critical_check_means_the_node_could_not_be_checked():
    assert exit_code([result(Status.PASS), result(Status.WARN), result(Status.UNKNOWN, critical=True)]) == 3


def test_a_failure_wins_over_a_critical_unknown():
    # GIVEN a failed check and a critical check that could not run
    results = [result(Status.UNKNOWN, critical=True), result(Status.FAIL)]
    # WHEN the exit code is computed
    # THEN the node is unhealthy (drain it), not merely "could not run"
    assert exit_code(results) == EXIT_UNHEALTHY


def test_a_critical_pass_does_not_change_a_healthy_run():
    assert exit_code([result(Status.PASS, critical=True)]) == EXIT_HEALTHY


@pytest.mark.parametrize(
    ("code", "word"),
    [(0, "healthy"), (1, "warning"), (2, "unhealthy"), (3, "could not run")],
)
def test_each_exit_code_has_its_word(code, word):
    assert verdict(code) == word


def test_an_exit_code_outside_the_contract_has_no_verdict():
    with pytest.raises(KeyError):
        verdict(4)


def test_to_json_writes_the_status_as_its_plain_value_and_keeps_every_field():
    # GIVEN a result with a value, a unit and details
    r = CheckResult(
        "gemm", Status.FAIL, "slow", device=2, value=1.5, unit="TFLOP/s", action="drain", details={"peers": 3}
    )
    # WHEN written as JSON
    data = r.to_json()
    # THEN the status is the string, and the JSON round-trips through the json module
    assert data["status"] == "fail"
    assert (data["device"], data["value"], data["unit"], data["action"]) == (2, 1.5, "TFLOP/s", "drain")
    assert json.loads(json.dumps(data)) == data


def test_to_json_copies_details_so_the_result_is_not_changed_through_it():
    r = CheckResult("x", Status.PASS, "ok", details={"list": [1]})
    data = r.to_json()
    data["details"]["list"].append(2)
    assert r.details == {"list": [1]}, "asdict must deep-copy the details"


def test_a_new_result_is_about_the_node_and_not_critical_by_default():
    r = CheckResult("x", Status.PASS, "ok")
    assert r.device is None and r.critical is False and r.action is None and r.details == {}


def test_the_actions_are_drain_reset_and_warn():
    assert set(ACTIONS) == {"drain", "reset", "warn"}


def test_status_values_are_the_json_words():
    assert [s.value for s in Status] == ["pass", "warn", "fail", "unknown", "skipped"]
    assert Status("fail") is Status.FAIL


# -- the decision table -------------------------------------------------------------------------
def test_decide_gives_the_first_row_that_holds_with_the_shared_fields():
    # GIVEN a table whose second and third rows both hold, with fields shared by every row
    rows = [
        row(False, Status.FAIL, "never", action="drain"),
        row(True, Status.WARN, "second", expected=None),
        row(OTHERWISE, Status.PASS, "third"),
    ]
    # WHEN judged on the node (no device)
    got = decide("some_check", rows, value=3, expected=">= 4", unit="GiB", details={"path": "/"})
    # THEN the second row decides: its own fields replace the shared ones, the rest are kept
    assert (got.name, got.status, got.reason, got.device) == ("some_check", Status.WARN, "second", None)
    assert (got.value, got.expected, got.unit, got.action, got.details) == (3, None, "GiB", None, {"path": "/"})


def test_decide_on_a_device_names_it():
    got = decide("c", [row(OTHERWISE, Status.PASS, "ok")], device=5)
    assert (got.device, got.status) == (5, Status.PASS)


def test_a_table_where_no_row_holds_is_a_programming_error():
    with pytest.raises(AssertionError, match="c: no row of the decision table holds"):
        decide("c", [row(False, Status.PASS, "x")])
