"""Node lists: --hosts, --hostfile, Slurm node lists (as `scontrol show hostnames` expands them)."""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

import pytest

from dynprof import errors, nodes
from dynprof.cli import main
from dynprof.job import discovery
from dynprof.job.discovery import expand_nodelist
from dynprof.nodes import Node


@pytest.mark.parametrize(
    ("nodelist", "hosts"),
    [
        ("node1", ["node1"]),
        ("node[1-3]", ["node1", "node2", "node3"]),
        ("node[001-004,010]", ["node001", "node002", "node003", "node004", "node010"]),
        ("node[08-11]", ["node08", "node09", "node10", "node11"]),
        ("node[9-11]", ["node9", "node10", "node11"]),
        ("node[098-101]", ["node098", "node099", "node100", "node101"]),
        ("node[5]", ["node5"]),
        ("node[7,3,5]", ["node7", "node3", "node5"]),
        ("rack[1-2]-n[01-02]", ["rack1-n01", "rack1-n02", "rack2-n01", "rack2-n02"]),
        ("a1,b[2-3],c", ["a1", "b2", "b3", "c"]),
        ("gpu-[1-2].cluster,cpu[3-4]", ["gpu-1.cluster", "gpu-2.cluster", "cpu3", "cpu4"]),
        ("n1[0-2]", ["n10", "n11", "n12"]),
        ("[1-2]x", ["1x", "2x"]),
        ("node1 node[2-3]", ["node1", "node2", "node3"]),
        ("  node1,,node2, ", ["node1", "node2"]),
        ("node[1-2],node[1-2]", ["node1", "node2", "node1", "node2"]),  # as scontrol: no deduplication
        ("x[0-0]", ["x0"]),
    ],
)
def test_expand_nodelist(nodelist: str, hosts: list[str]) -> None:
    assert expand_nodelist(nodelist) == hosts


@pytest.mark.parametrize(
    ("nodelist", "why"),
    [
        ("node[1-", "not closed"),
        ("node1-3]", "without ["),
        ("node[[1-2]]", "nested"),
        ("node[]", "empty []"),
        ("node[ ]", "empty []"),
        ("node[3-1]", "backwards"),
        ("node[a-c]", "bad range"),
        ("node[1-2-3]", "bad range"),
        ("node[-2]", "bad range"),
        ("node[1,,2]", "bad range"),
        ("node[1:4]", "bad range"),
        ("node[\u0661-\u0663]", "bad range"),  # Arabic-Indic digits pass str.isdigit
        ("node[0-99999999999999999999]", "digits"),
        ("node[0-1000000]", "more than"),
        ("a[0-999]b[0-999]", "more than"),
        ("n[0-60000],m[0-60000]", "more than"),
        ("", "empty"),
        (" , ", "empty"),
        ("host/x", "bad node name"),
        ("h@[1-2]", "bad node name"),
        ("x" * (discovery.MAX_NODELIST_CHARS + 1), "at most"),
    ],
)
def test_malformed_nodelists_are_usage_errors(nodelist: str, why: str) -> None:
    with pytest.raises(errors.UsageError) as info:
        expand_nodelist(nodelist)
    assert why in info.value.message


def test_hostile_nodelists_are_refused_quickly() -> None:
    # GIVEN lists built to explode: many bracket groups, huge ranges, deep commas
    hostile = ["[0-9]" * 40, "a[0-65536]", "x[" + ",".join(["1"] * 200_000) + "]", "[" * 100_000]
    for text in hostile:
        t0 = time.monotonic()
        # WHEN expanded THEN refused, without building the explosion first (10**40 names would
        # never end: half a minute is a hang, not a slow machine; the longest takes 0.2 s here)
        with pytest.raises(errors.UsageError):
            expand_nodelist(text)
        assert time.monotonic() - t0 < 30, text[:40]


def _args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--job")
    discovery.add_node_args(parser)
    return parser.parse_args(argv)


def test_resolve_nodes_adds_up_sources_in_order(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # GIVEN hosts, a host file and a Slurm allocation, overlapping
    hostfile = tmp_path / "hosts"
    hostfile.write_text("# nodes\nb:9000 slots=8\nc\n")
    monkeypatch.setenv("SLURM_JOB_NODELIST", "c,d[1-2]")
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    monkeypatch.setenv("DYNPROF_SIDECAR_PORT", "8800")
    # WHEN resolved
    nodes = discovery.resolve_nodes(_args(["--hosts", "a,b:9000", "--hostfile", str(hostfile), "--slurm"]))
    # THEN each node once, in the order given; Slurm's names on the sidecar port
    assert nodes == [Node("a"), Node("b", 9000), Node("c"), Node("c", 8800), Node("d1", 8800), Node("d2", 8800)]
    assert discovery.resolve_nodes(_args([])) is None


def test_slurm_job_of_the_environment_or_scontrol(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[list[str]] = []

    def fake_tool(cmd: list[str]) -> str:
        calls.append(cmd)
        return "JobId=12 JobName=train UserId=u(1) NodeList=gpu[07-08] BatchHost=gpu07\n"

    monkeypatch.setattr(discovery, "_run_slurm_tool", fake_tool)
    env = {"SLURM_JOB_ID": "11", "SLURM_JOB_NODELIST": "cpu[1-2]"}
    # the allocation's own list, for its job or when no job is named
    assert discovery.slurm_hosts(None, env) == ["cpu1", "cpu2"]
    assert discovery.slurm_hosts("11", env) == ["cpu1", "cpu2"]
    assert not calls
    # another job: scontrol show job names its nodes
    assert discovery.slurm_hosts("12", env) == ["gpu07", "gpu08"]
    assert calls == [["scontrol", "show", "job", "--oneliner", "12"]]
    with pytest.raises(errors.UsageError, match="not a Slurm job id"):
        discovery.slurm_hosts("12; rm -rf /", {})
    with pytest.raises(errors.UsageError, match="no Slurm job here"):
        discovery.slurm_hosts(None, {})


def test_slurm_job_that_is_not_running(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(discovery, "_run_slurm_tool", lambda cmd: "JobId=9 JobState=PENDING NodeList=(null)\n")
    with pytest.raises(errors.UsageError, match="has no nodes"):
        discovery.slurm_hosts("9", {})


def test_without_scontrol(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", "/nonexistent")
    with pytest.raises(errors.UsageError, match="scontrol is not installed") as info:
        discovery.slurm_hosts("5", {})
    assert "--hostfile" in info.value.help


def test_nodes_command(capsys: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SLURM_JOB_NODELIST", "node[001-002]")
    assert main(["nodes", "--slurm"]) == 0
    assert capsys.readouterr().out.split() == ["node001:8787", "node002:8787"]
    assert main(["nodes", "--hosts", "a:1,[::1]:2", "--json"]) == 0
    assert '"nodes": [\n    "a:1",\n    "[::1]:2"\n  ]' in capsys.readouterr().out
    monkeypatch.setenv("SLURM_JOB_NODELIST", "node[001-")
    assert main(["nodes", "--slurm"]) == 2
    assert "a [ is not closed" in capsys.readouterr().err
    assert main(["nodes"]) == 2
    assert main(["nodes", "--discover"]) == 2
    assert "--discover needs --job" in capsys.readouterr().err


def test_parse_registrations_is_defensive() -> None:
    from dynprof.agent._ext_job_store import parse_registrations

    # GIVEN the ranks key with good lines and garbage (anyone who reaches the store can write it)
    data = b"\n".join(
        [
            b'{"rank":1,"host":"n1","sidecar":"n1:8787","pid":5,"local_rank":1,"registered_at":1.0}',
            b"not json",
            b"[1,2]",
            b'{"rank":-3,"host":"x","sidecar":"x:1","registered_at":1}',
            b'{"rank":true,"host":"x","sidecar":"x:1","registered_at":1}',
            b'{"rank":0,"host":"n0","sidecar":"n0:8787","registered_at":1}',
            b'{"rank":1,"host":"n9","sidecar":"n9:8787","pid":6,"registered_at":2.0}',
            b'{"rank":1,"host":"n1","sidecar":"n1:8787","pid":7,"local_rank":1,"registered_at":3.0}',
            b'{"rank":2,"host":"' + b"h" * 10_000 + b'","sidecar":"s:1","registered_at":1}',
            b'{"rank":3,"host":"' + b"h" * 1_000 + b'","sidecar":"s:1","registered_at":1}',
        ]
    )
    # WHEN it is parsed
    regs = parse_registrations(data)
    # THEN each rank keeps every sidecar it was registered with, in the key's order (a line
    # added later cannot replace a rank's own), the latest registration of each
    assert [(r.rank, r.host, r.sidecar, r.local_rank, r.pid) for r in regs[:3]] == [
        (0, "n0", "n0:8787", -1, 0),
        (1, "n1", "n1:8787", 1, 7),
        (1, "n9", "n9:8787", -1, 6),
    ]
    # and a line over 4 KiB is skipped, a long field cut
    assert [r.rank for r in regs] == [0, 1, 1, 3] and len(regs[3].host) == 512


def test_slurm_uses_the_allocation_when_job_is_not_a_slurm_id(monkeypatch: pytest.MonkeyPatch) -> None:
    # GIVEN an allocation, and a dynprof job id that is a torchrun run id
    monkeypatch.setenv("SLURM_JOB_NODELIST", "gpu[1-2]")
    monkeypatch.setenv("SLURM_JOB_ID", "500")
    # THEN --slurm means the allocation's nodes
    assert discovery.resolve_nodes(_args(["--job", "my-run", "--slurm"])) == [Node("gpu1"), Node("gpu2")]
    # and a numeric --job of another Slurm job asks scontrol
    monkeypatch.setattr(discovery, "_run_slurm_tool", lambda cmd: "JobId=501 NodeList=cpu7\n")
    assert discovery.resolve_nodes(_args(["--job", "501", "--slurm"])) == [Node("cpu7")]


def test_hostfile_that_is_not_a_regular_file(tmp_path: Path) -> None:
    import os

    fifo = tmp_path / "hosts"
    os.mkfifo(fifo)
    with pytest.raises(errors.UsageError, match="not a regular file"):
        nodes.read_hostfile(str(fifo))  # refused at once, not waited on
    with pytest.raises(errors.UsageError, match="not a regular file"):
        nodes.read_hostfile(str(tmp_path))
    with pytest.raises(errors.UsageError, match="cannot read the host file"):
        nodes.read_hostfile(str(tmp_path / "missing"))


def test_scontrol_show_hostnames_for_lists_this_parser_refuses(monkeypatch: pytest.MonkeyPatch) -> None:
    # GIVEN scontrol installed, and a list this parser refuses
    monkeypatch.setattr(discovery.shutil, "which", lambda name: "/usr/bin/scontrol")
    calls: list[list[str]] = []

    def tool(cmd: list[str]) -> str:
        calls.append(cmd)
        return "odd1\nodd2\n"

    monkeypatch.setattr(discovery, "_run_slurm_tool", tool)
    # THEN scontrol show hostnames is asked, and what it prints is checked as names
    assert discovery.slurm_hosts(None, {"SLURM_JOB_NODELIST": "odd[1-2:1]"}) == ["odd1", "odd2"]
    assert calls == [["scontrol", "show", "hostnames", "odd[1-2:1]"]]
    monkeypatch.setattr(discovery, "_run_slurm_tool", lambda cmd: "ok\nb\x1bd/x\n")
    with pytest.raises(errors.UsageError, match="bad node name"):
        discovery.slurm_hosts(None, {"SLURM_JOB_NODELIST": "x[1-"})
    # and a job id that only looks numeric in Unicode is refused
    with pytest.raises(errors.UsageError, match="not a Slurm job id"):
        discovery.slurm_hosts("\u0661\u0662", {})


def test_one_node_selectors_with_discovered_nodes_are_refused(monkeypatch: pytest.MonkeyPatch, capsys: Any) -> None:
    # --pid means a process of this node: with nodes from Slurm it is a usage error, not ignored
    monkeypatch.setenv("SLURM_JOB_NODELIST", "n[1-2]")
    assert main(["stacks", "--pid", "1", "--slurm"]) == 2
    assert "--pid works on this node only" in capsys.readouterr().err


# -- node names and the store's registrations are untrusted -------------------------------------
@pytest.mark.parametrize(
    "text",
    [
        "127.0.0.1\x01:80",  # a control character: http.client refuses it later, with a traceback
        "node\x7f",
        "no\x1b[2Jde",
        "127.0.0.1:²",  # str.isdigit() is true for these, int() is not
        "127.0.0.1:\uff18\uff10",  # fullwidth digits: int() reads 80
        "127.0.0.1:\u0668\u0660",  # Arabic-Indic digits: int() reads 80
        "127.0.0.1:",
        "[evil.example]:80",  # brackets hold an IPv6 address only
        "a:b:c",
    ],
)
def test_odd_node_names_and_ports_are_usage_errors(text: str, tmp_path: Path) -> None:
    # WHEN such a name is given in --hosts, a host file, or an action's hosts (all parse_node)
    with pytest.raises(errors.UsageError):
        nodes.parse_node(text)
    hostfile = tmp_path / "hosts"
    hostfile.write_text(text + "\n")
    # THEN it is a usage error wherever it comes from, never a traceback
    with pytest.raises(errors.UsageError):
        nodes.read_hostfile(str(hostfile))


def test_ipv6_and_plain_names_still_parse() -> None:
    assert nodes.parse_node("[::1]:9000") == Node("::1", 9000)
    assert nodes.parse_node("::1") == Node("::1", 8787)
    assert nodes.parse_node("node-1.cluster:81") == Node("node-1.cluster", 81)


def _job_nodes(world: int, regs: list[tuple[int, str]]) -> Any:
    from dynprof.proto import pb

    ranks = [pb.RankRegistration(rank=r, local_rank=-1, host="h", sidecar=s, pid=1) for r, s in regs]
    return pb.JobNodes(ranks=ranks, world_size=world, store="TCPStore 127.0.0.1:1")


def test_registrations_are_used_only_for_allowed_nodes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SLURM_JOB_NODELIST", raising=False)
    monkeypatch.delenv("SLURM_NODELIST", raising=False)
    monkeypatch.delenv("DYNPROF_SIDECAR_PORT", raising=False)
    # GIVEN a store where rank 0 registered its node, and someone added lines naming other places
    found = _job_nodes(
        2,
        [
            (0, "node-0:8787"),
            (0, "169.254.169.254:80"),
            (0, "evil.example:8787"),
            (1, "127.0.0.1:8787"),
            (1, "127.0.0.1:9999"),  # loopback, but not the sidecar port: another user may listen there
            (5, "node-0:8787"),  # a rank past the world size
            (1, "[2001:db8::1]:8787"),
        ],
    )
    # WHEN the operator allows node-0 (as --hosts, --allow-hosts or Slurm would)
    allowed = discovery.allowed_nodes([], "node-0")
    got = discovery._discovery_from("j", 1, found, allowed)
    # THEN only node-0 and loopback at the sidecar port are used; the rest are refused, with why
    assert got.nodes == [Node("node-0"), Node("127.0.0.1")]
    assert [(r["rank"], r["sidecar"]) for r in got.ranks] == [(0, "node-0:8787"), (1, "127.0.0.1:8787")]
    assert got.refused_count == 5 and got.missing_ranks == []
    assert {r["sidecar"] for r in got.refused} == {
        "169.254.169.254:80",
        "evil.example:8787",
        "127.0.0.1:9999",
        "node-0:8787",
        "[2001:db8::1]:8787",
    }
    # and with --cacert (every sidecar verified by TLS before the token goes) all in-range ones are used
    got = discovery._discovery_from("j", 1, found, allowed, tls=True)
    assert len(got.nodes) == 6 and got.refused_count == 1


def test_a_forged_line_cannot_replace_or_hide_a_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SLURM_JOB_NODELIST", raising=False)
    monkeypatch.delenv("SLURM_NODELIST", raising=False)
    from dynprof.agent._ext_job_store import parse_registrations

    # GIVEN rank 0's own line, then a later one naming another sidecar for rank 0
    data = (
        b'{"rank":0,"host":"n0","sidecar":"node-0:8787","registered_at":1}\n'
        b'{"rank":0,"host":"n0","sidecar":"127.0.0.1:9999","registered_at":9e9}\n'
    )
    # WHEN the agent reads the key and the CLI decides
    found = _job_nodes(1, [(r.rank, r.sidecar) for r in parse_registrations(data, 1)])
    got = discovery._discovery_from("j", 1, found, discovery.allowed_nodes([Node("node-0")], None))
    # THEN rank 0 is still on its own node, and the forged address is not used
    assert got.nodes == [Node("node-0")] and got.missing_ranks == []


def test_allowed_names_compare_without_dns(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SLURM_JOB_NODELIST", "gpu[1-2]")
    monkeypatch.setenv("DYNPROF_SIDECAR_PORT", "9000")
    allowed = discovery.allowed_nodes([Node("a", 81)], "B.example.,c:82,[::1]:83")
    assert allowed.allows(Node("a", 81)) and not allowed.allows(Node("a", 9000))
    assert allowed.allows(Node("b.example", 9000)) and allowed.allows(Node("c", 82))
    assert allowed.allows(Node("0:0:0:0:0:0:0:1", 83))
    assert allowed.allows(Node("gpu2", 9000)) and not allowed.allows(Node("gpu3", 9000))
    assert allowed.allows(Node("localhost", 9000)) and not allowed.allows(Node("localhost", 8787))


def test_allow_hosts_needs_discover() -> None:
    with pytest.raises(errors.UsageError, match="--allow-hosts"):
        discovery.resolve_nodes(_args(["--hosts", "a", "--allow-hosts", "b"]))
