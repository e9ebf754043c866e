"""scripts/check_private_imports.py: a `_private` name used outside the package that defines it fails."""

from __future__ import annotations

from pathlib import Path
from types import ModuleType

from tests.support.scripts import load_script


def load_checker() -> ModuleType:
    return load_script("check_private_imports")


def write(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


TREE = {
    "pkg/__init__.py": "",
    "pkg/_hidden.py": "VALUE = 1\n",
    "pkg/public.py": "def _helper():\n    pass\n\nNAME = 1\n",
    "pkg/inner/__init__.py": "",
    "pkg/inner/user.py": "from pkg import _hidden\nfrom pkg.public import _helper\n",
    "pkg/cli/__init__.py": "def _silence():\n    pass\n",
    "pkg/cli/_common.py": "def table():\n    pass\n",
    "pkg/cli/cmd.py": "from pkg.cli._common import table\nfrom . import _silence\n",
    "other/__init__.py": "",
}


def test_names_private_to_a_package_may_be_used_inside_it(tmp_path: Path) -> None:
    # GIVEN private modules and names used only by modules inside their package
    checker = load_checker()
    write(tmp_path, TREE)
    # WHEN the tree is checked
    crossings = checker.check(tmp_path, ("pkg", "other"))
    # THEN nothing crosses
    assert crossings == []


def test_each_way_of_reaching_a_private_name_from_outside_is_found(tmp_path: Path) -> None:
    # GIVEN a module outside `pkg.cli` and `pkg` reaching their privates in every form the checker knows
    checker = load_checker()
    write(
        tmp_path,
        {
            **TREE,
            "other/face.py": (
                "import pkg._hidden\n"
                "from pkg.cli._common import table\n"
                "from pkg.cli import _silence\n"
                "from pkg.public import _helper, NAME\n"
                "from pkg import public\n"
                "def f():\n"
                "    return public._helper()\n"
            ),
            "pkg/sidecar.py": "from pkg.cli._common import table\n",
        },
    )
    # WHEN the tree is checked
    crossings = checker.check(tmp_path, ("pkg", "other"))
    # THEN each use is reported with its line and the package it belongs to
    assert [(c.importer, c.line, c.name, c.owner) for c in crossings] == [
        ("other.face", 1, "pkg._hidden", "pkg"),
        ("other.face", 2, "pkg.cli._common", "pkg.cli"),
        ("other.face", 3, "pkg.cli._silence", "pkg.cli"),
        ("other.face", 4, "pkg.public._helper", "pkg"),
        ("other.face", 7, "pkg.public._helper", "pkg"),
        ("pkg.sidecar", 1, "pkg.cli._common", "pkg.cli"),
    ]


def test_dunder_names_and_other_roots_are_not_private(tmp_path: Path) -> None:
    # GIVEN imports of a dunder name and of a third-party private module
    checker = load_checker()
    write(tmp_path, {**TREE, "other/meta.py": "from pkg import __doc__\nimport json.decoder\nfrom os import _exit\n"})
    # WHEN the tree is checked
    crossings = checker.check(tmp_path, ("pkg", "other"))
    # THEN they are not reported
    assert crossings == []
