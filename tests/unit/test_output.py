"""dynprof/output.py: text for a terminal (what other processes said, escaped; tables) and the
one-line progress display on stderr."""

from __future__ import annotations

from dynprof import output


def test_printable_escapes_what_moves_the_cursor():
    assert output.printable("job\x1b[2J") == "job\\x1b[2J"
    assert output.printable_lines("a\nb\x1b") == "a\nb\\x1b"


def test_a_table_pads_its_columns_and_escapes_its_cells():
    assert output.table([("1", "x\x1b"), ("22", None)], ["A", "B"]).splitlines() == ["A   B", "1   x\\x1b", "22"]


# -- the progress line ------------------------------------------------------------------------------
class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def monotonic(self) -> float:
        return self.now


def test_progress_on_a_terminal_rewrites_its_line(capsys):
    progress = output.Progress()
    progress.tty = True
    progress.update("step 1")
    progress.update("step 1")  # the same text: not written again
    progress.update("step 2")
    progress.done()
    assert capsys.readouterr().err == "\r\x1b[Kstep 1\r\x1b[Kstep 2\n"


def test_progress_off_a_terminal_writes_a_line_at_most_each_second(capsys, monkeypatch):
    clock = Clock()
    monkeypatch.setattr(output, "time", clock)
    progress = output.Progress()
    progress.tty = False
    progress.update("a")
    clock.now += 0.5
    progress.update("b")  # within the second: not written
    clock.now += 0.6
    progress.update("c")
    progress.done()  # no newline to end: each line ended already
    assert capsys.readouterr().err == "a\nc\n"


def test_progress_done_forgets_the_last_line(capsys):
    progress = output.Progress()
    progress.tty = True
    progress.done()  # nothing shown yet: no newline
    progress.update("x")
    progress.done()
    progress.update("x")  # after done, the same text is a new line
    assert capsys.readouterr().err == "\r\x1b[Kx\n\r\x1b[Kx"


def test_disabled_progress_writes_nothing(capsys):
    progress = output.Progress(enabled=False)
    progress.tty = True
    progress.update("a")
    progress.done()
    assert capsys.readouterr().err == ""
