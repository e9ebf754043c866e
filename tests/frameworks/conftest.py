"""Real-frameworks test bed: each test class runs its jobs once (a class-scoped scenario) and
checks one property per test. Cases with ``ci=False`` run only when asked for with
``pytest -m frameworks`` (see README.md here)."""

from __future__ import annotations

import importlib.util

import pytest
from _scenario import Case, Scenario, run_scenario


def _installed(spec: str) -> bool:
    return any(importlib.util.find_spec(name) is not None for name in spec.split("|"))


# What pyproject.toml's `frameworks` extra installs; anything else (DeepSpeed) is installed by name.
FRAMEWORKS_EXTRA = ("transformers", "accelerate", "lightning")


def _install_hint(spec: str) -> str:
    first = spec.split("|")[0]
    return "pip install -e '.[frameworks]'" if first in FRAMEWORKS_EXTRA else f"pip install {first}"


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "scenario" not in metafunc.fixturenames or metafunc.cls is None:
        return
    cases: list[Case] = metafunc.cls.CASES
    params = [
        pytest.param(
            case,
            id=case.name,
            marks=([pytest.mark.slow] if case.slow else []) + ([pytest.mark.gpu] if case.gpu else []),
        )
        for case in cases
    ]
    metafunc.parametrize("scenario", params, indirect=True, scope="class")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    asked = "frameworks" in (config.getoption("markexpr", "") or "")
    for item in items:
        callspec = getattr(item, "callspec", None)
        case = callspec.params.get("scenario") if callspec is not None else None
        if isinstance(case, Case) and not case.ci and not asked:
            item.add_marker(
                pytest.mark.skip(reason="on-demand framework case: run `pytest -m frameworks tests/frameworks`")
            )


@pytest.fixture(scope="class")
def scenario(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Scenario:
    case: Case = request.param
    for spec in case.needs:
        if not _installed(spec):
            pytest.skip(f"{spec.replace('|', ' or ')} is not installed ({_install_hint(spec)})")
    return run_scenario(case, tmp_path_factory.mktemp(case.name))
