#!/usr/bin/env python3
"""Write docs/cli.md from the real argument parser, so the reference cannot drift.

python scripts/gen_cli_reference.py           # rewrite docs/cli.md
python scripts/gen_cli_reference.py --check   # exit 1 if docs/cli.md is stale
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
OUT = ROOT / "docs" / "cli.md"


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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true")
    args = ap.parse_args(argv)
    text = render()
    if args.check:
        if not OUT.exists() or OUT.read_text() != text:
            print(f"{OUT} is stale: run python scripts/gen_cli_reference.py", file=sys.stderr)
            return 1
        return 0
    OUT.parent.mkdir(exist_ok=True)
    OUT.write_text(text)
    print(f"wrote {OUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
