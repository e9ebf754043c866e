"""``dynprof link-test``: this node's side of one link test between nodes (internal).

The job-wide healthcheck runs it on every node of a round through the sidecars' ``link-test``
action (healthcheck.links.rounds); it can be run by hand on two nodes to test their link.
"""

from __future__ import annotations

import argparse
from dataclasses import fields

from dynprof.job import links
from dynprof.job.links import LinkSide
from dynprof.result import Result
from healthcheck.links.side import BACKENDS, PATTERNS, LinkTestRequest


class LinkTestCommand:
    """Run this node's side of a link test between nodes (torch.distributed, gloo or NCCL).

    Rank 0 hosts the rendezvous (a TCPStore on --store-port of its own node, all addresses);
    the other ranks connect to --store-host:--store-port. Each side runs in a process group of
    its own, killed past --limit: a peer that never joins is answered `hung` within the limit.
    Used by the job-wide healthcheck through the sidecars (docs/links.md)."""

    def prepare_parser(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--rank", type=int, default=0, help="this side's rank (0 hosts the rendezvous)")
        parser.add_argument("--world", type=int, default=2, help="ranks in the test: 2 (a pair) or 3 (a ring)")
        parser.add_argument("--store-host", default=None, help="address of rank 0's node, as the others reach it")
        parser.add_argument("--store-port", type=int, default=29720, help="port of the rendezvous (default 29720)")
        parser.add_argument(
            "--bind",
            default=None,
            metavar="ADDR",
            help="rank 0: the rendezvous listens on ADDR only (default every address; the sidecar gives its own)",
        )
        parser.add_argument("--backend", choices=BACKENDS, default="auto", help="auto: NCCL with a GPU, else gloo")
        parser.add_argument("--pattern", choices=PATTERNS, default="sendrecv", help="exchange (default sendrecv)")
        parser.add_argument(
            "--size",
            type=int,
            default=64 * 1024 * 1024,
            help="bytes per exchange, at most 1 GiB, sent in pieces of 64 MiB (default 64 MiB)",
        )
        parser.add_argument("--iters", type=int, default=10, help="timed iterations (default 10)")
        parser.add_argument("--warmup", type=int, default=2, help="untimed iterations first (default 2)")
        parser.add_argument("--limit", type=float, default=60.0, help="hard time limit of this side, s (default 60)")
        parser.add_argument(
            "--start-at", type=float, default=0.0, help="epoch seconds: the timed iterations begin then (0: at once)"
        )
        parser.add_argument("--json", action="store_true", help="print the JSON document")

    def collect(self, args: argparse.Namespace) -> Result:
        # every field of the request is an option of this command, of the same name
        request = LinkTestRequest(**{f.name: getattr(args, f.name) for f in fields(LinkTestRequest)})
        return links.collect(request)

    def render(self, result: Result) -> str:
        assert isinstance(result, LinkSide)
        s = result.side
        if s.status == "ok":
            return (
                f"link {s.pattern} rank {s.rank}/{s.world} over {s.backend}: {s.busbw_gbps:.3f} GB/s bus bandwidth "
                f"({s.size_bytes} bytes x {s.iters} in {s.seconds:.3f} s)"
            )
        return f"link test {s.status}: {s.error}"
