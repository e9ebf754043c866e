"""The CLI on bad input: numbers, replies and files that are wrong on purpose."""

from __future__ import annotations

import pytest

from dynprof.cli import main


@pytest.mark.parametrize("pid", ["2147483648", "9" * 200, "0", "-1", "4194305"])
def test_attach_refuses_an_out_of_range_pid_as_a_usage_error(capsys, pid):
    # GIVEN a pid no kernel hands out
    # WHEN attach is asked for it
    with pytest.raises(SystemExit) as exit_info:
        main(["attach", pid])

    # THEN it is a usage error (exit 2) naming the pid, with no traceback
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "not a valid pid" in err and "Traceback" not in err


@pytest.mark.parametrize("option", ["--wait", "--ready-timeout"])
@pytest.mark.parametrize("value", ["nan", "inf", "-1", "1e400"])
def test_attach_refuses_non_finite_waits(capsys, option, value):
    with pytest.raises(SystemExit) as exit_info:
        main(["attach", "1", option, value])
    assert exit_info.value.code == 2
    assert option in capsys.readouterr().err


@pytest.mark.parametrize("args", [["--top", "1" * 100], ["--workers", "-3"], ["--workers", "10000000"]])
def test_analyze_refuses_absurd_counts(capsys, args):
    with pytest.raises(SystemExit) as exit_info:
        main(["analyze", *args])
    assert exit_info.value.code == 2
    assert args[0] in capsys.readouterr().err
