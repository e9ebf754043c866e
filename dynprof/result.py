"""What a command found, apart from how it is shown.

Every command's ``collect(args)`` returns a :class:`Result`; ``render(result)`` turns it into
text, and ``--json`` prints :meth:`Result.to_json`. The sidecar's actions and the job-wide layer
call ``collect`` and send ``to_json()`` on: nothing parses a command's printed output.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from dynprof.errors import DynprofError


@dataclass
class Result:
    """A command's answer: its ``--json`` document, its exit code, and the lines it says on
    stderr (warnings and per-item errors, one line each, without the ``dynprof: `` prefix).

    Commands with a typed answer subclass it and override :meth:`to_json`."""

    doc: dict[str, Any] = field(default_factory=dict)
    exit_code: int = 0
    messages: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return self.doc


def error_json(exc: DynprofError) -> dict[str, Any]:
    """An error as ``--json`` and the sidecar's answers carry it: what a program acts on."""
    return {"type": type(exc).__name__, "message": exc.message, "help": exc.help, "exit_code": exc.exit_code}
