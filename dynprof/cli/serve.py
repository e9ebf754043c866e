"""Serve a web page and an HTTP API over this node's agents, tools and artifacts (the sidecar).

Binds to 127.0.0.1 by default, on cheroot's threaded WSGI server (dynprof.sidecar.server):
--threads workers, request bodies and headers bounded, whole-request deadlines that cut off
slow clients as surely as idle ones, connections held below the open-file limit (raised to
--max-open-files at start) and the rest shed, /healthz answered before the worker pool, TLS with
--certfile/--keyfile, a clean stop on SIGINT or SIGTERM. It warns about --token (other users
see it in the process list) and about plain HTTP on every address (the token in clear). Every request, on every address (loopback too: any local
user can reach loopback), must carry the access token: `Authorization: Bearer TOKEN`,
`?token=TOKEN`, or the cookie the page sets after a `?token=` visit; only `GET /healthz`
answers without it (with "ok" and nothing else). The token comes from --token-file FILE (or
DYNPROF_TOKEN_FILE; the file must not be readable by group or others), from --token (visible
to other users in the process list: prefer a file), or is generated; the URL printed at start
carries it. Actions (traces, stacks, snapshots, ...) run at most --max-actions at once;
--read-only refuses those that act on jobs. docs/api.md is the reference of the HTTP API.
"""

from __future__ import annotations

import argparse
import contextlib
import ipaddress
import os
import secrets
import select
import signal
import sys
import threading
from typing import Any

from dynprof import errors
from dynprof.agents import agent_rows
from dynprof.arguments import nonnegative_float
from dynprof.cli._common import host_arg, path_arg, port
from dynprof.cli._watching import add_serve_watch_args, check_hosted_watch, start_hosted_watch
from dynprof.identity import detect
from dynprof.paths import run_dir
from dynprof.renderers import render, render_html
from dynprof.sidecar.policy import FanoutConfig, LinkPolicy
from dynprof.tokens import check_token, read_token_file


def resolve_token(token: str | None, token_file: str | None) -> tuple[str, str]:
    """(token, where it came from): --token, --token-file, DYNPROF_TOKEN_FILE, or generated."""
    if token is not None and token_file is not None:
        raise errors.UsageError("give --token or --token-file, not both")
    if token is not None:
        return check_token(token, "--token"), "--token"
    path = token_file or os.environ.get("DYNPROF_TOKEN_FILE") or None
    if path:
        return read_token_file(path), path
    return secrets.token_urlsafe(24), "generated"


def risk_warnings(host: str, tls: bool, token_in_argv: bool) -> list[str]:
    """What `serve` says about a risky command line (it serves all the same)."""
    out = []
    if token_in_argv:
        out.append(
            "--token is visible to every user of this machine in the process list (ps); "
            "use --token-file FILE (mode 0600) instead"
        )
    if not tls and _is_unspecified(host):
        out.append(
            f"serving plain HTTP on every address ({host}): the token crosses the network in clear; "
            "use --certfile/--keyfile, or bind to loopback or a private management network"
        )
    return out


def _is_unspecified(host: str) -> bool:
    try:
        return ipaddress.ip_address(host.strip("[]")).is_unspecified
    except ValueError:
        return False


def _url(host: str, port: int, token: str, tls: bool = False) -> str:
    shown = f"[{host}]" if ":" in host and not host.startswith("[") else host
    return f"{'https' if tls else 'http'}://{shown}:{port}/?token={token}"


REQUEST_TIMEOUT_S = 30.0  # an idle connection is closed after this (and a send that makes no progress)
HEAD_TIMEOUT_S = 10.0  # a request's line and headers must all arrive within this
BODY_TIMEOUT_S = 10.0  # then its body (at most 64 KiB)
MAX_HEADER_BYTES = 64 * 1024
SHUTDOWN_TIMEOUT_S = 5.0
MAX_THREADS = 256
MAX_ACTIONS = 64
MIN_PROGRESS_EVERY_S = 0.2
WANTED_OPEN_FILES = 4096


def _count(lo: int, hi: int) -> Any:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
        if not lo <= value <= hi:
            raise argparse.ArgumentTypeError(f"{value} is not in {lo}-{hi}")
        return value

    return parse


def build_server(app: Any, host: str, port: int, threads: int, certfile: str | None, keyfile: str | None) -> Any:
    """cheroot's WSGI server for ``app``, bound but not yet serving; TLS when given a cert. It
    holds at most :func:`~dynprof.sidecar.server.connection_cap` connections (the open-file
    limit of this process less what ``threads`` workers need)."""
    from dynprof.sidecar.app import MAX_REQUEST_BYTES
    from dynprof.sidecar.server import Reserve, SidecarServer, connection_cap, healthz_answer

    server = SidecarServer(
        (host, port),
        Reserve(app, max(1, threads - 1)),  # one thread always free of long requests
        numthreads=threads,
        max=threads,
        request_queue_size=64,
        timeout=int(REQUEST_TIMEOUT_S),
        shutdown_timeout=int(SHUTDOWN_TIMEOUT_S),
        server_name="dynprof",
        head_timeout=HEAD_TIMEOUT_S,
        body_timeout=BODY_TIMEOUT_S,
        healthz=healthz_answer(app),
        max_connections=connection_cap(threads),
    )
    server.max_request_body_size = MAX_REQUEST_BYTES
    server.max_request_header_size = MAX_HEADER_BYTES
    if certfile:
        from dynprof.sidecar.server import LazyHandshakeSSLAdapter

        try:
            server.ssl_adapter = LazyHandshakeSSLAdapter(certfile, keyfile)
        except (OSError, ValueError) as exc:  # ssl.SSLError is an OSError
            raise errors.UsageError(
                f"cannot use the certificate {certfile} with the key {keyfile}: {exc}",
                help="Give a PEM certificate and its private key (readable by this user).",
            ) from None
    return server


class ServeCommand:
    """Serve a web page and an HTTP API that act on this node's agents (token required).

    The node's sidecar: it lists the agents, runs the CLI's own commands on them (start, stop,
    stacks, memory, nccl, ps, ls, healthcheck) and answers with their --json, and serves the
    artifacts. It reads every rank's progress every --progress-every seconds, for GET
    /api/progress and for Prometheus at GET /metrics (docs/metrics.md). Every request needs the
    token (Authorization: Bearer, or the URL printed at start); GET /healthz alone answers
    without it, with "ok". Reference: docs/api.md.
    """

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
        parser.add_argument(
            "--threads", type=_count(1, MAX_THREADS), default=8, help="worker threads of the HTTP server (default 8)"
        )
        parser.add_argument(
            "--max-open-files",
            type=_count(1, 1 << 20),
            default=WANTED_OPEN_FILES,
            metavar="N",
            help=f"raise this process's soft open-file limit to N at start, within the hard limit "
            f"(default {WANTED_OPEN_FILES}); connections are held up to that limit less what the threads need",
        )
        parser.add_argument(
            "--max-actions",
            type=_count(1, MAX_ACTIONS),
            default=4,
            help="actions running at once; more are refused with 429 (default 4)",
        )
        parser.add_argument(
            "--read-only",
            action="store_true",
            help="refuse the actions that act on jobs (start, stop, memory, nccl, healthcheck): 403",
        )
        parser.add_argument(
            "--allow-host",
            action="append",
            type=host_arg,
            default=[],
            metavar="NAME",
            help="another name of this node that clients may use (a DNS alias; the Host header check); repeatable",
        )
        parser.add_argument(
            "--no-job-wide",
            action="store_true",
            help="refuse 'hosts' in actions and the link-test action: this sidecar never connects to other nodes",
        )
        parser.add_argument(
            "--allow-peer",
            action="append",
            type=host_arg,
            default=[],
            metavar="NAME",
            help="a node that this sidecar's link tests may reach, besides its own address, this Slurm allocation's "
            "nodes and this machine's names (a sidecar bound to loopback reaches loopback addresses only, no other "
            "127.x address than its own unless allowed here); repeatable",
        )
        parser.add_argument(
            "--cacert",
            type=path_arg,
            metavar="PEM",
            help="for job-wide actions (their 'hosts'), reach the other nodes' sidecars over https trusting this CA",
        )
        parser.add_argument("--certfile", type=path_arg, metavar="PEM", help="serve HTTPS with this certificate")
        parser.add_argument("--keyfile", type=path_arg, metavar="PEM", help="the certificate's private key")
        parser.add_argument(
            "--progress-every",
            type=nonnegative_float(3600.0),
            default=2.0,
            metavar="S",
            help="read every rank's progress from its agent every S seconds, for /api/progress and /metrics "
            f"(default 2; at least {MIN_PROGRESS_EVERY_S:g}; 0: read only when asked)",
        )
        add_serve_watch_args(parser)

    def run(self, args: argparse.Namespace) -> int:
        check_hosted_watch(args)
        if bool(args.certfile) != bool(args.keyfile):
            raise errors.UsageError("give --certfile and --keyfile together (TLS needs both)")
        if 0 < args.progress_every < MIN_PROGRESS_EVERY_S:
            raise errors.UsageError(
                f"--progress-every {args.progress_every:g} is below {MIN_PROGRESS_EVERY_S:g} s",
                help="Poll every few seconds (default 2), or give 0 to read only when asked.",
            )
        if args.max_actions >= args.threads:
            raise errors.UsageError(
                f"--max-actions {args.max_actions} needs --threads above it (now {args.threads})",
                help="The page, the listings and /healthz need a free thread while actions run.",
            )
        try:
            from dynprof.sidecar.app import create_app
        except ImportError as exc:
            raise errors.Unsupported(f"the web app needs flask: {exc}", help="pip install flask") from None
        try:
            import cheroot  # noqa: F401
        except ImportError as exc:
            raise errors.Unsupported(f"the HTTP server needs cheroot: {exc}", help="pip install cheroot") from None
        from dynprof.sidecar.server import connection_cap, min_open_files, raise_open_file_limit

        before, limit = raise_open_file_limit(args.max_open_files)
        if limit < min_open_files(args.threads):
            raise errors.UsageError(
                f"the open-file limit of this process is {limit}: too low for --threads {args.threads} "
                f"(at least {min_open_files(args.threads)})",
                help="Raise the limit (`ulimit -n`, systemd's LimitNOFILE, the container's nofile) or give fewer --threads.",
            )
        token, source = resolve_token(args.token, args.token_file)
        fanout, own_file = (None, None) if args.no_job_wide else _fanout_config(token, source, args.cacert)
        # The token file written for the job-wide actions (own_file) is removed however this ends: a
        # server that stops, or one that never started (a port in use, a bad node option).
        try:
            from dynprof.sidecar.progress import ProgressBook

            book = ProgressBook(detect().host, args.progress_every, stall_after=args.stall_after)
            hosted: list[Any] = []  # the hosted watch (--watch), once it started: its gauges go to /metrics
            app = create_app(
                progress=book,
                watch_gauges=(lambda: hosted[0].gauges() if hosted else []) if args.watch else None,
                views=page_views(),
                token=token,
                host=args.host,
                max_actions=args.max_actions,
                read_only=args.read_only,
                extra_hosts=args.allow_host,
                fanout=fanout,
                links=None if fanout is None else LinkPolicy.for_sidecar(args.host, args.allow_peer),
            )
            server = build_server(app, args.host, args.port, args.threads, args.certfile, args.keyfile)
            warnings = risk_warnings(args.host, tls=bool(args.certfile), token_in_argv=source == "--token")
            try:
                server.prepare()  # binds
            except OSError as exc:
                raise errors.DynprofError(
                    f"cannot listen on {args.host}:{args.port}: {exc}", help="Choose another --port."
                ) from None
            watch = start_hosted_watch(args, token)
            if watch is not None:
                hosted.append(watch)
            said = [f"dynprof: warning: {warning}" for warning in warnings]
            said.append(f"dynprof: serving on {_url(args.host, args.port, token, tls=bool(args.certfile))}")
            raised = f", raised from {before}" if limit != before else ""
            said.append(
                f"dynprof: at most {connection_cap(args.threads, limit)} connections at once "
                f"(open-file limit {limit}{raised}; --threads {args.threads})"
            )
            if source != "generated":
                said.append(f"dynprof: token from {source}")
            sys.stderr.write("".join(line + "\n" for line in said))  # one write: a reader sees all of it or none
            sys.stderr.flush()
            book.start()
            try:
                return _serve_until_signalled(server)
            finally:
                book.stop()
                if watch is not None:
                    watch.stop()
        finally:
            if own_file:
                with contextlib.suppress(OSError):
                    os.unlink(own_file)


def page_views() -> Any:
    """How the sidecar's page and listings show agents and artifacts: as ``ps`` and ``show`` do
    (a :class:`dynprof.sidecar.app.PageViews`; the sidecar imports no CLI)."""
    from dynprof.sidecar.app import PageViews

    return PageViews(agent_rows, render, render_html)


def _fanout_config(token: str, source: str, cacert: str | None) -> tuple[Any, str | None]:
    """How job-wide actions reach the other nodes: with this sidecar's token file (the nodes of
    a job share one token). A token given on the command line or generated is written to a file
    of mode 0600 in the private run directory for the life of the server (second value)."""
    if source not in ("--token", "generated"):
        return FanoutConfig(os.path.abspath(source), cacert), None
    path = os.path.join(run_dir(), f"serve-{os.getpid()}.token")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(token + "\n")
    return FanoutConfig(path, cacert), path


def _serve_until_signalled(server: Any) -> int:
    """Serve on a thread; SIGINT or SIGTERM only sets a flag and writes a byte to a pipe, and
    this thread, woken by the pipe, then stops the server (in-flight requests get
    SHUTDOWN_TIMEOUT_S to finish).

    The handler runs on this thread, between any two of its bytecodes: it takes no lock
    (``Event.set``, logging and printing do, and the interrupted thread may hold the same one,
    as ``Event.wait`` does), so a second signal while the first is handled cannot deadlock."""
    failure: list[BaseException] = []
    signalled: list[int] = []
    wake_r, wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)

    def wake() -> None:
        try:
            os.write(wake_w, b"\0")
        except OSError:  # the pipe is full: it is awake already
            pass

    def serve() -> None:
        try:
            server.serve()
        except BaseException as exc:  # reported below, from the main thread
            failure.append(exc)
        finally:
            wake()

    def on_signal(signum: int, frame: Any) -> None:
        signalled.append(signum)
        wake()

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    worker = threading.Thread(target=serve, name="dynprof-serve", daemon=True)
    worker.start()
    try:
        while not signalled and worker.is_alive():
            select.select([wake_r], [], [], 1.0)
    finally:
        from dynprof.sidecar.child import kill_children

        kill_children()  # first: a healthcheck's processes never outlive the sidecar, nor hold up its stop
        server.stop()
        worker.join(SHUTDOWN_TIMEOUT_S + 5)
        for s, handler in previous.items():
            signal.signal(s, handler)
        os.close(wake_r)
        os.close(wake_w)
    print("dynprof: stopped serving", file=sys.stderr)
    if failure and not isinstance(failure[0], (KeyboardInterrupt, SystemExit)):
        raise errors.DynprofError(f"the HTTP server failed: {type(failure[0]).__name__}: {failure[0]}")
    return 0
