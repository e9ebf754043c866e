"""dynprof.kinds: one row per kind, command and agent extension; the CLI's commands, the agent's
extensions and the renderers are read from it."""

from __future__ import annotations

import ast
import importlib
import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import pytest

from dynprof import kinds

ROOT = Path(__file__).resolve().parents[2]

# The lists as they were written by hand before the table, in their order. A row added since
# may land anywhere; what was here stays, in this order (`dynprof --help`'s order of the
# commands, the agent's order of installing its extensions).
COMMANDS_BEFORE = (
    ("run", "run", "RunCommand"),
    ("ps", "ps", "PsCommand"),
    ("nodes", "nodes", "NodesCommand"),
    ("attach", "attach", "AttachCommand"),
    ("start", "start", "StartCommand"),
    ("stop", "stop", "StopCommand"),
    ("stacks", "stacks", "StacksCommand"),
    ("nccl", "nccl", "NcclCommand"),
    ("gpu-coredump", "gpu_coredump", "GpuCoredumpCommand"),
    ("memory", "memory", "MemoryCommand"),
    ("memory-report", "memory_report", "MemoryReportCommand"),
    ("healthcheck", "healthcheck", "HealthcheckCommand"),
    ("link-test", "link_test", "LinkTestCommand"),
    ("ls", "ls", "LsCommand"),
    ("show", "show", "ShowCommand"),
    ("analyze", "analyze", "AnalyzeCommand"),
    ("watch", "watch", "WatchCommand"),
    ("serve", "serve", "ServeCommand"),
)
EXTENSIONS_BEFORE = (
    "dynprof.agent._ext_trace",
    "dynprof.agent._ext_stacks",
    "dynprof.agent._ext_memory",
    "dynprof.agent._ext_hang",
    "dynprof.agent._ext_flight",
    "dynprof.agent._ext_job_store",
)
RENDERERS_BEFORE = {
    "trace": "collectors.torch_trace:render_artifact",
    "stacks": "collectors.stacks:render_artifact",
    "hang": "collectors.stacks:render_artifact",
    "memory": "collectors.memory.render:render_artifact",
    "memory-plan": "collectors.memory.plan.render:render_artifact",
    "host-memory": "collectors.host_memory:render_artifact",
    "nccl": "collectors.flight_recorder:render_artifact",
    "analysis": "collectors.trace_analysis.render:render_artifact",
    "verdict": "dynprof.watch.render:render_artifact",
}
HTML_RENDERERS_BEFORE = {
    "analysis": "collectors.trace_analysis.html:render_html",
    "verdict": "dynprof.watch.html:render_html",
}


def _keeps(derived: Sequence[object], before: Sequence[object]) -> bool:
    """Whether ``derived`` holds every item of ``before``, once, in ``before``'s order."""
    kept = [item for item in derived if item in before]
    return kept == list(before)


def _resolve(target: str) -> object:
    module_name, _, function = target.partition(":")
    return getattr(importlib.import_module(module_name), function, None)


def _printed_by_a_fresh_interpreter(code: str) -> list[str]:
    """The words ``code`` prints, run by a fresh interpreter of this checkout."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, env=env, timeout=60)
    assert out.returncode == 0, out.stderr
    return out.stdout.split()


def test_the_derived_lists_keep_what_was_written_by_hand_in_its_order():
    # GIVEN the lists read from the table
    commands, extensions = kinds.commands(), kinds.agent_extensions()
    renderers, html_renderers = kinds.renderers(), kinds.html_renderers()

    # THEN each holds what the hand-written list held, in its order, and the renderers the same rows
    assert _keeps(commands, COMMANDS_BEFORE), commands
    assert _keeps(extensions, EXTENSIONS_BEFORE), extensions
    assert RENDERERS_BEFORE.items() <= renderers.items()
    assert HTML_RENDERERS_BEFORE.items() <= html_renderers.items()


def test_a_reordered_list_is_caught():
    # GIVEN today's commands with two swapped, and extensions with one left out
    swapped = list(COMMANDS_BEFORE)
    swapped[1], swapped[2] = swapped[2], swapped[1]

    # THEN neither keeps the list as it was; one with a row added in between does
    assert not _keeps(swapped, COMMANDS_BEFORE)
    assert not _keeps(EXTENSIONS_BEFORE[:-1], EXTENSIONS_BEFORE)
    assert _keeps((*EXTENSIONS_BEFORE[:2], "dynprof.agent._ext_gc", *EXTENSIONS_BEFORE[2:]), EXTENSIONS_BEFORE)


def test_the_names_in_use_are_the_tables():
    # GIVEN the names the CLI, the agent and the renderers have always exported
    from dynprof.agent import _agent
    from dynprof.cli import COMMANDS
    from dynprof.renderers import HTML_RENDERERS, RENDERERS

    # THEN each is the table's
    assert COMMANDS == kinds.commands()
    assert _agent.EXTENSIONS == kinds.agent_extensions()
    assert RENDERERS == kinds.renderers()
    assert HTML_RENDERERS == kinds.html_renderers()


def test_every_row_has_a_unique_name_and_something_to_register():
    names = [kind.name for kind in kinds.KINDS]
    assert len(names) == len(set(names))
    for kind in kinds.KINDS:
        assert kind.command or kind.agent_extension or kind.renderer or kind.html_renderer or kind.action, kind.name
        # an HTML view is shown above the text summary: never without it
        assert kind.html_renderer is None or kind.renderer is not None, kind.name


def test_every_command_is_a_class_of_its_module_with_a_unique_name():
    # GIVEN the commands
    commands = kinds.commands()
    assert len({name for name, _, _ in commands}) == len(commands)
    assert len({module for _, module, _ in commands}) == len(commands)
    for name, module, class_name in commands:
        # WHEN its module is imported THEN its class is there, and builds a parser
        cls = getattr(importlib.import_module(f"dynprof.cli.{module}"), class_name, None)
        assert isinstance(cls, type), f"{name}: dynprof.cli.{module}.{class_name}"
        assert callable(getattr(cls(), "prepare_parser", None)), name


def test_every_agent_extension_is_a_module_with_install():
    extensions = kinds.agent_extensions()
    assert len(set(extensions)) == len(extensions)
    for name in extensions:
        assert callable(getattr(importlib.import_module(name), "install", None)), name


@pytest.mark.parametrize("field", ["renderer", "html_renderer"])
def test_every_renderer_is_a_function_of_its_module(field: str):
    missing = [
        f"{kind.name}: {getattr(kind, field)}"
        for kind in kinds.KINDS
        if getattr(kind, field) is not None and not callable(_resolve(getattr(kind, field)))
    ]
    assert missing == []


def test_every_run_option_is_a_module_that_adds_its_pair_and_loads_after_the_listed_ones():
    from dynprof.cli import _run_options

    # GIVEN the options the rows name and the ones listed in dynprof.cli._run_options
    named = kinds.run_options()
    assert named and not set(named) & set(_run_options.LISTED)
    # WHEN a fresh interpreter loads them (as `dynprof run --help` does)
    code = (
        "from dynprof.cli import _run_options as o\n"
        "o.load_run_options()\n"
        "print('\\n'.join(add.__module__ for add, _ in o.RUN_OPTIONS))"
    )
    # THEN each module added its pair once, the listed ones first (`dynprof run --help`'s order)
    assert _printed_by_a_fresh_interpreter(code) == [*_run_options.LISTED, *named]


def test_every_action_is_a_spec_of_its_module():
    from dynprof.action_spec import ActionSpec

    named = kinds.actions()
    assert named
    for name, target in named.items():
        assert isinstance(_resolve(target), ActionSpec), f"{name}: {target}"


def test_a_row_is_frozen():
    row = kinds.KINDS[0]
    with pytest.raises(AttributeError):
        row.name = "other"  # type: ignore[misc]


def test_the_table_imports_nothing_of_dynprof():
    # GIVEN the module's source
    tree = ast.parse((ROOT / "dynprof" / "kinds.py").read_text())
    # THEN its only import is typing's NamedTuple (and annotations), which the agent imports anyway
    imported = {
        alias.name if isinstance(node, ast.Import) else str(node.module)
        for node in ast.walk(tree)
        if isinstance(node, ast.Import | ast.ImportFrom)
        for alias in node.names
    }
    assert imported <= {"__future__", "typing"}


def test_the_agent_reads_the_table_without_loading_any_kind():
    # GIVEN a fresh interpreter that imports the agent (as the start-up hook does)
    code = (
        "import sys, dynprof.agent._agent\n"
        "print('\\n'.join(sorted(m for m in sys.modules if m.startswith(('collectors', 'healthcheck', "
        "'dynprof.agent._ext', 'dynprof.cli', 'dynprof.renderers')))))\n"
        "print('kinds' if 'dynprof.kinds' in sys.modules else '')"
    )
    # THEN the table is loaded, and no kind's module, extension, command or renderer
    assert _printed_by_a_fresh_interpreter(code) == ["kinds"]
