"""dynprof.renderers: each kind's renderers are found by kind, for `dynprof show` and the web page."""

from __future__ import annotations

import importlib

import pytest

from dynprof.renderers import HTML_RENDERERS, RENDERERS


@pytest.mark.parametrize("table", [RENDERERS, HTML_RENDERERS], ids=["text", "html"])
def test_every_renderer_named_in_the_tables_exists(table: dict[str, str]) -> None:
    # GIVEN the kind -> "module:function" tables
    missing = []
    for kind, target in table.items():
        # WHEN each target is imported
        module_name, func = target.split(":")
        fn = getattr(importlib.import_module(module_name), func, None)
        if not callable(fn):
            missing.append(f"{kind}: {target}")
    # THEN every one is a function (a moved collector updates its row)
    assert missing == []
