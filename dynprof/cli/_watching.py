"""The watch as the CLI runs it: its options, where it reads (this node's agents, or the nodes'
sidecars), how a verdict is printed and handed on. ``dynprof watch`` and ``dynprof serve --watch``
(the sidecar hosting the watch) both run it from here.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from typing import Any

from collectors.flight_recorder.collect import NcclRequest
from dynprof import errors
from dynprof.arguments import parse_float
from dynprof.cli._common import printable, printable_lines, seconds
from dynprof.cli.job import client_for
from dynprof.job.client import SidecarClient, tls_context
from dynprof.job.discovery import add_node_args, resolve_nodes
from dynprof.job.merge import node_messages
from dynprof.job.nccl import collect_nodes
from dynprof.nodes import Node
from dynprof.watch.engine import WatchConfig
from dynprof.watch.render import render_verdict_text
from dynprof.watch.sampler import samplers_for
from dynprof.watch.signals import all_signals, sample_event
from dynprof.watch.sources import FLIGHT_RECORDER_OFF, FLIGHT_RECORDER_TIMEOUT_S, LocalSource, SidecarSource

EVENT_SCHEMA = "dynprof.watch.event"
EVENT_VERSION = 1


def add_watch_options(parser: argparse.ArgumentParser | Any) -> None:
    """The watch's own options (``dynprof watch`` and ``dynprof serve --watch``)."""
    parser.add_argument(
        "--interval", type=seconds, default=5.0, metavar="SEC", help="read the progress every SEC (default 5)"
    )
    parser.add_argument(
        "--stall-after",
        type=seconds,
        metavar="SEC",
        help="a job that makes no step for SEC is stalled (default: the larger of 60 s and 20x its median step time)",
    )
    parser.add_argument(
        "--look-interval",
        type=seconds,
        default=3.0,
        metavar="SEC",
        help="seconds between the two stack samples of a look (default 3)",
    )
    parser.add_argument(
        "--confirm-after",
        type=seconds,
        metavar="SEC",
        help="a hang whose only culprits are ranks that still move (CPU, changing stack) is called once the "
        "others have waited SEC in the same collective; one where every rank waits for its GPU, or where no "
        "rank moves, once the ranks have stayed SEC where they were (default: half the stall time)",
    )
    parser.add_argument(
        "--on-verdict",
        metavar="CMD",
        help="run CMD (with /bin/sh) on each verdict: the verdict's JSON on its stdin, DYNPROF_VERDICT_FILE, "
        "DYNPROF_VERDICT_KIND and DYNPROF_VERDICT_JOB in its environment; its failure is reported, never fatal",
    )
    parser.add_argument(
        "--on-verdict-timeout",
        type=seconds,
        default=30.0,
        metavar="SEC",
        help="kill --on-verdict CMD past SEC (default 30)",
    )
    for signal in all_signals():  # each sampled signal's interval (the straggler's --sample-every)
        parser.add_argument(signal.flag, type=nonnegative_seconds, default=None, metavar="SEC", help=signal.help)
    parser.add_argument(
        "--no-healthcheck", action="store_true", help="do not run the involved nodes' quick healthcheck on a hang"
    )
    parser.add_argument("--no-save", action="store_true", help="print the verdicts only; do not save artifacts")
    parser.add_argument(
        "--gpu-coredump",
        action="store_true",
        help="on a hang, dump the GPU of each culprit on this node whose step's GPU work has not finished, to name "
        "the kernel it runs (started with `dynprof run --gpu-coredump`); the dump ENDS that rank's GPU work",
    )


def config_of(args: argparse.Namespace) -> WatchConfig:
    return WatchConfig(
        job=args.job,
        interval_s=args.interval,
        stall_after_s=args.stall_after,
        look_interval_s=args.look_interval,
        confirm_s=args.confirm_after,
        healthcheck=not args.no_healthcheck,
        save=not args.no_save,
        gpu_coredump=bool(getattr(args, "gpu_coredump", False)),
    )


def nonnegative_seconds(text: str) -> float:
    """A sampled signal's interval: 0 (never sample) up to a week."""
    return parse_float(text, 0.0, 7 * 86400.0, low_open=False, what="seconds (0 <= SEC <= 604800)")


def every_of(args: argparse.Namespace) -> dict[str, float | None]:
    """Each sampled signal's interval, by its name: its option's, else its default; 0: never."""
    every: dict[str, float | None] = {}
    for signal in all_signals():
        given = getattr(args, signal.dest, None)
        every[signal.name] = signal.every_s if given is None else (given or None)
    return every


def samplers_of(args: argparse.Namespace, source: Any) -> list[Any]:
    """The engine's samplers over ``source`` (the nodes' sidecars, or this node's agents): every
    signal's, at the intervals the options say."""

    return samplers_for(source, every_of(args))


# -- what the watch says ---------------------------------------------------------------------------
class VerdictPrinter:
    """Prints each verdict (text, or one JSON document a line), runs the hook, and puts a
    progress line on stderr each round."""

    def __init__(self, as_json: bool, hook: str | None, hook_timeout: float, out: Any = None) -> None:
        self.as_json = as_json
        self.hook = hook
        self.hook_timeout = hook_timeout
        self.out = out
        self.hangs = 0
        self.ticks: list[Any] = []
        self._told_no_ranks = False

    def verdict(self, verdict: Any, path: str | None) -> None:
        from dynprof.watch.hook import run_hook

        if verdict.kind == "hang":
            self.hangs += 1
        hook: dict[str, Any] | None = None
        if self.hook and (verdict.kind != "ok" or path):
            result = run_hook(self.hook, verdict, path, self.hook_timeout)
            hook = {"ok": result.ok, "exit_code": result.exit_code, "message": result.message}
            if not result.ok:
                print(f"dynprof: warning: {printable(result.message)}", file=sys.stderr)
        out = self.out or sys.stdout
        if self.as_json:
            doc = {
                "schema": EVENT_SCHEMA,
                "schema_version": EVENT_VERSION,
                "event": "verdict",
                "verdict": verdict.to_json(),
                "artifact": path,
                "hook": hook,
            }
            print(json.dumps(doc, default=str), file=out, flush=True)
        else:
            print(render_verdict(verdict, path), file=out, flush=True)

    def sample(self, report: Any) -> None:
        """What one sample of a signal found (a :class:`~dynprof.watch.sampler.SignalReport`): an
        event ``<signal>_sample`` with --json (the straggler's: ``straggler_sample``), and a line
        on stderr (whatever it found: a straggler, none, or why nothing was decided)."""
        if self.as_json:
            doc = {
                "schema": EVENT_SCHEMA,
                "schema_version": EVENT_VERSION,
                "event": sample_event(report.signal),
                "sample": report.to_json(),
            }
            print(json.dumps(doc, default=str), file=self.out or sys.stdout, flush=True)
        print(f"dynprof: watch: {printable(report.line())}", file=sys.stderr, flush=True)

    def tick(self, tick: Any) -> None:
        self.ticks.append(tick)
        del self.ticks[:-2]
        for node, why in sorted(tick.nodes_unanswered.items()):
            print(f"dynprof: node {printable(node)}: {printable(why)}", file=sys.stderr)
        if tick.ended:
            print(f"dynprof: watch: {printable(tick.note)}; stopping", file=sys.stderr)
            return
        if tick.ranks == 0:
            if not self._told_no_ranks:
                print(f"dynprof: watch: {printable(tick.note)} yet (waiting for ranks with an agent)", file=sys.stderr)
                self._told_no_ranks = True
            return
        stall = tick.stall
        if stall is None:
            return
        age = f"{stall.age_s:.1f} s ago" if stall.age_s is not None else "never"
        state = "STALLED" if stall.stalled else "ok"
        confirm = f"; a hang to be confirmed, looking again in {tick.confirm_in_s:.0f} s" if tick.confirm_in_s else ""
        print(
            f"dynprof: watch: {state}: {tick.ranks} rank(s), last step {stall.last_step} {age} "
            f"(stall after {stall.stall_after_s:.0f} s){confirm}",
            file=sys.stderr,
            flush=True,
        )


def render_verdict(verdict: Any, path: str | None) -> str:
    """A verdict for people: the conclusion, the times, the culprits, every rank in a table."""
    text = render_verdict_text(verdict)
    if path:
        text += f"\nartifact {path}"
    return printable_lines(text)


# -- where the watch reads -------------------------------------------------------------------------
def polled_source(client: SidecarClient, nodes: list[Node], flight_recorder: Any = None) -> SidecarSource:
    """The nodes' sidecars as the watch polls them through ``client``."""
    # A poll holds every node's progress and then its stacks: the client's total is shared
    # among those answers (one per node each, native stacks more for a few).
    client.shared_by = max(1, len(nodes))
    client.answers_per_node = 2
    return SidecarSource(client, nodes, flight_recorder=flight_recorder)


def node_source(args: argparse.Namespace, nodes: list[Node]) -> SidecarSource:
    """The nodes' sidecars, with the flight recorder read by ``nccl``'s own job-wide path."""

    def flight_recorder(job: str, skip: dict[Any, tuple[int, ...]]) -> tuple[dict[str, Any] | None, str | None]:
        # A client of its own: the dumps read back are not among the poll's shared answers.
        request = NcclRequest(job=job, timeout=FLIGHT_RECORDER_TIMEOUT_S)
        got = collect_nodes(client_for(args), nodes, request, skip=skip)
        if got.recorder_off:
            return None, FLIGHT_RECORDER_OFF
        if got.analysis is None:
            return None, "; ".join(node_messages(got.answers)[:5])[:1000] or "no flight recorder dump (is it on?)"
        return got.analysis, None

    return polled_source(client_for(args), nodes, flight_recorder)


# -- serve --watch ----------------------------------------------------------------------------------
def add_serve_watch_args(parser: argparse.ArgumentParser) -> None:
    """``dynprof serve --watch --job J [node options]``: the sidecar hosts the watch."""
    group = parser.add_argument_group("hosted watch (`dynprof watch` inside the sidecar; see docs/watch.md)")
    group.add_argument("--watch", action="store_true", help="watch --job JOB from this sidecar (verdicts in its log)")
    group.add_argument("--job", metavar="JOB", help="with --watch: the job to watch")
    add_watch_options(group)
    add_node_args(group)  # type: ignore[arg-type]


def check_hosted_watch(args: argparse.Namespace) -> None:
    """``serve``'s watch options make sense together (before anything is bound)."""
    if not getattr(args, "watch", False):
        if getattr(args, "job", None):
            raise errors.UsageError("--job goes with --watch")
        return
    if not args.job:
        raise errors.UsageError("--watch needs --job JOB", help="`dynprof serve --watch --job JOB [--hosts ...]`")
    if len(args.job) > 200:
        raise errors.UsageError("--job takes at most 200 characters")


def start_hosted_watch(args: argparse.Namespace, token: str) -> Any:
    """The engine of ``serve --watch``, started on a daemon thread; None without --watch.
    With node options it reads the nodes' sidecars with this sidecar's token, else this node."""
    check_hosted_watch(args)
    if not getattr(args, "watch", False):
        return None
    from dynprof.watch.engine import WatchEngine

    nodes = resolve_nodes(args)
    if nodes is not None:
        tls = tls_context(args.cacert) if args.cacert else None
        source: Any = polled_source(SidecarClient(token, tls=tls), nodes)
    else:
        source = LocalSource()
    printer = VerdictPrinter(False, args.on_verdict, args.on_verdict_timeout, out=sys.stderr)
    engine = WatchEngine(
        config_of(args),
        source,
        on_verdict=printer.verdict,
        samplers=samplers_of(args, source),
        on_sample=printer.sample,
    )

    def loop() -> None:
        while True:
            try:
                engine.run()
                return
            except Exception as exc:  # a bug in a round must not end the watch (nor the sidecar)
                print(f"dynprof: watch: a round failed: {type(exc).__name__}: {printable(exc)}", file=sys.stderr)
                time.sleep(args.interval)

    threading.Thread(target=loop, name="dynprof-watch", daemon=True).start()
    print(f"dynprof: watching job {printable(args.job)}", file=sys.stderr)
    return engine
