"""healthcheck.links.worker: the pieces of an exchange, the bus factor of each pattern, finding
the interface toward the rendezvous (loopback only, no packet sent), and the entry point's
answer and exit codes (the torch part, ``run``, is faked: it needs peers)."""

from __future__ import annotations

import json
import socket

import pytest

from healthcheck.links import worker
from healthcheck.links.worker import (
    LINK_SIDE_SCHEMA,
    bus_factor,
    chunks,
    interface_of,
    listen_socket,
    local_address_towards,
    pick_interface,
)


@pytest.mark.parametrize(
    ("elements", "chunk", "pieces"),
    [(10, 4, [4, 4, 2]), (8, 4, [4, 4]), (3, 4, [3]), (1, 1, [1]), (0, 4, [])],
)
def test_an_exchange_is_cut_into_pieces_of_at_most_the_chunk(elements, chunk, pieces):
    got = chunks(elements, chunk)
    assert got == pieces
    assert sum(got) == elements and all(0 < p <= chunk for p in got)


def test_sendrecv_has_bus_factor_one_and_allreduce_nccl_tests_factor():
    assert bus_factor("sendrecv", 2) == 1.0
    assert bus_factor("sendrecv", 16) == 1.0
    assert bus_factor("allreduce", 2) == 1.0
    assert bus_factor("allreduce", 4) == pytest.approx(1.5)


def test_the_loopback_address_belongs_to_the_loopback_interface():
    lo = interface_of("127.0.0.1")
    assert lo is not None and lo in {name for _, name in socket.if_nameindex()}


@pytest.mark.parametrize("address", ["not-an-address", "::1", "192.0.2.77"])
def test_an_address_that_is_not_a_local_ipv4_one_has_no_interface(address):
    # 192.0.2.0/24 is TEST-NET-1: never configured on a host
    assert interface_of(address) is None


def test_the_local_address_towards_loopback_is_loopback():
    assert local_address_towards("127.0.0.1", 9) == "127.0.0.1"


def test_pick_interface_names_the_interface_toward_the_rendezvous():
    assert pick_interface("127.0.0.1", 9) == interface_of("127.0.0.1")


def test_listen_socket_listens_on_the_given_address_only():
    sock = listen_socket("127.0.0.1", 0)
    try:
        host, port = sock.getsockname()[:2]
        assert host == "127.0.0.1" and port > 0
        # it accepts: a connection to it succeeds
        with socket.create_connection((host, port), timeout=2):
            pass
    finally:
        sock.close()


ARGS = ["--rank", "0", "--world", "2", "--store-host", "127.0.0.1", "--store-port", "29400"]


def test_the_parser_has_the_defaults_run_side_relies_on():
    args = worker.parser().parse_args(ARGS)
    assert (args.backend, args.pattern, args.iters, args.warmup, args.start_at, args.bind) == (
        "auto",
        "sendrecv",
        10,
        2,
        0.0,
        None,
    )


@pytest.mark.parametrize("extra", [["--backend", "mpi"], ["--pattern", "alltoall"], ["--rank", "x"]])
def test_the_parser_refuses_what_the_worker_cannot_do(extra, capsys):
    with pytest.raises(SystemExit):
        worker.parser().parse_args(ARGS + extra)
    assert "error:" in capsys.readouterr().err


def test_main_prints_one_json_answer_and_exits_0(monkeypatch, capsys):
    monkeypatch.setattr(worker, "die_with_parent", lambda: None)  # not on the test process
    monkeypatch.setattr(worker, "run", lambda args: {"schema": LINK_SIDE_SCHEMA, "rank": args.rank})
    assert worker.main(ARGS) == 0
    assert json.loads(capsys.readouterr().out) == {"schema": LINK_SIDE_SCHEMA, "rank": 0}


def test_main_turns_any_failure_into_one_line_on_stderr_and_exit_3(monkeypatch, capsys):
    monkeypatch.setattr(worker, "die_with_parent", lambda: None)

    def fail(args):
        raise RuntimeError("x" * 5000)

    monkeypatch.setattr(worker, "run", fail)
    assert worker.main(ARGS) == 3
    out, err = capsys.readouterr()
    assert out == ""
    assert err.startswith("link test failed: RuntimeError: ")
    assert len(err.strip()) == len("link test failed: RuntimeError: ") + 2000, "the message is bounded"
