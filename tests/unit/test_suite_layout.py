"""The suite's own layout: pytest imports each test file by its basename (the default import
mode), so two test files of one name in different folders stop the whole run at collection,
on every machine. This catches it in the file's own words before CI does."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]


def test_no_two_test_files_share_a_basename():
    where: dict[str, list[str]] = defaultdict(list)
    for path in TESTS.rglob("test_*.py"):
        if "__pycache__" in path.parts:
            continue
        where[path.name].append(str(path.relative_to(TESTS)))
    clashes = {name: sorted(paths) for name, paths in where.items() if len(paths) > 1}
    assert not clashes, f"test files share a basename (rename one of each): {clashes}"


def test_the_check_sees_the_suite():
    # The rule above is only worth something if it walks the real suite.
    names = {p.name for p in TESTS.rglob("test_*.py")}
    assert "test_suite_layout.py" in names and len(names) > 50
