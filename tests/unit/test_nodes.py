"""dynprof.nodes: every name of a node parsed by one function, host files, and one node's answer."""

from __future__ import annotations

import os

import pytest

from dynprof import nodes
from dynprof.errors import UsageError
from dynprof.nodes import (
    DEFAULT_PORT,
    MAX_HOSTFILE_BYTES,
    CommandError,
    Node,
    NodeAnswer,
    is_loopback,
    parse_hosts,
    parse_node,
    read_hostfile,
    sidecar_port,
)


@pytest.mark.parametrize(
    ("text", "node"),
    [
        ("node1", Node("node1", DEFAULT_PORT)),
        ("node1:9000", Node("node1", 9000)),
        ("  node1:9000  ", Node("node1", 9000)),
        ("10.0.0.5:1", Node("10.0.0.5", 1)),
        ("[::1]", Node("::1", DEFAULT_PORT)),
        ("[::1]:65535", Node("::1", 65535)),
        ("fe80::1", Node("fe80::1", DEFAULT_PORT)),  # a bare IPv6 address: no port can follow
    ],
)
def test_parse_node_reads_host_port_and_ipv6_forms(text, node):
    assert parse_node(text) == node


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("", "empty node name"),
        ("   ", "empty node name"),
        ("node1:", "bad port"),
        ("node1:0", "bad port"),
        ("node1:65536", "bad port"),
        ("node1:http", "bad port"),
        ("node1:\u0661\u0662", "bad port"),  # digits, but not ASCII
        ("node1:123456", "bad port"),
        ("[::1", "no closing ]"),
        ("[::1]x", "bad node address"),
        ("[node1]:80", "not an IPv6 address"),
        ("a:b:c", "write an IPv6 address as"),
        ("user@node", "bad node name"),
        ("node/x", "bad node name"),
        ("http://node", "bad port"),  # one colon: read as HOST:PORT
        ("no de", "bad node name"),
        ("node\x1b", "bad node name"),
        ("a" * 254, "bad node name"),
        (":80", "bad node name"),
    ],
)
def test_parse_node_refuses_anything_else_as_a_usage_error(text, says):
    with pytest.raises(UsageError, match=says):
        parse_node(text)


def test_parse_node_refuses_what_is_not_text():
    with pytest.raises(UsageError, match="must be text"):
        parse_node(8787)  # type: ignore[arg-type]


def test_an_error_shows_a_long_hostile_name_cut_and_escaped():
    with pytest.raises(UsageError) as info:
        parse_node("\x1b[31m" + "x" * 500 + " y")
    said = str(info.value)
    assert "\x1b" not in said and len(said) < 200


def test_a_node_prints_as_its_address_with_ipv6_in_brackets():
    assert str(Node("node1", 80)) == "node1:80"
    assert Node("::1", 80).address == "[::1]:80"
    # what a node prints as reads back as the same node
    for node in (Node("node1", 80), Node("::1", 80)):
        assert parse_node(node.address) == node


def test_parse_hosts_reads_a_comma_list_skipping_blanks():
    assert parse_hosts("a, b:9000,,") == [Node("a"), Node("b", 9000)]
    assert parse_hosts("") == []


def test_sidecar_port_from_the_environment(monkeypatch):
    monkeypatch.delenv("DYNPROF_SIDECAR_PORT", raising=False)
    assert sidecar_port() == DEFAULT_PORT
    monkeypatch.setenv("DYNPROF_SIDECAR_PORT", "9100")
    assert sidecar_port() == 9100
    for bad in ("0", "70000", "x", " 80"):
        monkeypatch.setenv("DYNPROF_SIDECAR_PORT", bad)
        with pytest.raises(UsageError, match="DYNPROF_SIDECAR_PORT"):
            sidecar_port()


def test_read_hostfile_skips_comments_and_blank_lines_and_mpi_slots(tmp_path):
    # GIVEN an MPI-style host file
    path = tmp_path / "hosts"
    path.write_text("# the job's nodes\nnode1 slots=8\n\n  node2:9000  # second\n[::1]:9001\n")
    # WHEN / THEN each line is one node
    assert read_hostfile(str(path)) == [Node("node1"), Node("node2", 9000), Node("::1", 9001)]


def test_read_hostfile_refuses_a_bad_line_as_usage(tmp_path):
    path = tmp_path / "hosts"
    path.write_text("node1\nnode2:http\n")
    with pytest.raises(UsageError, match="bad port"):
        read_hostfile(str(path))


def test_read_hostfile_refuses_a_missing_file_a_directory_and_a_fifo(tmp_path):
    with pytest.raises(UsageError, match="cannot read the host file"):
        read_hostfile(str(tmp_path / "absent"))
    with pytest.raises(UsageError, match="is not a regular file"):
        read_hostfile(str(tmp_path))
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    # a FIFO with no writer must neither block nor be read
    with pytest.raises(UsageError, match="is not a regular file"):
        read_hostfile(str(fifo))


def test_read_hostfile_refuses_a_file_over_the_limit(tmp_path, monkeypatch):
    # GIVEN a limit of 64 bytes and a file just over it
    monkeypatch.setattr(nodes, "MAX_HOSTFILE_BYTES", 64)
    path = tmp_path / "hosts"
    path.write_text("n\n" * 33)
    # WHEN / THEN it is refused, not read in part
    with pytest.raises(UsageError, match="is over 64 bytes"):
        read_hostfile(str(path))
    path.write_text("n\n" * 32)
    assert len(read_hostfile(str(path))) == 32
    assert MAX_HOSTFILE_BYTES == 16 * 1024 * 1024


def test_read_hostfile_reads_bytes_that_are_not_utf8_as_a_bad_name(tmp_path):
    path = tmp_path / "hosts"
    path.write_bytes(b"node\xff1\n")
    # The replacement character is printable: the name is read (and will not resolve), no crash.
    assert read_hostfile(str(path)) == [Node("node\ufffd1")]


def test_a_node_answer_is_ok_only_when_answered_with_exit_0():
    node = Node("n")
    assert NodeAnswer(node, answered=True, exit_code=0).ok
    assert not NodeAnswer(node, answered=True, exit_code=3).ok
    assert not NodeAnswer(node, answered=False, error="refused").ok


def test_command_error_prefers_the_structured_error_then_the_last_stderr_line():
    node = Node("n")
    failure = CommandError(type="NoAgent", message="no agent here", help="attach one", exit_code=5)
    assert NodeAnswer(node, True, exit_code=5, failure=failure, messages=["a", "b"]).command_error() == "no agent here"
    assert NodeAnswer(node, True, exit_code=5, messages=["a", "b"]).command_error() == "b"
    assert NodeAnswer(node, True, exit_code=5).command_error() is None
    # no command error where the command succeeded or never ran
    assert NodeAnswer(node, True, exit_code=0, messages=["x"]).command_error() is None
    assert NodeAnswer(node, False, error="timeout").command_error() is None


def test_summary_says_why_a_node_failed():
    node = Node("n")
    refused = NodeAnswer(node, False, error="HTTP 403", elapsed_s=0.12345, status=403)
    summary = refused.summary("n:8787")
    assert summary["node"] == "n:8787" and summary["ok"] is False and summary["answered"] is False
    assert summary["error"] == "HTTP 403" and summary["elapsed_s"] == 0.123
    failed = NodeAnswer(node, True, exit_code=1, messages=["dynprof: boom"]).summary("n")
    assert failed["error"] == "dynprof: boom" and failed["exit_code"] == 1


@pytest.mark.parametrize("host", ["localhost", "127.0.0.1", "127.9.9.9", "::1"])
def test_loopback_addresses(host):
    assert is_loopback(host) is True


@pytest.mark.parametrize("host", ["0.0.0.0", "10.0.0.5", "node-1"])
def test_other_addresses_are_not_loopback(host):
    assert is_loopback(host) is False
