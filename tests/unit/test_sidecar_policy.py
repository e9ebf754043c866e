"""dynprof.sidecar.policy: where a sidecar's link test may reach (its own addresses, the Slurm
allocation's nodes, the allowed peers; loopback only when bound to loopback), and where it listens."""

from __future__ import annotations

import pytest

from dynprof.sidecar import actions
from dynprof.sidecar.policy import LinkPolicy, own_addresses

LINK = {"rank": 1, "world": 2, "store_host": "10.9.9.9", "store_port": 29720}


def test_own_addresses_are_the_bound_one_and_for_a_wildcard_the_loopback_ones():
    assert own_addresses("0.0.0.0") == {"127.0.0.1", "::1", "localhost"}
    assert own_addresses("127.0.0.1") == {"127.0.0.1", "localhost"}
    assert own_addresses("10.1.2.3") == {"10.1.2.3"}


def test_a_sidecar_bound_to_loopback_links_only_over_loopback_and_listens_there():
    policy = LinkPolicy.for_sidecar("127.0.0.1", env={})
    # GIVEN a sidecar bound to loopback: a peer elsewhere is refused
    for host in ("10.9.9.9", "node-7", "0.0.0.0"):
        with pytest.raises(actions.ActionError, match="bound to loopback"):
            actions.check_options("link-test", {**LINK, "store_host": host}, links=policy)
    # THEN a loopback peer runs, and rank 0's rendezvous listens on the sidecar's address only
    checked = actions.check_options("link-test", {**LINK, "rank": 0, "store_host": "127.0.0.1"}, links=policy)
    assert checked.options["bind"] == "127.0.0.1"
    # AND the caller cannot name where it listens
    with pytest.raises(actions.ActionError, match="unknown option 'bind'"):
        actions.check_options("link-test", {**LINK, "store_host": "127.0.0.1", "bind": "0.0.0.0"}, links=policy)


def test_link_test_peers_are_the_allowed_nodes_and_ports_are_unprivileged():
    # GIVEN a sidecar on every address of a node of a Slurm allocation, one more peer allowed
    env = {"SLURM_JOB_NODELIST": "gpu[01-03]"}
    policy = LinkPolicy.for_sidecar("0.0.0.0", ["spare-9"], env=env)
    # THEN the allocation's nodes, the extra peer and this machine are reachable
    for host in ("gpu02", "GPU03.", "spare-9", "127.0.0.1"):
        assert (
            actions.check_options("link-test", {**LINK, "store_host": host}, links=policy).options["bind"] == "0.0.0.0"
        )
    # AND any other host is refused (another loopback address is another service of this
    # machine, not this sidecar), as is a privileged port
    for host in ("10.9.9.9", "gpu04", "evil.example.com", "127.0.0.9", "127.1.2.3"):
        with pytest.raises(actions.ActionError, match="not a node this sidecar may reach"):
            actions.check_options("link-test", {**LINK, "store_host": host}, links=policy)
    for port in (81, 1023, 0):
        with pytest.raises(actions.ActionError, match="no privileged port"):
            actions.check_options("link-test", {**LINK, "store_host": "gpu01", "store_port": port}, links=policy)


def test_a_loopback_sidecars_peers_are_its_own_address_and_the_allowed_ones():
    # GIVEN sidecars bound to 127.0.0.1 and to 127.0.0.5, one with 127.0.0.7 allowed as a peer
    standard = LinkPolicy.for_sidecar("127.0.0.1", env={})
    other = LinkPolicy.for_sidecar("127.0.0.5", ["127.0.0.7"], env={})
    # THEN each reaches its own address (localhost names 127.0.0.1) and the allowed peer
    for policy, host in ((standard, "127.0.0.1"), (standard, "localhost"), (other, "127.0.0.5"), (other, "127.0.0.7")):
        assert policy.refusal(host, 29720) is None, (policy, host)
    # AND no other loopback address: another service of this machine listens there
    for policy, host in ((standard, "127.0.0.9"), (standard, "127.0.0.2"), (other, "127.0.0.1"), (other, "localhost")):
        why = policy.refusal(host, 29720)
        assert why is not None and "bound to loopback" in why and host in why, (policy, host)
