"""Noticing the job's default process group (dynprof/agent/_pg_watch.py): the job's own
``init_process_group`` runs first and its result is returned untouched, then the listeners; a
failing listener never reaches the job; wrapped once, under both names torch exports; installed
at once when torch.distributed is loaded, else when it gets imported."""

from __future__ import annotations

import logging
import sys
import types

from dynprof.agent._pg_watch import C10D_MODULE, ProcessGroupWatch
from dynprof.agent._post_import import PostImportFinder


def _c10d(calls: list) -> types.ModuleType:
    module = types.ModuleType(C10D_MODULE)

    def init_process_group(*args, **kwargs):
        calls.append(("job", args, kwargs))
        return "the job's result"

    module.init_process_group = init_process_group  # type: ignore[attr-defined]
    return module


def test_the_jobs_call_runs_first_and_its_result_is_returned_then_the_listeners(monkeypatch):
    # GIVEN a loaded c10d module and a watch with a listener
    calls: list = []
    module = _c10d(calls)
    monkeypatch.delitem(sys.modules, "torch.distributed", raising=False)
    watch = ProcessGroupWatch()
    watch.listeners.append(lambda: calls.append("listener"))

    # WHEN it wraps the module and the job creates its group
    watch.wrap(module)
    result = module.init_process_group("gloo", rank=0)

    # THEN the job's function ran with its arguments, then the listener, and its result came back
    assert calls == [("job", ("gloo",), {"rank": 0}), "listener"]
    assert result == "the job's result"
    assert module.init_process_group.__name__ == "init_process_group", "the wrapper looks like the job's function"


def test_a_module_is_wrapped_once_and_torch_distributeds_name_too(monkeypatch):
    # GIVEN c10d and torch.distributed (which re-exports init_process_group), both loaded
    calls: list = []
    module = _c10d(calls)
    package = types.ModuleType("torch.distributed")
    package.init_process_group = module.init_process_group  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "torch.distributed", package)
    watch = ProcessGroupWatch()
    watch.listeners.append(lambda: calls.append("listener"))

    # WHEN wrapped twice, and the job calls the name it imported from torch.distributed
    watch.wrap(module)
    watch.wrap(module)
    package.init_process_group()

    # THEN the listener ran once: one wrapper, under both names
    assert calls.count("listener") == 1
    assert module.init_process_group.__dynprof_wrapped__ and package.init_process_group.__dynprof_wrapped__


def test_a_failing_listener_never_reaches_the_job_and_the_others_still_run(monkeypatch, caplog):
    # GIVEN a failing listener and a working one
    calls: list = []
    module = _c10d(calls)
    monkeypatch.delitem(sys.modules, "torch.distributed", raising=False)
    watch = ProcessGroupWatch()

    def fails() -> None:
        raise RuntimeError("listener bug")

    watch.listeners += [fails, lambda: calls.append("listener")]
    watch.wrap(module)

    # WHEN the job creates its group
    with caplog.at_level(logging.INFO, logger="dynprof.agent"):
        result = module.init_process_group()

    # THEN the job got its result, the other listener ran, and the failure is in the agent's log only
    assert result == "the job's result" and calls[-1] == "listener"
    assert "process group listener failed" in caplog.text


def test_install_wraps_a_loaded_module_at_once_and_only_once(monkeypatch):
    # GIVEN c10d already imported
    calls: list = []
    module = _c10d(calls)
    monkeypatch.setitem(sys.modules, C10D_MODULE, module)
    monkeypatch.delitem(sys.modules, "torch.distributed", raising=False)
    monkeypatch.setattr(sys, "meta_path", list(sys.meta_path))
    watch = ProcessGroupWatch()

    # WHEN installed twice
    watch.install()
    first = module.init_process_group
    watch.install()

    # THEN the module's function is the wrapper, wrapped once, and no import hook was added
    assert getattr(first, "__dynprof_wrapped__", False) and module.init_process_group is first
    assert not any(isinstance(f, PostImportFinder) for f in sys.meta_path)


def test_install_before_torch_waits_for_the_import(monkeypatch):
    # GIVEN c10d not imported yet
    monkeypatch.delitem(sys.modules, C10D_MODULE, raising=False)
    monkeypatch.setattr(sys, "meta_path", list(sys.meta_path))
    watch = ProcessGroupWatch()

    # WHEN installed
    watch.install()

    # THEN an import hook for that module is first in line, calling the watch's wrap
    finder = sys.meta_path[0]
    assert isinstance(finder, PostImportFinder)
    assert finder.name == C10D_MODULE and finder.callback == watch.wrap
