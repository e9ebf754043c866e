"""The import contracts of pyproject.toml cover the whole package.

``lint-imports`` checks the contracts as written; these tests check that what they are written
over is all there is: a new top-level module of ``dynprof/`` lands in the floor contract (or is
named here, with its reason), a new subpackage in a layer, and the CLI's independence contract
names the commands of the kinds' table (``scripts/gen_cli_reference.py`` writes it from them).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.support.scripts import load_script

tomllib = pytest.importorskip("tomllib", reason="reading pyproject.toml needs Python 3.11 or later")

ROOT = Path(__file__).resolve().parents[2]

# Top-level modules of dynprof/ that are not the floor, and why.
NOT_FLOOR = {
    "dynprof": "the package itself: its __init__ re-exports the public API (dynprof.phase)",
    "dynprof.__main__": "`python -m dynprof`: the CLI's entry point",
    "dynprof._startup": "the start-up hook that starts the agent: it belongs to the agent",
}
# Subpackages of dynprof/ that are part of the floor (in its contract, with all their modules),
# and why.
FLOOR_PACKAGES = {
    "dynprof.proto": "the generated wire module",
    "dynprof.store": "the artifact store: manifest, read side, write side and the store itself",
}
# Subpackages of dynprof/ in no layer, and why.
NOT_LAYERED = {
    "dynprof._bootstrap": "the sitecustomize that `dynprof run` puts on PYTHONPATH: it only calls the start-up hook",
    **{package: f"{why}: in the floor contract" for package, why in FLOOR_PACKAGES.items()},
}


def _contracts() -> dict[str, dict[str, Any]]:
    doc = tomllib.loads((ROOT / "pyproject.toml").read_text())
    return {c["name"]: c for c in doc["tool"]["importlinter"]["contracts"]}


def _layered(contract: dict[str, Any]) -> set[str]:
    return {name.strip() for layer in contract["layers"] for name in layer.replace(":", "|").split("|")}


def test_every_top_level_module_is_in_the_floor_contract_or_named_with_a_reason() -> None:
    # GIVEN the floor contract and the top-level modules on disk
    floor = next(c for c in _contracts().values() if c["name"] == "The floor imports no layer")
    on_disk = {"dynprof." + p.stem if p.stem != "__init__" else "dynprof" for p in (ROOT / "dynprof").glob("*.py")}

    subpackages = {"dynprof." + p.parent.name for p in (ROOT / "dynprof").glob("*/__init__.py")}

    # THEN each is in the floor or named as not being it, and the contract names nothing gone;
    # the floor's packages are in it whole (import-linter takes a package with its modules)
    assert on_disk - set(NOT_FLOOR) == set(floor["source_modules"]) - set(FLOOR_PACKAGES)
    assert set(NOT_FLOOR) <= on_disk
    assert set(FLOOR_PACKAGES) <= set(floor["source_modules"]) and set(FLOOR_PACKAGES) <= subpackages
    assert floor.get("as_packages", True)


def test_every_subpackage_is_in_a_layer_and_the_floor_forbids_every_layer() -> None:
    # GIVEN the layers contract
    contracts = _contracts()
    layers = next(c for c in contracts.values() if c["type"] == "layers")
    floor = contracts["The floor imports no layer"]
    subpackages = {"dynprof." + p.parent.name for p in (ROOT / "dynprof").glob("*/__init__.py")}
    subpackages |= {"dynprof._bootstrap"}
    roots = {"collectors", "healthcheck"}

    # THEN every subpackage and the other root packages are in a layer (or named), and the
    # floor may import none of the layers
    assert subpackages - set(NOT_LAYERED) | roots == _layered(layers)
    assert set(floor["forbidden_modules"]) == _layered(layers)


def test_every_cli_command_is_in_the_independence_contract() -> None:
    # GIVEN the commands the CLI dispatches to (the rows of dynprof.kinds with a command), and the
    # contract over them (written from those rows by scripts/gen_cli_reference.py)
    from dynprof.cli import COMMANDS

    contract = _contracts()["The CLI's commands import none of each other"]

    # THEN each command's module is one of the contract's, and the contract names no other
    assert {f"dynprof.cli.{module}" for _, module, _ in COMMANDS} == set(contract["modules"])


def _generator() -> Any:
    return load_script("gen_cli_reference")


def test_the_independence_contract_is_written_from_the_commands():
    # GIVEN pyproject.toml as committed, and its generator
    gen = _generator()
    text = (ROOT / "pyproject.toml").read_text()

    # THEN the contract's list is the generated one
    assert gen.render_pyproject(text) == text, "pyproject.toml is stale: run python scripts/gen_cli_reference.py"


def test_a_command_the_contract_lacks_is_caught(monkeypatch):
    # GIVEN a new command in the table that pyproject.toml's contract does not list yet
    import dynprof.cli

    gen = _generator()
    text = (ROOT / "pyproject.toml").read_text()
    monkeypatch.setattr(dynprof.cli, "COMMANDS", (*dynprof.cli.COMMANDS, ("gc", "gc", "GcCommand")))

    # WHEN the contract is written THEN it differs from the committed one by that module, in its
    # sorted place, and the rest of the file is as it was
    regenerated = gen.render_pyproject(text)
    assert regenerated != text
    contract = {c["name"]: c for c in tomllib.loads(regenerated)["tool"]["importlinter"]["contracts"]}
    modules = contract["The CLI's commands import none of each other"]["modules"]
    assert modules == sorted(
        {*_contracts()["The CLI's commands import none of each other"]["modules"], "dynprof.cli.gc"}
    )
    assert regenerated.replace('  "dynprof.cli.gc",\n', "") == text

    # AND a file whose markers are gone is refused, not silently left as it is
    with pytest.raises(SystemExit, match="markers"):
        gen.render_pyproject(text.replace(gen.CONTRACT_END, ""))
