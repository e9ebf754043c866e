"""Watch a job: say when it stalls, and whether and where it hangs, with the evidence.

    dynprof watch --job J                               # the ranks on this node
    dynprof watch --job J --hosts node-1,node-2 --token-file T
    dynprof watch --job J --slurm --once --json          # one check; exit code says what it found

Every --interval it reads each rank's progress (through each node's sidecar, one request per
node, or this node's agents directly). When no rank advanced for --stall-after (default: the
larger of 60 s and 20x the job's median step time; before the first step, counted from the
processes' start) it looks before it speaks: every rank's stacks twice, --look-interval apart
(native frames for ranks whose agent does not answer), merged; then says **hang** (naming the
culprit ranks, their nodes and where they are, with the flight recorder's analysis when the
job has it on and each involved node's quick healthcheck), or **busy** (ranks that save,
evaluate, compile or load data: never a hang). Each verdict is printed once per stall, written
as a `verdict` artifact (`dynprof show` reads it) and handed to --on-verdict CMD. Progress
lines go to stderr. dynprof never stops the job itself.

Exit codes: 0 no hang found (the job progresses, or is busy), 20 a hang verdict was given,
12 some node did not answer (and no hang was found), 5 no rank of the job has an agent (--once).
"""

from __future__ import annotations

import argparse
import sys
import threading

from dynprof import errors
from dynprof.cli._common import add_json, positive_float, printable
from dynprof.cli._node_args import add_many_node_args, nodes_requested
from dynprof.cli._watching import (
    VerdictPrinter,
    add_watch_options,
    config_of,
    node_source,
    samplers_of,
)
from dynprof.watch.engine import WatchEngine
from dynprof.watch.sources import LocalSource

HELP = __doc__
HANG_EXIT = 20
NO_AGENT_HELP = (
    "The watch reads each rank's progress from its dynprof agent. Start the job under `dynprof run -- ...` "
    "(or with DYNPROF=1), or attach agents to its running processes: `dynprof attach --job JOB` on each node "
    "(`--attach` on stacks and nccl does it on the fly). Without agents, `dynprof stacks --job JOB` still "
    "samples where every rank is (py-spy / pystack read them from outside), but nothing counts steps."
)


class WatchCommand:
    __doc__ = HELP

    def prepare_parser(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--job", required=True, metavar="JOB", help="the job to watch (its DYNPROF_JOB_ID)")
        add_watch_options(parser)
        parser.add_argument("--once", action="store_true", help="check once (look now, stalled or not) and exit")
        parser.add_argument(
            "--max-seconds",
            type=positive_float(),
            metavar="SEC",
            help="stop watching after SEC (default: until the job ends or Ctrl-C)",
        )
        add_json(parser)
        add_many_node_args(parser)

    def run(self, args: argparse.Namespace) -> int:
        if len(args.job) > 200:
            raise errors.UsageError("--job takes at most 200 characters")
        nodes = nodes_requested(args)
        source = node_source(args, nodes) if nodes is not None else LocalSource()
        printer = VerdictPrinter(args.json, args.on_verdict, args.on_verdict_timeout)
        engine = WatchEngine(
            config_of(args),
            source,
            on_verdict=printer.verdict,
            on_tick=printer.tick,
            samplers=samplers_of(args, source),
            on_sample=printer.sample,
        )
        timer: threading.Timer | None = None
        if args.max_seconds:
            timer = threading.Timer(args.max_seconds, engine.stop)
            timer.daemon = True
            timer.start()
        try:
            engine.run(once=args.once)
        except KeyboardInterrupt:
            engine.stop()
            print("dynprof: watch interrupted", file=sys.stderr)
        finally:
            if timer is not None:
                timer.cancel()
        last = printer.ticks[-1] if printer.ticks else None
        if args.once and last is not None and last.ranks == 0:
            if last.nodes_unanswered:  # the ranks may be there, on the nodes that did not answer
                raise errors.NodesFailed(
                    f"no rank of job {args.job!r} found: {len(last.nodes_unanswered)} node(s) did not answer "
                    f"({', '.join(printable(n) for n in list(last.nodes_unanswered)[:5])})"
                )
            raise errors.NoAgent(f"no rank of job {args.job!r} with a dynprof agent was found", help=NO_AGENT_HELP)
        if printer.hangs:
            return HANG_EXIT
        if printer.ticks and printer.ticks[-1].nodes_unanswered:
            return errors.NodesFailed.exit_code
        return 0


__all__ = ["HANG_EXIT", "WatchCommand"]
