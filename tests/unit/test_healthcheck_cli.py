"""healthcheck.cli: the command line's bounds (usage errors exit 3, never 2, which means
"unhealthy"), what reaches the runner, and `baseline learn`; the run itself is faked."""

from __future__ import annotations

import argparse
import json

import pytest

from healthcheck import cli
from healthcheck.result import EXIT_COULD_NOT_RUN


def parse(argv: list[str]) -> argparse.Namespace:
    parser = cli._Parser(prog="python -m healthcheck")
    cli.prepare_parser(parser)
    return parser.parse_args(argv)


@pytest.mark.parametrize(
    "argv",
    [
        ["--level", "extreme"],
        ["--fail-below", "1.5"],
        ["--peer-warn", "-0.1"],
        ["--fail-below", "nan"],
        ["--expect-devices", "-1"],
        ["--expect-devices", "5000"],
        ["--timeout-scale", "0"],
        ["--timeout-scale", "101"],
        ["--min-disk-gib", "inf"],
        ["--xid-window", "1e9"],
        ["--probe-timeout", "601"],
        ["--counter-window", "-1"],
        ["--skip", "ecc_errors,no_such_check"],
        ["--backend", "rocm"],
        ["baseline"],
    ],
)
def test_bad_options_are_usage_errors_that_exit_3(argv, capsys):
    # WHEN the command line is parsed
    with pytest.raises(SystemExit) as info:
        cli.main(argv)
    # THEN it exits "could not run", with argparse's message
    assert info.value.code == EXIT_COULD_NOT_RUN
    assert "error:" in capsys.readouterr().err


def test_an_unknown_check_to_skip_lists_the_known_ones(capsys):
    with pytest.raises(SystemExit):
        cli.main(["--skip", "bogus"])
    err = capsys.readouterr().err
    assert "unknown checks ['bogus']" in err and "ecc_errors" in err


def test_the_prometheus_file_must_be_creatable(tmp_path, capsys):
    for bad in (str(tmp_path / "no-dir" / "x.prom"), str(tmp_path), ""):
        with pytest.raises(SystemExit) as info:
            cli.main(["--prometheus", bad])
        assert info.value.code == 3, bad
    err = capsys.readouterr().err
    assert "does not exist" in err and "is a directory" in err


def test_a_prometheus_file_name_over_255_bytes_is_refused(tmp_path, capsys):
    with pytest.raises(SystemExit):
        cli.main(["--prometheus", str(tmp_path / ("p" * 256))])
    assert "longer than 255 bytes" in capsys.readouterr().err


def test_options_carry_the_command_line_to_the_runner():
    # GIVEN a command line with every conversion the runner relies on
    args = parse(
        [
            "--level",
            "standard",
            "--xid-window",
            "30",
            "--fail-below",
            "0.8",
            "--warn-below",
            "0.9",
            "--peer-fail",
            "0.2",
            "--peer-warn",
            "0.1",
            "--skip",
            " ecc_errors , ,clock_events",
            "--disk",
            "/scratch",
            "--expect-devices",
            "0",
        ]
    )
    # WHEN made into options
    options = cli.options_from_args(args)
    # THEN minutes became seconds, the thresholds are in order, and the skip list is clean
    assert options.level == "standard"
    assert options.xid_window_s == 1800.0
    th = options.thresholds
    assert (th.fail_below, th.warn_below, th.peer_fail, th.peer_warn) == (0.8, 0.9, 0.2, 0.1)
    assert options.skip == {"ecc_errors", "clock_events"}
    assert options.disk_paths == ["/scratch"]
    assert options.expect_devices == 0
    assert options.job_pids == frozenset()


def test_default_options_check_root_and_tmp_with_the_default_limits():
    options = cli.options_from_args(parse([]))
    assert options.disk_paths == ["/", "/tmp"]
    assert (options.level, options.backend, options.expect_devices) == ("quick", "auto", None)
    assert options.probe_timeout_s == cli.PROBE_TIMEOUT_S
    assert options.counter_window_s == 0.0


def test_no_job_has_no_pids_and_an_unknown_job_none_either():
    assert cli.job_pids(None) == frozenset()
    assert cli.job_pids("") == frozenset()
    assert cli.job_pids("no-such-job-7f3a") == frozenset()


class FakeReport:
    exit_code = 2

    def to_json(self) -> dict:
        return {"schema": "dynprof.healthcheck", "verdict": "unhealthy"}


def fake_check(monkeypatch, artifact: str | None = "/store/healthcheck-1", messages=()):
    monkeypatch.setattr(cli, "check", lambda args: (FakeReport(), artifact, list(messages)))
    monkeypatch.setattr(cli, "render_table", lambda report, show_passed=True: f"TABLE show_passed={show_passed}")


def test_the_exit_code_is_the_reports_and_the_table_names_the_artifact(monkeypatch, capsys):
    fake_check(monkeypatch, messages=["healthcheck: results not saved: disk full"])
    code = cli.main(["--failures-only"])
    out, err = capsys.readouterr()
    assert code == 2
    assert out.splitlines() == ["TABLE show_passed=False", "saved: /store/healthcheck-1"]
    assert "dynprof healthcheck: results not saved: disk full" in err


def test_json_output_carries_the_artifact_path(monkeypatch, capsys):
    fake_check(monkeypatch, artifact=None)
    code = cli.main(["--json"])
    data = json.loads(capsys.readouterr().out)
    assert code == 2
    assert data == {"schema": "dynprof.healthcheck", "verdict": "unhealthy", "artifact": None}


def test_check_writes_the_prometheus_file_and_saves_nothing_with_no_save(monkeypatch, tmp_path):
    # GIVEN a faked run, --no-save and a Prometheus file
    monkeypatch.setattr(cli, "run", lambda options, progress: FakeReport())
    monkeypatch.setattr(cli, "render_prometheus", lambda report: "dynprof_healthcheck_exit_code 2\n")
    monkeypatch.setattr(cli, "save_artifact", lambda *a: pytest.fail("--no-save saves nothing"))
    target = tmp_path / "hc.prom"
    # WHEN checked
    report, artifact, messages = cli.check(parse(["--no-save", "-q", "--prometheus", str(target)]))
    # THEN the file holds the metrics, and no artifact is named
    assert target.read_text() == "dynprof_healthcheck_exit_code 2\n"
    assert (artifact, messages, report.exit_code) == (None, [], 2)


def test_an_artifact_that_cannot_be_saved_is_a_message_not_a_failure(monkeypatch):
    monkeypatch.setattr(cli, "run", lambda options, progress: FakeReport())
    monkeypatch.setattr(cli, "render_table", lambda report: "T")

    def refuse(report, text):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(cli, "save_artifact", refuse)
    _, artifact, messages = cli.check(parse(["-q"]))
    assert artifact is None
    assert messages == ["healthcheck: results not saved: [Errno 28] No space left on device"]


def test_a_prometheus_file_that_cannot_be_written_is_an_error_that_exits_3(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(cli, "run", lambda options, progress: FakeReport())
    monkeypatch.setattr(cli, "render_prometheus", lambda report: "x\n")

    def refuse(path, text):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(cli, "write_atomically", refuse)
    code = cli.main(["--no-save", "-q", "--prometheus", str(tmp_path / "hc.prom")])
    err = capsys.readouterr().err
    assert code == 3
    assert "cannot write the Prometheus file" in err and "Permission denied" in err
    assert "what to do:" in err


def node_result(host: str, value: float) -> dict:
    return {
        "schema": "dynprof.healthcheck",
        "host": host,
        "devices": [{"index": 0, "name": "NVIDIA H200", "memory_gib": 140}],
        "checks": [{"name": "gemm", "device": 0, "metric": "gemm_bf16_tflops", "value": value, "status": "pass"}],
    }


def test_baseline_learn_writes_a_baseline_file_and_says_so(tmp_path, capsys):
    for i, value in enumerate((700.0, 710.0, 690.0)):
        (tmp_path / f"n{i}.json").write_text(json.dumps(node_result(f"n{i}", value)))
    out = tmp_path / "out" / "baseline.json"
    out.parent.mkdir()
    code = cli.main(["baseline", "learn", str(tmp_path), "-o", str(out), "--source", "rack 7"])
    data = json.loads(out.read_text())
    assert code == 0
    assert data["baselines"][0]["metrics"]["gemm_bf16_tflops"]["median"] == 700.0
    assert data["baselines"][0]["source"] == "rack 7"
    assert "baseline for NVIDIA H200 140GiB from 3 results" in capsys.readouterr().err


def test_baseline_learn_without_output_prints_the_baseline(tmp_path, capsys):
    path = tmp_path / "r.json"
    path.write_text(json.dumps(node_result("a", 1.0)))
    assert cli.main(["baseline", "learn", str(path)]) == 0
    assert json.loads(capsys.readouterr().out)["schema"] == "dynprof.healthcheck.baseline"


def test_baseline_learn_from_nothing_usable_is_an_error_with_help_exit_3(tmp_path, capsys):
    path = tmp_path / "r.json"
    path.write_text(json.dumps({"something": "else"}))
    code = cli.main(["baseline", "learn", str(path)])
    err = capsys.readouterr().err
    assert code == 3
    assert "healthcheck: error:" in err and "is not a dynprof healthcheck result" in err


def test_usage_errors_exit_3_changes_a_parser_made_elsewhere(capsys):
    parser = argparse.ArgumentParser(prog="dynprof healthcheck")
    parser.add_argument("--n", type=int)
    cli.usage_errors_exit_3(parser)
    with pytest.raises(SystemExit) as info:
        parser.parse_args(["--n", "x"])
    assert info.value.code == 3
    assert "dynprof healthcheck: error:" in capsys.readouterr().err
