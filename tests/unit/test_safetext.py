"""Text from nodes, agents and the environment made safe to show: the one sanitiser
(``dynprof.safetext``) and the faces that show such text through it."""

from __future__ import annotations

import os

import pytest

from dynprof import safetext

FORGED = "load_batch\nrank 0 is fine"
ESC_AND_RLO = "run\x1b[2J\u202etxt.exe"


@pytest.mark.parametrize(
    ("raw", "shown"),
    [
        ("a\nb", "a\\nb"),
        ("a\rb\tc", "a\\rb\\tc"),
        ("\x00\x07\x1b[2J", "\\x00\\x07\\x1b[2J"),
        ("del\x7f", "del\\x7f"),
        ("c1\x85\x9b", "c1\\x85\\x9b"),
        ("\u202a\u202b\u202c\u202d\u202e", "\\u202a\\u202b\\u202c\\u202d\\u202e"),
        ("\u2066\u2067\u2068\u2069", "\\u2066\\u2067\\u2068\\u2069"),
        ("line\u2028para\u2029", "line\\u2028para\\u2029"),
        ("zw\u200b\ufeff", "zw\\u200b\\ufeff"),
        ("bad\udcff", "bad\\xff"),
        ("lone\ud800", "lone\\ud800"),
        ("priv\U000f0000", "priv\\U000f0000"),
    ],
)
def test_one_line_shows_every_unprintable_character_as_its_escape(raw, shown):
    # GIVEN text holding a control, separator, bidirectional or undecodable character
    # WHEN it is made one line
    line = safetext.one_line(raw)
    # THEN each such character is its visible escape, the rest unchanged
    assert line == shown
    assert line.isprintable() and "\n" not in line
    line.encode("utf-8")  # and it can be written anywhere


def test_one_line_keeps_printable_text_as_it_is():
    # GIVEN printable text in several scripts, with spaces, quotes and a backslash
    text = 'Grüße 日本語 "q" \\ aten::mm (train.py:12) …'
    # WHEN it is made one line
    # THEN it comes back unchanged, the same object when nothing is to be done
    assert safetext.one_line(text) is text
    assert safetext.one_line(42) == "42" and safetext.one_line(None) == "None"


def test_one_line_cuts_long_text_visibly():
    # GIVEN text longer than the limit, and text whose escapes make it longer than the limit
    long = "x" * 50
    escaped = "\x1b" * 10
    # WHEN each is made one line of at most 20 characters
    cut = safetext.one_line(long, limit=20)
    cut_escapes = safetext.one_line(escaped, limit=20)
    # THEN each is cut where it reaches the limit, the cut marked with how much was left out
    assert cut == "x" * 20 + "…(+30)"
    assert cut_escapes == "\\x1b" * 5 + "…(+5)"
    # and the default limit bounds a line of a million characters, no limit bounds nothing
    assert len(safetext.one_line("y" * 1_000_000)) < safetext.MAX_LINE + 20
    assert safetext.one_line("y" * 5000, limit=None) == "y" * 5000


def test_lines_keeps_the_callers_newlines_and_escapes_the_rest():
    # GIVEN text of two lines of which the second holds an escape sequence
    # WHEN it is made printable line by line
    shown = safetext.lines("first\nsecond\x1b[31m\u202e")
    # THEN the newline stays, the rest is escaped
    assert shown == "first\nsecond\\x1b[31m\\u202e"


def test_valid_text_escapes_undecodable_bytes_stably():
    # GIVEN an environment value of bytes that are not UTF-8, as Python reads it, and as bytes
    from_env = os.fsdecode(b"bad\xff\xfe")
    # WHEN it is made valid text
    # THEN each bad byte is \xNN, the same from a str and from bytes, and valid text is unchanged
    assert safetext.valid_text(from_env) == "bad\\xff\\xfe" == safetext.valid_text(b"bad\xff\xfe")
    assert safetext.valid_text("ok ünï") == "ok ünï"
    safetext.valid_text(from_env).encode("utf-8")


# -- the renderers -----------------------------------------------------------------------------------
def _verdict():
    from dynprof.watch.model import Culprit, Verdict

    return Verdict(
        kind="hang",
        job=f"j{ESC_AND_RLO}",
        conclusion=f"rank 1 on node-b is in {FORGED}",
        detected_at=100.0,
        decided_at=101.0,
        culprits=[Culprit(rank=1, host=f"node-b{ESC_AND_RLO}", where=FORGED, why="not in the collective")],
        ranks=[{"rank": 1, "host": "node-b\n", "step": 3, "last_step_age_s": 9.0, "state": "stuck", "where": FORGED}],
        nodes_unanswered=[f"node-c\n{ESC_AND_RLO}"],
    )


def _forged_lines(text: str) -> list[str]:
    return [line for line in text.split("\n") if line.startswith("rank 0 is fine")]


def test_the_watch_verdict_text_keeps_a_forged_frame_name_on_its_line():
    # GIVEN a verdict whose frame name, job and hosts hold a newline and terminal escapes
    from dynprof.cli._watching import render_verdict
    from dynprof.watch.render import render_verdict_text

    # WHEN it is rendered as the watch prints it and as `dynprof show` shows it
    for text in (render_verdict(_verdict(), None), render_verdict_text(_verdict())):
        # THEN no line of it is the forged one; the frame name shows its newline as \n
        assert _forged_lines(text) == []
        assert "load_batch\\nrank 0 is fine" in text
        assert "\x1b" not in text and "\u202e" not in text and "\\x1b[2J\\u202e" in text
        assert len(text.split("\n")) == len(render_verdict_text(_verdict()).split("\n"))


def _stacks(function: str):
    from collectors.stacks import Frame, ProcessStacks, ThreadStack

    def process(pid, name):
        frames = [Frame(function=name, file="/tmp/t.py", line=3), Frame(function="main", file="/tmp/t.py", line=9)]
        thread = ThreadStack(tid=pid, name=f"w{ESC_AND_RLO}", main=True, frames=frames)
        return ProcessStacks(pid=pid, method="py-spy", rank=pid - 100, host="node\n", threads=[thread])

    return [process(100, function), process(101, "step"), process(102, "step")]


@pytest.mark.parametrize("view", ["process", "merged"])
def test_stacks_renderings_keep_a_forged_frame_name_on_its_line(view):
    # GIVEN three processes, one of which is in a frame whose name holds a newline and escapes
    from collectors.stacks import render_merged, render_process

    procs = _stacks(FORGED)
    # WHEN one process's dump, or the merged view (with its "differs from group 1 at"), is rendered
    text = render_process(procs[0]) if view == "process" else render_merged(procs)
    # THEN the forged name stays on its own line, escaped
    assert _forged_lines(text) == [], text
    assert "load_batch\\nrank 0 is fine" in text
    assert "\x1b" not in text and "\u202e" not in text


def _verdict_fragment() -> str:
    from dynprof.watch.html import verdict_html

    return verdict_html(_verdict())


def _live_fragment() -> str:
    from dynprof.sidecar.page import live_html
    from dynprof.watch.model import NodeProgress, RankProgress

    progress = NodeProgress(
        host="h", time=0.0, poll_every_s=1.0,
        ranks=[RankProgress(job=f"j{ESC_AND_RLO}", rank=0, world_size=1, pid=42, host="h", step=7,
                            process_state=f"s{ESC_AND_RLO}\nrank 0 is fine")],
    )  # fmt: skip
    return live_html(progress)


def _verdict_list_fragment() -> str:
    from dynprof.sidecar.page import verdict_item, verdicts_html

    item = verdict_item("j/verdict/1", {"job": ESC_AND_RLO, "summary": {"conclusion": FORGED}}, "now", None)
    return verdicts_html([item])


@pytest.mark.parametrize("render", [_verdict_fragment, _live_fragment, _verdict_list_fragment])
def test_the_pages_fragments_carry_no_raw_escape_or_override(render):
    # GIVEN a verdict, or a node's progress, whose text holds escapes, overrides and newlines
    # WHEN the page's fragment of it is rendered
    page = render()
    # THEN it carries no raw escape, override or newline of that text, each shown escaped
    assert "\x1b" not in page and "\u202e" not in page and _forged_lines(page) == [], page
    assert "\\x1b[2J\\u202e" in page


def _trace_text() -> str:
    import gzip
    import json

    from collectors import torch_trace
    from dynprof.store import ArtifactStore

    writer = ArtifactStore().create("trace", job="j", rank=0)
    events = [
        {"ph": "X", "name": "ProfilerStep#1", "ts": 0, "dur": 100, "pid": 1, "tid": 1, "cat": "user_annotation"},
        {"ph": "X", "name": FORGED, "ts": 10, "dur": 5, "pid": 1, "tid": 1, "cat": "cpu_op"},
    ]
    writer.write_bytes("trace.json.gz", gzip.compress(json.dumps({"traceEvents": events}).encode()))
    return torch_trace.render_artifact(writer.finish("complete"))[1]


def _analysis_text() -> str:
    from collectors.trace_analysis.render import render_text

    return render_text({"ranks": [], "errors": [{"rank": 0, "error": FORGED}]})


def _flight_recorder_text() -> str:
    from collectors import flight_recorder

    group = {"process_group": "0", "desc": FORGED, "family": "nccl", "ranks": [0], "per_rank": [], "hung": True}
    return flight_recorder.render_analysis({"process_groups": [{**group, "verdict": FORGED}]})


def _host_memory_text() -> str:
    from collectors import host_memory

    return host_memory.format_tensors([{"bytes": 1, "dtype": "float32", "shape": [1], "where": FORGED}])


def _memory_text() -> str:
    from collectors.memory import render

    return render.format_summary({"trigger": FORGED})


@pytest.mark.parametrize(
    "render", [_trace_text, _analysis_text, _flight_recorder_text, _host_memory_text, _memory_text]
)
def test_the_kinds_text_renderers_keep_a_forged_name_on_its_line(render, dynprof_dirs):
    # GIVEN a forged name where a kind's renderer shows text from a rank (a trace's operator,
    # an analysis's error, a flight recorder's group and verdict, a CPU tensor's place, an
    # OOM's trigger)
    # WHEN the kind renders it
    text = render()
    # THEN no line is the forged one; the name shows its newline as \n
    assert _forged_lines(text) == [], text
    assert "load_batch\\nrank 0 is fine" in text, text


@pytest.mark.parametrize(
    ("value", "word"),
    [
        ("j1", "j1"),
        ("my job", "'my job'"),
        ("it's", "'it'\\''s'"),
        ("bad\udcff", "'bad\\xff'"),
        ("a\x1b[2Jb", "$'a\\x1b[2Jb'"),
        ("\u202eevil's\\", "$'\\u202eevil\\'s\\\\'"),
        ("", "''"),
    ],
)
def test_a_shell_word_gives_the_text_back_when_pasted(value, word):
    import subprocess

    # GIVEN a job id WHEN spelled as a shell word
    got = safetext.shell_word(value)
    # THEN it is that word, and bash reads it back as the text dynprof records
    assert got == word
    out = subprocess.run(["bash", "-c", f"printf %s {got}"], capture_output=True, check=True).stdout
    assert out.decode("utf-8") == safetext.valid_text(value)
