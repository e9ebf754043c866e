"""The suite's order (tests/conftest.py): the longest tests first, every other one in its place."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tests.conftest import LONG_FIRST, ONE_WORKER_MODULES, ROOT, long_first_rank, one_worker_group


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


@pytest.mark.parametrize("module", ONE_WORKER_MODULES)
def test_every_one_worker_module_exists_and_shares_a_setup_or_a_resource(module):
    # A renamed file would silently run on several workers again (its module fixtures made twice).
    path = ROOT / module
    assert path.is_file(), module
    assert one_worker_group(f"{module}::test_x") == module


def test_a_framework_case_is_one_family_and_other_tests_are_alone():
    group = one_worker_group
    a = group("tests/frameworks/test_torch_loops.py::TestTorchLoops::test_trace[checkpoint]")
    b = group("tests/frameworks/test_torch_loops.py::TestTorchLoops::test_stacks[checkpoint]")
    other_case = group("tests/frameworks/test_torch_loops.py::TestTorchLoops::test_trace[opt_in_backward]")
    other_class = group("tests/frameworks/test_torch_loops.py::TestOwnProfiler::test_trace[checkpoint]")
    assert a == b == "tests/frameworks/test_torch_loops.py::TestTorchLoops[checkpoint]"
    assert len({a, other_case, other_class}) == 3
    assert group("tests/frameworks/test_torch_loops.py::test_plain") is None
    assert group("tests/unit/test_cli.py::test_help[ps]") is None
    assert group("tests/integration/test_watch_faults.py::test_busy[eval]") is None


def test_every_module_that_shares_a_target_is_one_workers_family():
    # On several workers, each would start its own "shared" target, and the CPU it saves is spent again.
    users = sorted(
        str(path.relative_to(ROOT))
        for path in (ROOT / "tests").rglob("test_*.py")
        if "shared_target" in _fixture_names(path)
    )
    assert users, "no module uses shared_target: this check would hold nothing"
    assert [m for m in users if m not in ONE_WORKER_MODULES] == []


def _fixture_names(path: Path) -> set[str]:
    """The parameter names of the module's test functions and fixtures (what they ask for)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    return {
        arg.arg
        for node in ast.walk(tree)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
        for arg in node.args.args
    }
