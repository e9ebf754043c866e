#!/usr/bin/env python3
"""Write docs/cli.md from the real argument parser, the sidecar's action table of docs/api.md
from the real action rows (``dynprof.sidecar.actions.ACTIONS``), and the module list of the
import contract "The CLI's commands import none of each other" in pyproject.toml from the
commands of the kinds' table (``dynprof.kinds``, read as ``dynprof.cli.COMMANDS``), so none of
them can drift.

python scripts/gen_cli_reference.py           # rewrite docs/cli.md, docs/api.md's action table and the contract's list
python scripts/gen_cli_reference.py --check   # exit 1 if any is stale
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
OUT = ROOT / "docs" / "cli.md"
API = ROOT / "docs" / "api.md"
ACTIONS_BEGIN = (
    "<!-- the action table: generated from dynprof.sidecar.actions.ACTIONS by scripts/gen_cli_reference.py; "
    "do not edit by hand -->"
)
ACTIONS_END = "<!-- end of the action table -->"
PYPROJECT = ROOT / "pyproject.toml"
CONTRACT_BEGIN = (
    "  # the command modules: generated from dynprof.kinds by scripts/gen_cli_reference.py; do not edit by hand"
)
CONTRACT_END = "  # end of the command modules"


def render() -> str:
    os.environ["COLUMNS"] = "100"  # argparse wraps to the terminal: fix it for reproducible text
    from dynprof.cli import COMMANDS, build_parser

    parser = build_parser()
    parser.prog = "dynprof"
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    parts = [
        "# dynprof command reference",
        "",
        "Generated from the parser by `scripts/gen_cli_reference.py`; do not edit by hand.",
        "",
        "```",
        parser.format_help().rstrip(),
        "```",
        "",
    ]
    for name, _, _ in COMMANDS:
        p = sub.choices.get(name)
        if p is None:
            continue
        parts += [f"## dynprof {name}", "", "```", p.format_help().rstrip(), "```", ""]
    return "\n".join(parts)


def render_actions() -> str:
    """The sidecar's action table (docs/api.md, "Actions"): one row per action, as the sidecar
    takes it: its command, its options (an action that carries a kind's request takes the
    request's ``OPTIONS``), that request, whether it acts on jobs, whether it takes ``hosts``, its time limits."""
    from dynprof.sidecar.table import ACTIONS

    def yes(flag: bool) -> str:
        return "yes" if flag else "no"

    rows = [
        "| action | CLI | options | its request | acts on jobs | job-wide (`hosts`) | default / max timeout (s) |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for name, action in ACTIONS.items():
        cli = "`" + " ".join(["dynprof", action.command, *action.leading]) + "`"
        if action.in_subprocess:
            cli += " (in a child process)"
        options = ", ".join(f"`{key}`" for key in action.options)
        request = f"`{action.request.__name__}`" if action.request is not None else "-"
        limits = f"{action.default_timeout_s:g} / {action.max_timeout_s:g}"
        rows.append(
            f"| `{name}` | {cli} | {options} | {request} | {yes(action.changes_jobs)} | {yes(action.fans_out)} "
            f"| {limits} |"
        )
    return "\n".join(rows)


def render_api(text: str) -> str:
    """``text`` (docs/api.md) with its action table, between its two markers, rewritten."""
    head, begin, rest = text.partition(ACTIONS_BEGIN)
    _, end, tail = rest.partition(ACTIONS_END)
    if not begin or not end:
        raise SystemExit(f"{API}: the action table's markers are missing ({ACTIONS_BEGIN!r}, {ACTIONS_END!r})")
    return f"{head}{ACTIONS_BEGIN}\n{render_actions()}\n{ACTIONS_END}{tail}"


def render_contract_modules() -> str:
    """The modules of the CLI's independence contract: every command's, sorted, one a line."""
    from dynprof.cli import COMMANDS

    return "\n".join(f'  "dynprof.cli.{module}",' for module in sorted({module for _, module, _ in COMMANDS}))


def render_pyproject(text: str) -> str:
    """``text`` (pyproject.toml) with the independence contract's modules, between their two
    markers, rewritten."""
    head, begin, rest = text.partition(CONTRACT_BEGIN + "\n")
    _, end, tail = rest.partition(CONTRACT_END + "\n")
    if not begin or not end:
        raise SystemExit(
            f"{PYPROJECT}: the command modules' markers are missing ({CONTRACT_BEGIN!r}, {CONTRACT_END!r})"
        )
    return f"{head}{begin}{render_contract_modules()}\n{end}{tail}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true")
    args = ap.parse_args(argv)
    outputs = {
        OUT: render(),
        API: render_api(API.read_text()),
        PYPROJECT: render_pyproject(PYPROJECT.read_text()),
    }
    if args.check:
        stale = [path for path, text in outputs.items() if not path.exists() or path.read_text() != text]
        for path in stale:
            print(f"{path} is stale: run python scripts/gen_cli_reference.py", file=sys.stderr)
        return 1 if stale else 0
    OUT.parent.mkdir(exist_ok=True)
    for path, text in outputs.items():
        path.write_text(text)
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
