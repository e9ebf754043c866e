"""Serve a web page and an HTTP API over this node's agents and artifacts.

Binds to 127.0.0.1 by default. On any other address a token is required on every request
(given with --token, or generated and printed at start): send it as `Authorization: Bearer
TOKEN` or `?token=TOKEN`. Read-only: nothing on the page changes a job.
"""

from __future__ import annotations

import argparse
import ipaddress
import secrets
import sys

from dynprof import errors
from dynprof.cli._common import host_arg, port


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class ServeCommand:
    """Serve a web page and an HTTP API over this node's agents and artifacts."""

    def prepare_parser(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--host", type=host_arg, default="127.0.0.1", help="address to bind (default 127.0.0.1)")
        parser.add_argument("--port", type=port, default=8787, help="port, 1-65535 (default 8787)")
        parser.add_argument("--token", help="access token (required, or generated, off loopback)")

    def run(self, args: argparse.Namespace) -> int:
        try:
            from dynprof.sidecar import create_app
        except ImportError as exc:
            raise errors.Unsupported(f"the web app needs flask: {exc}", help="pip install flask") from None
        token = args.token
        if token is None and not _is_loopback(args.host):
            token = secrets.token_urlsafe(24)
        app = create_app(token=token)
        url = f"http://{args.host}:{args.port}/" + (f"?token={token}" if token else "")
        print(f"dynprof: serving on {url}", file=sys.stderr)
        try:
            app.run(host=args.host, port=args.port, debug=False, use_reloader=False)
        except OSError as exc:
            raise errors.DynprofError(
                f"cannot listen on {args.host}:{args.port}: {exc}", help="Choose another --port."
            ) from None
        return 0
