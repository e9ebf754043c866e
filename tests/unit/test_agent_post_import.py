"""dynprof.agent._post_import: a hook that runs right after the job imports a module."""

from __future__ import annotations

import sys

from dynprof.agent._post_import import PostImportFinder


def test_the_post_import_finder_calls_back_after_the_module_ran_and_steps_aside(tmp_path, monkeypatch):
    # GIVEN a module not yet imported and a finder waiting for it
    (tmp_path / "dp_steps_target.py").write_text("VALUE = 42\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "dp_steps_target", raising=False)
    seen: list[int] = []
    finder = PostImportFinder("dp_steps_target", lambda module: seen.append(module.VALUE))
    monkeypatch.setattr(sys, "meta_path", [finder, *sys.meta_path])

    # WHEN the job imports it
    import dp_steps_target  # type: ignore[import-not-found]

    # THEN the callback saw the module's own names, and the finder left the import system
    assert seen == [42] and dp_steps_target.VALUE == 42
    assert finder not in sys.meta_path
    monkeypatch.delitem(sys.modules, "dp_steps_target")
