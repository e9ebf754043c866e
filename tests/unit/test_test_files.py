"""Every module of 60 or more lines has its unit test file, named after it.

The rule (docs/architecture.md, tests/unit): a module's unit tests live in
``tests/unit/test_<path>.py``, where <path> is the module's path without the leading
``dynprof/`` and without ``.py``, the leading ``_`` of each name stripped and ``/`` turned into
``_``; a package's ``__init__.py`` is the package itself. So
``collectors/stacks/collect.py`` -> ``test_collectors_stacks_collect.py``,
``dynprof/cli/_common.py`` -> ``test_cli_common.py``, ``dynprof/attach/__init__.py`` ->
``test_attach.py``. A reader looking for a module's tests finds them at that one name.

The few modules whose file is elsewhere (or still to come) are listed below, each with why.
"""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
UNIT = ROOT / "tests" / "unit"
PACKAGES = ("dynprof", "collectors", "healthcheck")
SKIPPED = (
    "dynprof/proto/",  # generated wire code (`make proto`), tested through the client and the agent
    "dynprof/_bootstrap/",  # the sitecustomize of `dynprof run`: only meaningful in a started process
)
MIN_LINES = 60

# Module (path from the repository's root) -> why its unit test file is not at the rule's name.
# None today: every module of 60 lines or more has its file.
ALLOWED: dict[str, str] = {}


def unit_file(module: str) -> str:
    """The unit test file's name of ``module`` (a path from the repository's root)."""
    parts = list(Path(module).with_suffix("").parts)
    if parts[0] == "dynprof":
        parts = parts[1:]
    if parts and parts[-1] == "__init__":
        parts = parts[:-1]
    return "test_" + "_".join(part[1:] if part.startswith("_") else part for part in parts) + ".py"


def modules() -> dict[str, int]:
    """Every module under the checked packages (path from the root) -> its number of lines."""
    found: dict[str, int] = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            module = path.relative_to(ROOT).as_posix()
            if "__pycache__" in path.parts or module.startswith(SKIPPED):
                continue
            found[module] = len(path.read_text(encoding="utf-8").splitlines())
    return found


def test_the_names_follow_the_rule():
    assert unit_file("collectors/stacks/collect.py") == "test_collectors_stacks_collect.py"
    assert unit_file("dynprof/job/client.py") == "test_job_client.py"
    assert unit_file("dynprof/cli/_common.py") == "test_cli_common.py"
    assert unit_file("collectors/stacks/_pystack_dump.py") == "test_collectors_stacks_pystack_dump.py"
    assert unit_file("dynprof/attach/__init__.py") == "test_attach.py"
    assert unit_file("healthcheck/links/side.py") == "test_healthcheck_links_side.py"


def test_every_module_of_60_lines_or_more_has_its_unit_test_file():
    missing = [
        f"{module} ({lines} lines): tests/unit/{unit_file(module)}"
        for module, lines in modules().items()
        if lines >= MIN_LINES and module not in ALLOWED and not (UNIT / unit_file(module)).is_file()
    ]
    assert not missing, "modules without their unit test file (write it, or say why in ALLOWED):\n" + "\n".join(missing)


def test_the_allow_list_is_current():
    # An entry whose module is gone, has shrunk under the rule's size, or has got its file is
    # removed from ALLOWED, so the list says only what is true.
    found = modules()
    stale = [
        module
        for module in ALLOWED
        if module not in found or found[module] < MIN_LINES or (UNIT / unit_file(module)).is_file()
    ]
    assert not stale, f"remove these from ALLOWED: {stale}"


def test_the_walk_sees_the_packages():
    # The rule is only worth something if it walks the real code.
    found = modules()
    assert "dynprof/cli/__init__.py" in found and "collectors/stacks/collect.py" in found
    assert "healthcheck/runner.py" in found
    assert not any(module.startswith(SKIPPED) for module in found)
