"""The healthcheck kind's typed entry point (healthcheck.collect): its request, bounded against
what it is sent, and the child that runs the checks, killed at its limit, its report decoded."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dynprof import errors
from healthcheck import collect as hc
from healthcheck.arguments import add_check_arguments, request_from_args
from healthcheck.collect import HealthcheckRequest
from healthcheck.result import Status


def test_a_request_goes_through_json_and_back():
    request = HealthcheckRequest(level="standard", job="j1", timeout=30.0)
    assert HealthcheckRequest.from_json(request.to_json()) == request
    assert HealthcheckRequest.from_text(json.dumps(request.to_json())) == request
    # missing keys take their defaults
    assert HealthcheckRequest.from_json({"job": "j1"}) == HealthcheckRequest(job="j1")
    # every option of `dynprof healthcheck` the sidecar's action takes goes through too
    full = HealthcheckRequest(
        level="standard",
        job="j1",
        backend="smi",
        expect_devices=8,
        skip=("disk_free", "xid_live"),
        timeout_scale=2.0,
        fail_below=0.8,
        warn_below=0.9,
        peer_fail=0.1,
        peer_warn=0.07,
        min_disk_gib=0.0,
        xid_window=30.0,
        no_save=True,
    )
    assert HealthcheckRequest.from_json(full.to_json()) == full
    options = full.options()
    assert (options.level, options.backend, options.expect_devices, options.skip) == (
        "standard",
        "smi",
        8,
        {"disk_free", "xid_live"},
    )
    assert options.xid_window_s == 1800.0 and options.timeout_scale == 2.0 and options.min_disk_gib == 0.0
    assert (options.thresholds.fail_below, options.thresholds.peer_warn) == (0.8, 0.07)


@pytest.mark.parametrize(
    "doc, said",
    [
        (["quick"], "is a JSON object"),
        ({"level": "deep"}, "level 'deep'"),
        ({"level": 3}, "level 3"),
        ({"job": 7}, "non-empty text"),
        ({"job": ""}, "non-empty text"),
        ({"job": "j" * 201}, "at most 200 characters"),
        ({"job": "a\nb"}, "printable"),
        ({"timeout": True}, "not a number"),
        ({"timeout": "10"}, "not a number"),
        ({"timeout": float("nan")}, "not a number"),
        ({"timeout": 0}, "more than 0"),
        ({"timeout": 1e9}, "at most 3600"),
        ({f"k{i}": i for i in range(17)}, "at most 16 keys"),
        ({"job": "j1", "later": 1}, "unknown option 'later'"),
        ({"backend": "dcgm"}, "--backend 'dcgm'"),
        ({"expect_devices": -1}, "--expect-devices -1"),
        ({"expect_devices": True}, "--expect-devices True"),
        ({"skip": ["no_such_check"]}, "unknown checks ['no_such_check']"),
        ({"skip": [3]}, "--skip is a list of check names"),
        ({"timeout_scale": 0}, "--timeout-scale of 0: more than 0"),
        ({"fail_below": 1.5}, "--fail-below of 1.5: at least 0, at most 1"),
        ({"peer_warn": -0.1}, "--peer-warn of -0.1"),
        ({"min_disk_gib": float("inf")}, "--min-disk-gib of inf: not a number"),
        ({"xid_window": 1e9}, "--xid-window of 1e+09"),
        ({"no_save": "yes"}, "--no-save is true or false"),
    ],
)
def test_a_bad_request_is_refused_with_what_is_wrong(doc, said):
    with pytest.raises(errors.UsageError) as refused:
        HealthcheckRequest.from_json(doc)
    assert said in refused.value.message


@pytest.mark.parametrize(
    "text, said",
    [
        ('{"job": "' + "j" * 5000 + '"}', "at most 4096 bytes"),
        ("{not json", "not valid JSON"),
        ('{"job": [[[[[[["deep"]]]]]]]}', "nested deeper"),
    ],
)
def test_request_text_that_is_oversized_or_malformed_is_refused(text, said):
    with pytest.raises(errors.UsageError) as refused:
        HealthcheckRequest.from_text(text)
    assert said in refused.value.message


@pytest.mark.parametrize("argv, job", [(["--level", "quick", "--job", "j1"], "j1"), ([], None)])
def test_the_request_checks_as_the_command_does_with_the_same_options(argv, job):
    parser = argparse.ArgumentParser()
    add_check_arguments(parser)
    assert HealthcheckRequest(job=job).options() == request_from_args(parser.parse_args(argv)).options()


def test_a_real_child_runs_the_checks_and_its_report_is_decoded():
    # WHEN this node's quick checks run through the kind's entry point
    report = hc.collect(HealthcheckRequest(level="quick", job="no-such-job"))
    # THEN the report came back decoded: the level asked for, the checks it ran, the node's exit
    assert report.level == "quick"
    assert report.exit_code in (0, 1, 2, 3)
    names = {c.name for c in report.checks}
    assert {"disk_free", "host_memory"} <= names
    assert all(isinstance(c.status, Status) for c in report.checks)


def _child(tmp_path: Path, body: str) -> tuple[str, ...]:
    """A child process running ``body`` (``out``: the report's path; ``here``: ``tmp_path``)."""
    script = f"import os, sys, time, subprocess\nout = sys.argv[1]\nhere = {str(tmp_path)!r}\n{body}\n"
    return (sys.executable, "-c", script)


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True


def test_the_child_is_a_tool_not_a_job_no_agent_is_started_in_it(tmp_path, monkeypatch):
    # GIVEN the environment variable that starts an agent in a job's processes, and a child
    # that refuses to run the checks when it sees it
    monkeypatch.setenv("DYNPROF", "1")
    body = (
        "assert 'DYNPROF' not in os.environ, 'DYNPROF is set'\nfrom healthcheck.collect import main\nsys.exit(main())"
    )
    # WHEN the checks run
    report = hc.collect(HealthcheckRequest(), _child(tmp_path, body))
    # THEN the child did not see it, and ran them
    assert report.level == "quick" and report.checks


def test_a_child_that_hangs_is_killed_at_the_limit_with_what_it_started(tmp_path):
    # GIVEN a child that starts a process of its own and then never returns (a driver call that hangs)
    body = (
        "grandchild = subprocess.Popen(['sleep', '300'])\n"
        "open(os.path.join(here, 'pids.tmp'), 'w').write(f'{os.getpid()} {grandchild.pid}')\n"
        "os.rename(os.path.join(here, 'pids.tmp'), os.path.join(here, 'pids'))\n"
        "time.sleep(300)"
    )
    # WHEN it runs under a limit of 2 s
    with pytest.raises(errors.Timeout) as killed:
        hc.collect(HealthcheckRequest(timeout=2.0), _child(tmp_path, body))
    # THEN it is said to have been killed at the limit
    assert killed.value.message == "the healthcheck ran past 2 s and was killed"
    # AND (when it got as far as starting it) the process it started was killed with it
    pids = tmp_path / "pids"
    if pids.exists():
        child, grandchild = (int(p) for p in pids.read_text().split())
        deadline = time.monotonic() + 60
        while not (_gone(child) and _gone(grandchild)) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _gone(child) and _gone(grandchild)


@pytest.mark.parametrize(
    "body, error, said",
    [
        ("open(out, 'w').write('{not json')", errors.ArtifactError, "not valid JSON"),
        (
            "open(out, 'w').write('{\"schema\": \"other\"}')",
            errors.ArtifactError,
            "not one this version reads: schema 'other'",
        ),
        (
            "open(out, 'w').write('{\"schema\": \"dynprof.healthcheck\", \"schema_version\": 1, \"exit_code\": 9}')",
            errors.ArtifactError,
            "exit_code is 9",
        ),
        ("print('checks: all fine'); print('boom: NVML is gone', file=sys.stderr); sys.exit(1)", errors.DynprofError,
         "the healthcheck exited 1 without a report: boom: NVML is gone"),
        ("sys.exit(4)", errors.DynprofError, "exited 4 without a report: nothing on its stderr"),
    ],
)  # fmt: skip
def test_a_child_that_writes_no_report_or_a_bad_one_is_a_clear_error(tmp_path, body, error, said):
    with pytest.raises(error) as failed:
        hc.collect(HealthcheckRequest(), _child(tmp_path, body))
    assert type(failed.value) is error
    assert said in failed.value.message, failed.value.message


def test_an_oversized_report_is_refused_before_it_is_parsed(tmp_path, monkeypatch):
    monkeypatch.setattr(hc, "MAX_REPORT_BYTES", 1000)
    body = "open(out, 'w').write('[' + '0,' * 1000 + '0]')"
    with pytest.raises(errors.ArtifactError) as refused:
        hc.collect(HealthcheckRequest(), _child(tmp_path, body))
    assert "over 1000 bytes: refused" in refused.value.message


def test_the_child_refuses_a_bad_request_and_writes_no_report(tmp_path):
    # GIVEN `python -m healthcheck.collect OUT` handed a request it must refuse
    out = tmp_path / "report.json"
    for sent, said in ((b'{"level": "deep"}', "level 'deep'"), (b"{" * 5000, "at most 4096 bytes")):
        # WHEN it runs
        done = subprocess.run(
            [sys.executable, "-m", "healthcheck.collect", str(out)],
            input=sent,
            capture_output=True,
            env={**os.environ},
            timeout=120,
        )
        # THEN it exits 3 (could not run), says why, and writes nothing
        assert done.returncode == 3
        assert said in done.stderr.decode()
        assert not out.exists()


class FakeReport:
    exit_code = 2

    def to_json(self) -> dict:
        return {"schema": "dynprof.healthcheck", "verdict": "unhealthy"}


def test_no_job_has_no_pids_and_an_unknown_job_none_either():
    assert hc.job_pids(None) == frozenset()
    assert hc.job_pids("") == frozenset()
    assert hc.job_pids("no-such-job-7f3a") == frozenset()


def test_checks_here_write_the_prometheus_file_and_saves_nothing_with_no_save(monkeypatch, tmp_path):
    # GIVEN a faked run, --no-save and a Prometheus file
    monkeypatch.setattr(hc, "run", lambda options, progress: FakeReport())
    monkeypatch.setattr(hc, "render_prometheus", lambda report: "dynprof_healthcheck_exit_code 2\n")
    monkeypatch.setattr(hc, "save_artifact", lambda *a: pytest.fail("--no-save saves nothing"))
    target = tmp_path / "hc.prom"
    # WHEN checked
    checked = hc.collect_here(HealthcheckRequest(no_save=True, prometheus=str(target)))
    # THEN the file holds the metrics, and no artifact is named
    assert target.read_text() == "dynprof_healthcheck_exit_code 2\n"
    assert (checked.artifact, checked.messages, checked.report.exit_code) == (None, [], 2)


def test_an_artifact_that_cannot_be_saved_is_a_message_not_a_failure(monkeypatch):
    monkeypatch.setattr(hc, "run", lambda options, progress: FakeReport())
    monkeypatch.setattr(hc, "render_table", lambda report: "T")

    def refuse(report, text):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(hc, "save_artifact", refuse)
    checked = hc.collect_here(HealthcheckRequest())
    assert checked.artifact is None
    assert checked.messages == ["healthcheck: results not saved: [Errno 28] No space left on device"]


def test_a_task_prints_its_report_with_its_artifact_and_exits_with_the_nodes_code(monkeypatch, capsys):
    # GIVEN the checks faked, and a request handed as one JSON argument (as --srun's tasks are)
    seen = []

    def here(request, show_progress=False):
        seen.append(request)
        return hc.Checked(FakeReport(), "/store/hc-1", ["healthcheck: results not saved: x"])  # type: ignore[arg-type]

    monkeypatch.setattr(hc, "collect_here", here)
    request = HealthcheckRequest(level="standard", disk=("/scratch",), smi_tool="ppu-smi", skip=("ecc_errors",))
    argv = hc.task_command(request, "/opt/python")
    assert argv[:4] == ["/opt/python", "-m", "healthcheck.collect", "--task"] and len(argv) == 5
    # WHEN the task runs
    code = hc.main(argv[3:])
    # THEN it checked that request, printed the report as indented JSON with its artifact, and
    # said on stderr what it could not do
    out, err = capsys.readouterr()
    assert seen == [request]
    assert json.loads(out) == {"schema": "dynprof.healthcheck", "verdict": "unhealthy", "artifact": "/store/hc-1"}
    assert out.rstrip().splitlines()[-1] == "}"
    assert code == 2 and "dynprof healthcheck: results not saved: x" in err


def test_a_task_handed_a_request_it_refuses_exits_3_without_a_report(capsys):
    assert hc.main(["--task", '{"level": "deep"}']) == 3
    out, err = capsys.readouterr()
    assert out == "" and "healthcheck: error:" in err


def test_the_local_options_travel_only_on_the_node():
    # GIVEN a request with the node's own files and tools
    request = HealthcheckRequest(baseline=("/b.json",), disk=("/d",), shared_fs=(), probe_timeout=3.0)
    doc = request.to_json()
    # THEN its document carries them (those not at their defaults), the node reads them back,
    # and the sidecar's action neither takes nor is sent them
    assert doc["baseline"] == ["/b.json"] and doc["shared_fs"] == [] and "smi_tool" not in doc
    assert HealthcheckRequest.from_json(doc, local=True) == request
    with pytest.raises(errors.UsageError) as refused:
        HealthcheckRequest.from_json({"level": "quick", "disk": ["/d"]})
    assert "unknown option 'disk'" in refused.value.message
    assert not set(request.action_options()) & set(HealthcheckRequest.LOCAL_OPTIONS)
    # AND a default request's document is the one it always was
    assert set(HealthcheckRequest().to_json()) == {*HealthcheckRequest.OPTIONS, "timeout"}


def test_options_at_their_defaults_are_not_sent_to_the_sidecars():
    # GIVEN a request, one threshold changed
    request = HealthcheckRequest(fail_below=0.8, skip=("disk_free",))
    # WHEN the healthcheck action's options are made
    options = request.action_options()
    # THEN the changed one travels, the others at their defaults stay home (older sidecars know none of them)
    assert options["fail_below"] == 0.8 and options["skip"] == ["disk_free"] and options["level"] == "quick"
    assert not {"warn_below", "peer_fail", "peer_warn", "min_disk_gib", "xid_window"} & set(options)
    # AND what is unset, false or empty is left out
    assert not {"job", "expect_devices", "no_save"} & set(options)
    assert "skip" not in HealthcheckRequest().action_options()


def test_the_sidecars_action_answers_the_report_with_its_artifact_and_an_error_is_exit_3(monkeypatch):
    # GIVEN the checks faked: a report of exit 2, saved as an artifact
    monkeypatch.setattr(hc, "collect_here", lambda request: hc.Checked(FakeReport(), "/store/hc-1", ["m"]))  # type: ignore[arg-type]
    # WHEN the action's collect answers
    got = hc.action_collect(HealthcheckRequest())
    # THEN its document is the report with the artifact, its exit the node's health
    assert got.to_json() == {"schema": "dynprof.healthcheck", "verdict": "unhealthy", "artifact": "/store/hc-1"}
    assert (got.exit_code, got.messages) == (2, ["m"])

    # AND a check run that fails is "could not run", whatever its own code
    def fail(request):
        raise errors.AgentError("no devices")

    monkeypatch.setattr(hc, "collect_here", fail)
    with pytest.raises(errors.AgentError) as info:
        hc.action_collect(HealthcheckRequest())
    assert info.value.exit_code == 3


def test_the_sidecars_action_refuses_a_bad_option_as_the_healthchecks_usage_error():
    assert hc.action_request({"level": "quick"}) == HealthcheckRequest(level="quick")
    with pytest.raises(errors.UsageError) as info:
        hc.action_request({"level": "thorough"})
    assert info.value.exit_code == 3 and info.value.message.startswith("healthcheck: --level 'thorough'")
    assert info.value.help == "See `dynprof healthcheck --help`."
    assert hc.ACTION.request is HealthcheckRequest and hc.ACTION.limits["failed_exit"] == 3
