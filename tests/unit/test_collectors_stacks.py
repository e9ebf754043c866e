"""collectors/stacks/__init__.py: the names other packages use are the package's own, the same
objects its modules define, and what it names in ``__all__`` is there."""

from __future__ import annotations

import importlib

import collectors.stacks as stacks
from collectors.stacks import artifact, model, readers, render

# `collectors.stacks.merge` the attribute is the function; the module is reached by its name.
merge = importlib.import_module("collectors.stacks.merge")


def test_every_name_in_all_is_importable_from_the_package():
    # GIVEN the package's __all__
    # WHEN each name is looked up on the package
    missing = [name for name in stacks.__all__ if not hasattr(stacks, name)]
    # THEN none is missing, and none is listed twice
    assert missing == []
    assert len(set(stacks.__all__)) == len(stacks.__all__)


def test_the_packages_names_are_the_objects_its_modules_define():
    # GIVEN the modules each name comes from
    where = {
        "load_processes": artifact,
        "render_artifact": artifact,
        "write_request_artifact": artifact,
        "Source": merge,
        "group_processes": merge,
        "merge": merge,
        "CaptureError": readers,
        "parse_faulthandler": readers,
        "capture_py_spy": readers,
        "render_merged": render,
        "render_process": render,
        "from_json": model,
        "read_document": model,
        "Budget": model,
        "ProcessStacks": model,
    }
    # WHEN each is compared with its module's
    # THEN each is the very same object (no stale copy)
    for name, module in where.items():
        assert getattr(stacks, name) is getattr(module, name), name


def test_the_kinds_are_the_ones_show_renders():
    assert (stacks.KIND, stacks.HANG_KIND) == ("stacks", "hang")


def test_all_lists_no_private_name():
    # GIVEN the package's public list, THEN it holds no private name
    assert not [name for name in stacks.__all__ if name.startswith("_")]
