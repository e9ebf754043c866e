"""Serve a web page and an HTTP API over this node's agents and artifacts.

Binds to 127.0.0.1 by default. Every request, on every address (loopback too: any local user
can reach loopback), must carry the access token: `Authorization: Bearer TOKEN`, `?token=TOKEN`,
or the cookie the page sets after a `?token=` visit. The token comes from --token-file FILE
(or DYNPROF_TOKEN_FILE; the file must not be readable by group or others), from --token
(visible to other users in the process list: prefer a file), or is generated; the URL printed
at start carries it. Read-only: nothing on the page changes a job.
"""

from __future__ import annotations

import argparse
import ipaddress
import os
import secrets
import stat
import sys

from dynprof import errors
from dynprof.cli._common import host_arg, path_arg, port

MIN_TOKEN_CHARS = 16
MAX_TOKEN_FILE_BYTES = 4096


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def read_token_file(path: str) -> str:
    """The token in ``path``: the file must be a regular file owned by us (or root), not
    readable or writable by group or others, and hold one token of 16+ characters."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError as exc:
        raise errors.UsageError(f"cannot open the token file {path}: {exc.strerror}") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):  # before fdopen, which refuses a directory itself
        os.close(fd)
        raise errors.UsageError(f"the token file {path} is not a regular file")
    with os.fdopen(fd, "rb") as fh:
        st = os.fstat(fh.fileno())
        if st.st_uid not in (os.getuid(), 0):
            raise errors.PermissionDenied(
                f"the token file {path} belongs to uid {st.st_uid}, not to you ({os.getuid()})",
                help="Use a token file you own, with mode 0600.",
            )
        if st.st_mode & 0o077:
            raise errors.PermissionDenied(
                f"the token file {path} is open to other users (mode {stat.S_IMODE(st.st_mode):04o})",
                help=f"chmod 600 {path}",
            )
        data = fh.read(MAX_TOKEN_FILE_BYTES + 1)
    if len(data) > MAX_TOKEN_FILE_BYTES:
        raise errors.UsageError(f"the token file {path} is over {MAX_TOKEN_FILE_BYTES} bytes: not a token")
    return _check_token(data.decode("utf-8", "replace").strip(), f"the token in {path}")


def _check_token(token: str, what: str) -> str:
    if len(token) < MIN_TOKEN_CHARS or any(c.isspace() or not c.isprintable() for c in token):
        raise errors.UsageError(
            f"{what} must be at least {MIN_TOKEN_CHARS} printable characters without spaces",
            help="Generate one: python -c 'import secrets; print(secrets.token_urlsafe(24))'",
        )
    return token


def resolve_token(token: str | None, token_file: str | None) -> tuple[str, str]:
    """(token, where it came from): --token, --token-file, DYNPROF_TOKEN_FILE, or generated."""
    if token is not None and token_file is not None:
        raise errors.UsageError("give --token or --token-file, not both")
    if token is not None:
        return _check_token(token, "--token"), "--token"
    path = token_file or os.environ.get("DYNPROF_TOKEN_FILE") or None
    if path:
        return read_token_file(path), path
    return secrets.token_urlsafe(24), "generated"


def _url(host: str, port: int, token: str) -> str:
    shown = f"[{host}]" if ":" in host and not host.startswith("[") else host
    return f"http://{shown}:{port}/?token={token}"


REQUEST_TIMEOUT_S = 30.0


def _request_handler() -> type:
    """Werkzeug's handler with a socket timeout, so an idle or dripping client cannot hold a
    server thread forever."""
    from werkzeug.serving import WSGIRequestHandler

    class Handler(WSGIRequestHandler):
        timeout = REQUEST_TIMEOUT_S

    return Handler


class ServeCommand:
    """Serve a web page and an HTTP API over this node's agents and artifacts (token required)."""

    def prepare_parser(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--host", type=host_arg, default="127.0.0.1", help="address to bind (default 127.0.0.1)")
        parser.add_argument("--port", type=port, default=8787, help="port, 1-65535 (default 8787)")
        parser.add_argument(
            "--token",
            help="access token (16+ characters; visible in the process list, so prefer --token-file)",
        )
        parser.add_argument(
            "--token-file",
            type=path_arg,
            metavar="FILE",
            help="read the access token from FILE (mode 0600); default $DYNPROF_TOKEN_FILE, else one is generated",
        )

    def run(self, args: argparse.Namespace) -> int:
        try:
            from dynprof.sidecar import create_app
        except ImportError as exc:
            raise errors.Unsupported(f"the web app needs flask: {exc}", help="pip install flask") from None
        token, source = resolve_token(args.token, args.token_file)
        app = create_app(token=token, host=args.host)
        print(f"dynprof: serving on {_url(args.host, args.port, token)}", file=sys.stderr)
        if source != "generated":
            print(f"dynprof: token from {source}", file=sys.stderr)
        sys.stderr.flush()
        try:
            app.run(host=args.host, port=args.port, debug=False, use_reloader=False, request_handler=_request_handler())
        except OSError as exc:
            raise errors.DynprofError(
                f"cannot listen on {args.host}:{args.port}: {exc}", help="Choose another --port."
            ) from None
        return 0
