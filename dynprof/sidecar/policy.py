"""Where a node's sidecar may reach: :class:`FanoutConfig` (what its job-wide children reach
the other nodes' sidecars with) and :class:`LinkPolicy` (where its ``link-test`` may reach,
and where it listens)."""

from __future__ import annotations

import os
import socket
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from dynprof import errors
from dynprof.identity import detect
from dynprof.job.discovery import SLURM_NODELIST_VARIABLES, expand_nodelist
from dynprof.nodes import is_loopback


@dataclass(frozen=True)
class FanoutConfig:
    """What a sidecar gives its fan-out children to reach the other nodes' sidecars: its own
    token file (the nodes of a job share one token) and, for https, the CA file to trust."""

    token_file: str
    cacert: str | None = None


def _host_key(host: str) -> str:
    return host.strip().strip("[]").rstrip(".").lower()


def _is_loopback_host(host: str) -> bool:
    return is_loopback(_host_key(host))


MIN_LINK_PORT = 1024  # a link test's rendezvous is never on a privileged port
_WILDCARDS = ("0.0.0.0", "::", "")
_LOOPBACK_NAMES = ("127.0.0.1", "::1", "localhost")  # the standard loopback addresses and name


def own_addresses(bind: str) -> frozenset[str]:
    """The addresses of this machine at which a sidecar bound to ``bind`` listens: that
    address; for a wildcard bind (every address), also the standard loopback addresses and
    ``localhost``; for 127.0.0.1 or ::1, also ``localhost``. Never any other 127.x address:
    other services of the machine listen there."""
    key = _host_key(bind)
    if key in _WILDCARDS:
        return frozenset(_LOOPBACK_NAMES)
    if key in _LOOPBACK_NAMES:
        return frozenset({key, "localhost"})
    return frozenset({key})


@dataclass(frozen=True)
class LinkPolicy:
    """Where this sidecar's ``link-test`` may reach, and where it listens.

    Rank 0's rendezvous listens on ``bind`` (the sidecar's own ``--host``) only; a peer's
    ``store_host`` must be one of the sidecar's own addresses (:func:`own_addresses`: where a
    rendezvous of this machine listens) or of ``peers`` (the Slurm allocation's nodes, this
    machine's names, ``serve --allow-peer``); a sidecar bound to loopback reaches loopback
    addresses only (nothing else can reach it). Any other address of this machine (127.0.0.9,
    say) is another service's, not a peer. Ports are unprivileged (1024-65535). A sidecar
    without a policy (``serve --no-job-wide``) runs no link test at all."""

    bind: str
    peers: frozenset[str] = frozenset()

    @classmethod
    def for_sidecar(cls, bind: str, extra: Iterable[str] = (), env: Mapping[str, str] | None = None) -> LinkPolicy:
        env = os.environ if env is None else env
        peers = {_host_key(bind), _host_key(socket.gethostname()), _host_key(detect().host)}
        peers |= {_host_key(h) for h in extra if h.strip()}
        nodelist = next((env[v] for v in SLURM_NODELIST_VARIABLES if env.get(v)), None)
        if nodelist:
            try:
                peers |= {_host_key(h) for h in expand_nodelist(nodelist)}
            except errors.DynprofError:
                pass  # a list this parser refuses allows nothing
        return cls(bind, frozenset(peers))

    @property
    def loopback_only(self) -> bool:
        return _is_loopback_host(self.bind)

    def refusal(self, store_host: Any, store_port: Any) -> str | None:
        """Why a link test toward ``store_host:store_port`` is refused (None: it may run)."""
        if isinstance(store_port, int) and not isinstance(store_port, bool) and store_port < MIN_LINK_PORT:
            return f"link-test: 'store_port' must be {MIN_LINK_PORT}-65535 (no privileged port)"
        if not isinstance(store_host, str):
            return None  # the command's parser refuses it
        key = _host_key(store_host)
        allowed = key in own_addresses(self.bind) or key in self.peers
        if self.loopback_only:
            if not _is_loopback_host(store_host) or not allowed:
                return (
                    f"link-test: this sidecar is bound to loopback ({self.bind}): 'store_host' must be its own "
                    f"loopback address or an allowed peer's (serve --allow-peer), not {store_host[:80]!r}"
                )
            return None
        if allowed:
            return None
        return (
            f"link-test: {store_host[:80]!r} is not a node this sidecar may reach (its own address, the Slurm "
            "allocation's nodes, this machine's name, dynprof serve --allow-peer)"
        )
