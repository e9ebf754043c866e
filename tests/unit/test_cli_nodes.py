"""`dynprof nodes`: the host file that job-level commands would reach, from --hosts, --hostfile
and --slurm (deduplicated in order), and the usage error when no source is named."""

from __future__ import annotations

import json

from collectors.stacks import rank_runs
from dynprof.cli import main


def test_hosts_and_hostfile_add_up_deduplicated_in_order(tmp_path, capsys):
    hostfile = tmp_path / "nodes.txt"
    hostfile.write_text("b:9000\nc\n")
    assert main(["nodes", "--hosts", "a:8787,b:9000", "--hostfile", str(hostfile)]) == 0
    assert capsys.readouterr().out.splitlines() == ["a:8787", "b:9000", "c:8787"]


def test_json_is_the_list_of_nodes(capsys):
    assert main(["nodes", "--hosts", "a:1,b:2", "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == {"nodes": ["a:1", "b:2"]}


def test_slurm_reads_this_allocations_node_list(monkeypatch, capsys):
    monkeypatch.setenv("SLURM_JOB_ID", "123")
    monkeypatch.setenv("SLURM_JOB_NODELIST", "gpu[01-03]")
    monkeypatch.setenv("DYNPROF_SIDECAR_PORT", "9999")
    assert main(["nodes", "--slurm"]) == 0
    assert capsys.readouterr().out.splitlines() == ["gpu01:9999", "gpu02:9999", "gpu03:9999"]


def test_no_source_is_a_usage_error(capsys):
    assert main(["nodes"]) == 2
    err = capsys.readouterr().err
    assert "name a source of nodes" in err and "dynprof nodes --help" in err


def test_discover_without_job_is_a_usage_error(capsys):
    assert main(["nodes", "--discover"]) == 2
    assert "--discover needs --job" in capsys.readouterr().err


def test_missing_ranks_are_said_asrank_runs():
    assert rank_runs([]) == ""
    assert rank_runs([3]) == "3"
    assert rank_runs([0, 1, 2, 5, 7, 8]) == "0-2,5,7-8"
