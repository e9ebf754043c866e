"""The options of `dynprof run` that features add (the hang watchdog, memory, the flight
recorder, the GPU core dump), each an (add_arguments, apply_to_environment) pair. `dynprof run`
takes them all; `dynprof attach` the ones that apply to a running process.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

# Other features add their `dynprof run` options here: (add_arguments, apply_to_environment).
# apply_to_environment(args, env) validates its options and sets the variables the agent reads.
RunOption = tuple[Callable[[argparse.ArgumentParser], None], Callable[[argparse.Namespace, dict[str, str]], None]]
RUN_OPTIONS: list[RunOption] = []


def load_run_options() -> None:
    # Imported for their side effect of appending to RUN_OPTIONS; missing ones are skipped.
    import importlib

    for name in (
        "dynprof.cli._run_hang",
        "dynprof.cli._run_memory",
        "dynprof.cli._run_checkpoint",
        "dynprof.cli._run_flight",
        "dynprof.cli._run_gpu",
    ):
        try:
            importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name != name:
                raise
