"""The options that send a job-level command to many nodes (dynprof/cli/_node_args.py): their
defaults, and whether a command's options name nodes, stay on this node, or mix the two."""

from __future__ import annotations

import argparse

import pytest

from dynprof import errors
from dynprof.cli._node_args import DEFAULT_MAX_IN_FLIGHT, DEFAULT_NODE_TIMEOUT_S, add_many_node_args, nodes_requested
from dynprof.job import client
from dynprof.nodes import Node


def _parse(*argv: str, fetch: bool = False) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--pid")
    parser.add_argument("--job")
    add_many_node_args(parser, fetch=fetch)
    return parser.parse_args(list(argv))


def test_defaults_are_the_clients():
    args = _parse()
    assert args.node_timeout == DEFAULT_NODE_TIMEOUT_S and args.max_in_flight == DEFAULT_MAX_IN_FLIGHT
    assert args.token_file is None and args.cacert is None
    assert not hasattr(args, "fetch")
    assert _parse(fetch=True).fetch is None
    assert (DEFAULT_NODE_TIMEOUT_S, DEFAULT_MAX_IN_FLIGHT) == (
        client.DEFAULT_NODE_TIMEOUT_S,
        client.DEFAULT_MAX_IN_FLIGHT,
    )


def test_no_node_option_stays_on_this_node():
    assert nodes_requested(_parse()) is None
    assert nodes_requested(_parse("--pid", "12")) is None


def test_hosts_name_the_nodes_in_order():
    assert nodes_requested(_parse("--hosts", "b:1,a,b:1")) == [Node("b", 1), Node("a", 8787)]


def test_a_selector_of_this_node_with_nodes_is_a_usage_error():
    with pytest.raises(errors.UsageError, match="--pid works on this node only"):
        nodes_requested(_parse("--pid", "12", "--hosts", "a"))


def test_fetch_without_nodes_is_a_usage_error(tmp_path):
    with pytest.raises(errors.UsageError, match="--fetch copies artifacts from other nodes"):
        nodes_requested(_parse("--fetch", str(tmp_path), fetch=True))


@pytest.mark.parametrize("argv", [["--max-in-flight", "0"], ["--max-in-flight", "4097"], ["--node-timeout", "-1"]])
def test_bounds_are_checked_by_the_parser(argv):
    with pytest.raises(SystemExit):
        _parse(*argv)
