"""The suite's order (tests/conftest.py): the longest tests first, every other one in its place."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tests.conftest import LONG_FIRST, ROOT, long_first_rank


def _test_names(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    return {
        node.name
        for node in ast.walk(tree)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name.startswith("test")
    }


@pytest.mark.parametrize("prefix", LONG_FIRST)
def test_every_long_first_prefix_names_tests_that_exist(prefix):
    # A renamed file or test would silently drop out of the order: its prefix names it still.
    where, _, name = prefix.partition("::")
    path = ROOT / where
    if where.endswith("/"):
        assert path.is_dir() and any(path.glob("test_*.py")), prefix
        return
    assert path.is_file(), prefix
    if name:
        assert any(test.startswith(name) for test in _test_names(path)), prefix


def test_long_tests_come_first_in_the_listed_order_and_the_rest_keep_theirs():
    ids = [
        "tests/unit/test_a.py::test_one",
        "tests/integration/test_prometheus.py::test_scrape",
        "tests/unit/test_a.py::test_two",
        "tests/integration/test_links.py::test_round",
        "tests/frameworks/test_hf_trainer.py::TestHFTrainer::test_x",
    ]
    ordered = sorted(ids, key=long_first_rank)
    assert ordered == [
        "tests/integration/test_links.py::test_round",
        "tests/integration/test_prometheus.py::test_scrape",
        "tests/frameworks/test_hf_trainer.py::TestHFTrainer::test_x",
        "tests/unit/test_a.py::test_one",
        "tests/unit/test_a.py::test_two",
    ]
