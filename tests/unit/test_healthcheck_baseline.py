"""healthcheck.baseline: per-SKU baselines matched by name and memory, read from files that may
be anything (bounded, never a hang or a traceback), and learned from many nodes' results."""

from __future__ import annotations

import json
import os
import sys

import pytest

from healthcheck import baseline as bl
from healthcheck.baseline import (
    BASELINE_SCHEMA,
    Baseline,
    BaselineError,
    find_baseline,
    learn,
    load_baselines,
    parse_baselines,
    read_json_file,
    read_results,
)

METRIC = "gemm_bf16_tflops"


def baseline_data(name: str = "NVIDIA H200", memory_gib: int | None = 140, median: float = 700.0) -> dict:
    return {
        "schema": BASELINE_SCHEMA,
        "schema_version": 1,
        "baselines": [
            {
                "sku": {"name": name, "memory_gib": memory_gib},
                "source": "test",
                "metrics": {METRIC: {"median": median, "unit": "TFLOP/s", "samples": 8, "p10": 690.0}},
            }
        ],
    }


def result(host: str, values: dict[int, float], name: str = "NVIDIA H200", **check_extra) -> dict:
    """A healthcheck result (``--json``) of one node whose devices measured ``values``."""
    return {
        "schema": "dynprof.healthcheck",
        "host": host,
        "devices": [{"index": i, "name": name, "memory_gib": 140} for i in values],
        "checks": [
            {"name": "gemm_bf16", "device": i, "metric": METRIC, "value": v, "unit": "TFLOP/s", "status": "pass"}
            | check_extra
            for i, v in values.items()
        ],
    }


# -- matching ---------------------------------------------------------------------------------
def test_a_baseline_matches_its_name_in_any_case_and_spacing():
    b = Baseline("NVIDIA H200", 140, {})
    assert b.matches("nvidia h200 ", 140)
    assert not b.matches("NVIDIA H100", 140)
    assert not b.matches(None, 140), "a device without a name matches no baseline"


@pytest.mark.parametrize(("memory", "matches"), [(138, True), (142, True), (137, False), (96, False)])
def test_memory_matches_within_two_gib(memory, matches):
    # Drivers reserve slightly different amounts of memory on one SKU.
    assert Baseline("NVIDIA H200", 140, {}).matches("NVIDIA H200", memory) is matches


def test_an_unknown_memory_size_on_either_side_matches_by_name():
    assert Baseline("PPU", None, {}).matches("PPU", 96)
    assert Baseline("PPU", 96, {}).matches("PPU", None)


def test_the_sku_of_a_baseline_reads_like_a_devices():
    assert Baseline("NVIDIA H200", 140, {}).sku == "NVIDIA H200 140GiB"
    assert Baseline("PPU", None, {}).sku == "PPU"


def test_find_baseline_takes_the_first_match_so_given_files_win_over_shipped():
    mine, shipped = Baseline("NVIDIA H200", 140, {}, source="mine"), Baseline("NVIDIA H200", 141, {})
    assert find_baseline([mine, shipped], "NVIDIA H200", 140) is mine
    assert find_baseline([mine, shipped], "NVIDIA A100", 80) is None


# -- parsing ----------------------------------------------------------------------------------
def test_parse_keeps_median_unit_samples_and_the_rest_as_extra():
    [b] = parse_baselines(baseline_data(), "b.json")
    m = b.metrics[METRIC]
    assert (b.name, b.memory_gib, b.source, b.path) == ("NVIDIA H200", 140, "test", "b.json")
    assert (m.median, m.unit, m.samples, m.extra) == (700.0, "TFLOP/s", 8, {"p10": 690.0})


@pytest.mark.parametrize("data", [[], "text", None, 3, {"schema": "something.else"}, {}])
def test_anything_but_a_baseline_is_refused_with_how_to_build_one(data):
    with pytest.raises(BaselineError) as info:
        parse_baselines(data, "x.json")
    assert "x.json is not a dynprof healthcheck baseline" in str(info.value)
    assert "baseline learn" in info.value.help


@pytest.mark.parametrize(
    "baselines",
    [
        [{"metrics": {METRIC: {}}}],  # no median
        [{"metrics": {METRIC: {"median": "fast"}}}],  # not a number
        ["entry"],  # not an object
        [{"metrics": [1, 2]}],  # metrics not an object
        7,  # not a list
    ],
)
def test_a_malformed_baseline_is_a_baseline_error_never_a_traceback(baselines):
    data = {"schema": BASELINE_SCHEMA, "baselines": baselines}
    with pytest.raises(BaselineError, match="is not a valid dynprof healthcheck baseline"):
        parse_baselines(data)


def test_the_baseline_error_exits_could_not_run():
    assert BaselineError("x").exit_code == 3


# -- reading files ----------------------------------------------------------------------------
def test_read_json_file_reads_a_regular_file(tmp_path):
    path = tmp_path / "b.json"
    path.write_text(json.dumps({"a": 1}))
    assert read_json_file(path, "baseline") == {"a": 1}


def test_a_missing_file_is_named_in_the_error(tmp_path):
    with pytest.raises(BaselineError, match=r"cannot read baseline .*nope\.json"):
        read_json_file(tmp_path / "nope.json", "baseline")


def test_a_fifo_is_refused_without_opening_it(tmp_path):
    # GIVEN a FIFO nobody writes to (opening it for reading would block forever)
    fifo = tmp_path / "fifo.json"
    os.mkfifo(fifo)
    # THEN it is refused as not a regular file
    with pytest.raises(BaselineError, match="not a regular file"):
        read_json_file(fifo, "baseline")


def test_a_directory_is_refused_as_not_a_regular_file(tmp_path):
    with pytest.raises(BaselineError, match="not a regular file"):
        read_json_file(tmp_path, "baseline")


def test_a_file_over_the_size_limit_is_refused(tmp_path, monkeypatch):
    # GIVEN a limit of 16 bytes and a 17-byte file
    monkeypatch.setattr(bl, "MAX_JSON_BYTES", 16)
    path = tmp_path / "big.json"
    path.write_text(json.dumps("x" * 15))
    # THEN it is refused by size, not parsed
    with pytest.raises(BaselineError, match="is larger than"):
        read_json_file(path, "baseline")


def test_invalid_and_deeply_nested_json_are_baseline_errors(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    deep = tmp_path / "deep.json"
    deep.write_text("[" * (sys.getrecursionlimit() * 4) + "]" * (sys.getrecursionlimit() * 4))
    with pytest.raises(BaselineError, match=r"not valid JSON \(JSONDecodeError\)"):
        read_json_file(bad, "baseline")
    with pytest.raises(BaselineError, match="not valid JSON"):
        read_json_file(deep, "baseline")


def test_load_baselines_puts_the_given_files_before_the_shipped_ones(tmp_path):
    # GIVEN a file with its own H200 baseline
    path = tmp_path / "mine.json"
    path.write_text(json.dumps(baseline_data(median=1.0)))
    # WHEN loaded with the shipped baselines
    found = load_baselines([str(path)])
    # THEN the given one comes first (and so wins in find_baseline), the shipped ones follow
    assert found[0].path == str(path)
    assert find_baseline(found, "NVIDIA H200", 140).metrics[METRIC].median == 1.0
    assert len(found) > 1
    assert load_baselines([str(path)], shipped=False) == found[:1]


def test_load_baselines_without_files_or_shipped_ones_is_empty():
    assert load_baselines(None, shipped=False) == []


def test_a_path_with_a_nul_byte_is_a_baseline_error():
    with pytest.raises(BaselineError):
        load_baselines(["bad\0name.json"], shipped=False)


# -- learning ---------------------------------------------------------------------------------
def test_learn_takes_median_spread_and_counts_per_sku_and_metric():
    # GIVEN two nodes: 4 devices measuring 100, 200, 300, 400
    results = [result("a", {0: 100.0, 1: 200.0}), result("b", {0: 300.0, 1: 400.0})]
    # WHEN a baseline is learned
    data = learn(results, source="fleet test")
    # THEN the figures are those of the four values
    assert (data["schema"], data["schema_version"]) == (BASELINE_SCHEMA, 1)
    [entry] = data["baselines"]
    m = entry["metrics"][METRIC]
    assert entry["sku"] == {"name": "NVIDIA H200", "memory_gib": 140}
    assert entry["source"] == "fleet test"
    assert (m["median"], m["min"], m["max"]) == (250.0, 100.0, 400.0)
    assert (m["samples"], m["nodes"], m["unit"]) == (4, 2, "TFLOP/s")
    assert m["p10"] == pytest.approx(130.0) and m["p90"] == pytest.approx(370.0)
    assert m["mad"] == 100.0  # |100-250|, |200-250|, |300-250|, |400-250| -> median of 150, 50, 50, 150
    # AND the learned file parses back as a baseline
    assert parse_baselines(data)[0].metrics[METRIC].median == 250.0


def test_learn_keeps_slow_devices_but_leaves_out_wrong_and_unknown_ones():
    # GIVEN a slow device, one whose result was wrong and one that could not run
    results = [
        result("a", {0: 700.0, 1: 100.0}),
        result("b", {0: 9999.0}, details={"correct": False}),
        result("c", {0: 5000.0}, status="unknown"),
    ]
    # WHEN learned
    m = learn(results)["baselines"][0]["metrics"][METRIC]
    # THEN only the first node's two figures count
    assert (m["samples"], m["nodes"], m["median"]) == (2, 1, 400.0)


def test_learn_names_its_source_by_default():
    data = learn([result("a", {0: 1.0}), result("a", {0: 2.0})])
    assert data["baselines"][0]["source"] == "learned from 2 results on 1 nodes"


def test_learn_separates_skus():
    data = learn([result("a", {0: 1.0}), result("b", {0: 2.0}, name="NVIDIA A100")])
    assert sorted(b["sku"]["name"] for b in data["baselines"]) == ["NVIDIA A100", "NVIDIA H200"]


def test_learn_refuses_something_that_is_not_a_result():
    with pytest.raises(BaselineError, match="not a dynprof healthcheck result"):
        learn([{"schema": BASELINE_SCHEMA}])


def test_learn_from_results_without_measurements_says_what_to_run():
    # GIVEN a quick run's result: checks without metrics
    quick = {"schema": "dynprof.healthcheck", "host": "a", "devices": [], "checks": [{"name": "ecc"}]}
    with pytest.raises(BaselineError) as info:
        learn([quick])
    assert "no functional measurements" in str(info.value)
    assert "--level standard" in info.value.help


def test_learn_ignores_non_numeric_values():
    results = [result("a", {0: 1.0}), result("b", {0: "fast"})]  # type: ignore[dict-item]
    assert learn(results)["baselines"][0]["metrics"][METRIC]["samples"] == 1


# -- reading results --------------------------------------------------------------------------
def test_read_results_prefers_results_json_files_anywhere_under_a_directory(tmp_path):
    # GIVEN artifact directories holding results.json, and an unrelated JSON at the top
    for node in ("a", "b"):
        (tmp_path / node).mkdir()
        (tmp_path / node / "results.json").write_text(json.dumps(result(node, {0: 1.0})))
    (tmp_path / "other.json").write_text(json.dumps({"not": "a result"}))
    # WHEN read
    found = read_results([str(tmp_path)])
    # THEN the two results are read, in path order
    assert [r["host"] for r in found] == ["a", "b"]


def test_read_results_takes_top_level_json_files_when_there_is_no_results_json(tmp_path):
    (tmp_path / "n1.json").write_text(json.dumps(result("n1", {0: 1.0})))
    (tmp_path / "notes.json").write_text(json.dumps([1, 2]))
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "deep.json").write_text(json.dumps(result("deep", {0: 1.0})))
    # In a directory, files that are not results are skipped; only the top level is read.
    assert [r["host"] for r in read_results([str(tmp_path)])] == ["n1"]


def test_a_named_file_that_is_not_a_result_is_refused(tmp_path):
    path = tmp_path / "x.json"
    path.write_text(json.dumps(baseline_data()))
    with pytest.raises(BaselineError, match="is not a dynprof healthcheck result"):
        read_results([str(path)])


def test_an_empty_directory_has_no_results(tmp_path):
    with pytest.raises(BaselineError, match="no results in"):
        read_results([str(tmp_path)])


def test_a_path_too_long_is_a_baseline_error(tmp_path):
    with pytest.raises(BaselineError, match="cannot read"):
        read_results([str(tmp_path / ("x" * 5000))])


def test_read_results_does_not_follow_directory_links(tmp_path):
    # GIVEN a results file reachable only through a symbolic link to a directory
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "results.json").write_text(json.dumps(result("outside", {0: 1.0})))
    top = tmp_path / "top"
    top.mkdir()
    (top / "link").symlink_to(outside, target_is_directory=True)
    (top / "own").mkdir()
    (top / "own" / "results.json").write_text(json.dumps(result("own", {0: 1.0})))
    # THEN only the directory's own result is read
    assert [r["host"] for r in read_results([str(top)])] == ["own"]
