"""Check that no ``_private`` name of dynprof crosses a package boundary.

import-linter (the layer contracts in pyproject.toml) sees modules, not names, so this check
reads the source with :mod:`ast`. A private name is one whose last part starts with a single
underscore (``_read_pickle``, ``_common``; not ``__version__``). It belongs to the package that
defines it: the package of the module it is defined in (a ``_function`` of
``collectors/memory/reader.py`` belongs to ``collectors.memory``; ``dynprof.cli._common`` and a
``_function`` of ``dynprof/cli/__init__.py`` belong to ``dynprof.cli``). Only that package and the packages inside it may use it, through

- ``from a.b import _x`` and ``from a._b import x``,
- ``import a._b`` (the first private part decides), and
- ``b._x`` where ``b`` is a module bound by an import.

Each exception is listed in EXCEPTIONS with the reason it is allowed. Exits 1 and lists every
crossing found, else exits 0.

    python scripts/check_private_imports.py [ROOT ...]   # default: dynprof collectors healthcheck
"""

from __future__ import annotations

import argparse
import ast
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PACKAGES = ("dynprof", "collectors", "healthcheck")

# (importing module, private dotted name) -> why it is allowed. Keep this short: each entry is a
# debt or a deliberate boundary, named.
EXCEPTIONS: dict[tuple[str, str], str] = {}


@dataclass(frozen=True)
class Crossing:
    path: Path
    line: int
    importer: str
    name: str
    owner: str

    def __str__(self) -> str:
        rel = self.path.relative_to(REPO) if self.path.is_relative_to(REPO) else self.path
        return f"{rel}:{self.line}: {self.importer} uses {self.name}, private to {self.owner}"


def is_private(part: str) -> bool:
    return part.startswith("_") and not (part.startswith("__") and part.endswith("__"))


def module_name(path: Path, root: Path) -> tuple[str, bool]:
    """The dotted name of a source file, and whether it is a package (``__init__.py``)."""
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        return ".".join(parts[:-1]), True
    return ".".join(parts), False


class Modules:
    """Which dotted names are modules and packages of the checked tree."""

    def __init__(self, root: Path, packages: tuple[str, ...]) -> None:
        self.roots = packages
        self.files: dict[str, Path] = {}
        self.packages: set[str] = set()
        for package in packages:
            for path in sorted((root / package).rglob("*.py")):
                name, is_package = module_name(path, root)
                self.files[name] = path
                if is_package:
                    self.packages.add(name)

    def is_module(self, dotted: str) -> bool:
        return dotted in self.files

    def owner(self, dotted: str) -> str | None:
        """The package a private dotted name belongs to, or None when nothing in it is private.

        The first private part decides: everything below it belongs to the package that holds
        it. ``a.b._c.d`` belongs to ``a.b`` when ``a.b`` is a package, else to ``a``."""
        parts = dotted.split(".")
        if parts[0] not in self.roots:
            return None
        for index, part in enumerate(parts):
            if index and is_private(part):
                holder = ".".join(parts[:index])
                return holder if holder in self.packages else holder.rpartition(".")[0] or holder
        return None


def inside(importer: str, importer_is_package: bool, owner: str) -> bool:
    package = importer if importer_is_package else importer.rpartition(".")[0]
    return package == owner or package.startswith(owner + ".")


def resolve_relative(importer: str, is_package: bool, module: str | None, level: int) -> str:
    base = importer.split(".") if is_package else importer.split(".")[:-1]
    if level > 1:
        base = base[: len(base) - (level - 1)]
    return ".".join([*base, module] if module else base)


def used_names(tree: ast.AST, importer: str, is_package: bool, modules: Modules) -> Iterator[tuple[int, str]]:
    """Every dotted name of the checked tree this module imports or reaches as ``module._x``."""
    bound: dict[str, str] = {}  # local name -> the module it is bound to
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
                if alias.asname:
                    bound[alias.asname] = alias.name
                else:
                    top = alias.name.partition(".")[0]
                    bound[top] = top
        elif isinstance(node, ast.ImportFrom):
            source = (
                resolve_relative(importer, is_package, node.module, node.level) if node.level else node.module or ""
            )
            yield node.lineno, source
            for alias in node.names:
                if alias.name == "*":
                    continue
                dotted = f"{source}.{alias.name}"
                yield node.lineno, dotted
                if modules.is_module(dotted):
                    bound[alias.asname or alias.name] = dotted
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and is_private(node.attr):
            chain: list[str] = [node.attr]
            value: ast.expr = node.value
            while isinstance(value, ast.Attribute):
                chain.append(value.attr)
                value = value.value
            if isinstance(value, ast.Name) and value.id in bound:
                yield node.lineno, ".".join([bound[value.id], *reversed(chain)])


def check(root: Path, packages: tuple[str, ...]) -> list[Crossing]:
    modules = Modules(root, packages)
    found: dict[tuple[Path, int, str], Crossing] = {}
    for importer, path in modules.files.items():
        is_package = importer in modules.packages
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        for line, dotted in used_names(tree, importer, is_package, modules):
            owner = modules.owner(dotted)
            if owner is None or inside(importer, is_package, owner):
                continue
            if (importer, dotted) in EXCEPTIONS:
                continue
            key = (path, line, owner)
            if key not in found or len(dotted) < len(found[key].name):
                found[key] = Crossing(path, line, importer, dotted, owner)
    return sorted(found.values(), key=lambda c: (str(c.path), c.line, c.name))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("packages", nargs="*", default=list(PACKAGES), help="top-level packages to check")
    args = parser.parse_args(argv)
    crossings = check(REPO, tuple(args.packages))
    for crossing in crossings:
        print(crossing)
    if crossings:
        print(
            f"{len(crossings)} private name(s) used outside their package: make the name public, "
            "give it a home both sides may import, or list it in EXCEPTIONS with a reason",
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
