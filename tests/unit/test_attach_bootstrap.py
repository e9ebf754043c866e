"""dynprof.attach._bootstrap: the one-statement payload (binds nothing, never raises) and the
bootstrap it starts (its settings inlined as a literal, each report file written once)."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
import threading
import types
from pathlib import Path

from dynprof.attach._bootstrap import RAN_FILE, RESULT_FILE, THREAD_NAME, bootstrap_source, payload


def _inlined_config(source: str) -> object:
    tree = ast.parse(source)
    for node in tree.body:
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", None) == "_CFG":
            return ast.literal_eval(node.value)
    raise AssertionError("no _CFG in the bootstrap")


def test_the_configuration_is_inlined_as_a_literal_whatever_its_text():
    # GIVEN paths and settings with quotes, newlines, a placeholder's name and code
    config_dir = '/tmp/it\'s "here"\n__CFG__'
    home = "/opt/x'); import os; os.system('boom"
    settings = {"DYNPROF_TRACE_DIR": "a\nb", "K": "__CFG__"}
    # WHEN the bootstrap is made
    source = bootstrap_source(config_dir, home, settings, "gdb", ready_timeout=7)
    # THEN it compiles, and its configuration reads back exactly: nothing of it became code
    compile(source, "<bootstrap>", "exec")
    assert _inlined_config(source) == {
        "dir": config_dir,
        "home": home,
        "settings": settings,
        "via": "gdb",
        "ready_timeout": 7.0,
    }


def test_the_payload_is_one_statement_that_binds_nothing_and_starts_the_named_thread(monkeypatch):
    # GIVEN a payload whose source records where it runs
    probe = types.SimpleNamespace(seen=[])
    monkeypatch.setitem(sys.modules, "_bootstrap_probe", probe)
    source = (
        "import sys, threading\n"
        "t = threading.current_thread()\n"
        "sys.modules['_bootstrap_probe'].seen.append((t.name, t.daemon, __name__, 'marker' in globals()))\n"
    )
    text = payload(source)
    assert len(ast.parse(text).body) == 1
    # WHEN the main thread runs it in a namespace of the job's
    namespace = {"__builtins__": __builtins__, "marker": 1}
    before = dict(namespace)
    exec(compile(text, "<payload>", "exec"), namespace)
    for thread in threading.enumerate():
        if thread.name == THREAD_NAME:
            thread.join(5)
    # THEN it bound no name there
    assert namespace == before
    # AND the source ran once, on a daemon thread named for dynprof, in a namespace of its own
    assert probe.seen == [(THREAD_NAME, True, "__dynprof_attach__", False)]


def test_the_payload_never_raises_even_when_no_thread_can_start():
    # GIVEN a namespace whose __import__ fails (as in a process shutting down)
    def refuse(*args, **kwargs):
        raise ImportError("no imports now")

    namespace = {"__builtins__": {"__import__": refuse, "exec": exec, "BaseException": BaseException}}
    # WHEN / THEN the payload runs and swallows the failure
    exec(payload("raise SystemExit"), namespace)
    assert set(namespace) == {"__builtins__"}


def _run_bootstrap(tmp_path: Path, home: Path, runs: list[str]) -> subprocess.CompletedProcess[str]:
    """Run bootstraps (one per ``via`` in ``runs``) in a fresh isolated Python without dynprof
    on its path, one after the other on their threads."""
    report = tmp_path / "report"
    report.mkdir(exist_ok=True)
    code = "import threading\n"
    for via in runs:
        code += f"exec({payload(bootstrap_source(str(report), str(home), {}, via))!r})\n"
        code += f"[t.join(30) for t in threading.enumerate() if t.name == {THREAD_NAME!r}]\n"
    return subprocess.run([sys.executable, "-I", "-S", "-c", code], capture_output=True, text=True, timeout=60, cwd="/")


def test_a_dynprof_without_settings_is_reported_as_too_old_and_the_first_report_wins(tmp_path):
    # GIVEN a "home" holding a dynprof that predates attach (no dynprof._settings)
    home = tmp_path / "home"
    (home / "dynprof" / "proto").mkdir(parents=True)
    (home / "dynprof" / "__init__.py").write_text("__version__ = '0.0.old'\n")
    (home / "dynprof" / "agent.py").write_text("")
    (home / "dynprof" / "proto" / "__init__.py").write_text("")
    # WHEN the bootstrap runs twice in one process (the pending call after the fallback)
    out = _run_bootstrap(tmp_path, home, ["first", "second"])
    # THEN the job saw nothing, and the reports are the first run's, found through the home
    assert out.returncode == 0 and out.stdout == "" and out.stderr == ""
    ran = json.loads((tmp_path / "report" / RAN_FILE).read_text())
    result = json.loads((tmp_path / "report" / RESULT_FILE).read_text())
    assert ran["via"] == "first" and result["via"] == "first"
    assert result["ok"] is False and result["kind"] == "old-dynprof"
    assert result["dynprof_version"] == "0.0.old"
    assert result["dynprof_file"].startswith(str(home))
    assert sorted(p.name for p in (tmp_path / "report").iterdir()) == [RAN_FILE, RESULT_FILE], "no temporary left"


def test_no_dynprof_anywhere_is_reported_as_an_import_error_naming_the_module(tmp_path):
    out = _run_bootstrap(tmp_path, tmp_path / "empty-home", ["gdb"])
    assert out.returncode == 0 and out.stderr == ""
    result = json.loads((tmp_path / "report" / RESULT_FILE).read_text())
    assert result["ok"] is False and result["kind"] == "import"
    assert result["missing"] in ("dynprof", "dynprof.agent") and "ModuleNotFoundError" in result["error"]
    assert str(tmp_path / "empty-home") in result["sys_path"]
