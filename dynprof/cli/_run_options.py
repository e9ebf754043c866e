"""The options of `dynprof run` that features add (the hang watchdog, memory, the flight
recorder, the GPU core dump), each an (add_arguments, apply_to_environment) pair. `dynprof run`
takes them all; `dynprof attach` the ones that apply to a running process.

A kind's option is named by its row of the kinds' table (``run_option``, ``dynprof/kinds.py``);
:data:`LISTED` are the ones listed here, first, in the order `dynprof run --help` has always
shown them.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

from dynprof.kinds import run_options

# Other features add their `dynprof run` options here: (add_arguments, apply_to_environment).
# apply_to_environment(args, env) validates its options and sets the variables the agent reads.
RunOption = tuple[Callable[[argparse.ArgumentParser], None], Callable[[argparse.Namespace, dict[str, str]], None]]
RUN_OPTIONS: list[RunOption] = []


# The options written here, before the rows' (whose order in the table is that of the commands):
# a new kind's option is named by its row, never listed here.
LISTED = (
    "dynprof.cli._run_hang",
    "dynprof.cli._run_memory",
    "dynprof.cli._run_checkpoint",
    "dynprof.cli._run_flight",
)


def load_run_options() -> None:
    """Imports the options' modules (:data:`LISTED`, then the kinds' rows'), each appending its
    pair to :data:`RUN_OPTIONS` once; a missing one is skipped."""
    import importlib

    for name in (*LISTED, *run_options()):
        try:
            importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name != name:
                raise
