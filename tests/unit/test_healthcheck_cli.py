"""healthcheck.cli (`python -m healthcheck`): the command line's bounds (usage errors exit 3,
never 2, which means "unhealthy"), what it prints, and `baseline learn`; the run itself is faked."""

from __future__ import annotations

import json

import pytest

from healthcheck import cli, collect
from healthcheck.collect import Checked
from healthcheck.result import EXIT_COULD_NOT_RUN


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


class FakeReport:
    exit_code = 2

    def to_json(self) -> dict:
        return {"schema": "dynprof.healthcheck", "verdict": "unhealthy"}


def fake_check(monkeypatch, artifact: str | None = "/store/healthcheck-1", messages=()):
    checked = Checked(FakeReport(), artifact, list(messages))  # type: ignore[arg-type]
    monkeypatch.setattr(cli, "collect_here", lambda request, show_progress: checked)
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


def test_a_prometheus_file_that_cannot_be_written_is_an_error_that_exits_3(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(collect, "run", lambda options, progress: FakeReport())
    monkeypatch.setattr(collect, "render_prometheus", lambda report: "x\n")

    def refuse(path, text):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(collect, "write_atomically", refuse)
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
