"""dynprof.arguments: every number, pid, port, host and file name a person types, checked at the edge."""

from __future__ import annotations

import argparse

import pytest

from dynprof.arguments import (
    MAX_PATH_BYTES,
    MAX_PID,
    MAX_SECONDS,
    bounded_int,
    host_arg,
    nonnegative_float,
    parse_float,
    parse_int,
    parse_pid,
    parse_pids,
    path_arg,
    port,
    positive_float,
    seconds,
)

Bad = argparse.ArgumentTypeError


def test_parse_int_takes_base_10_in_range_with_spaces_around():
    assert parse_int(" 42 ", 0, 100) == 42
    assert parse_int("0", 0, 100) == 0
    assert parse_int("100", 0, 100) == 100


@pytest.mark.parametrize("text", ["0x10", "1.5", "", "ten", "1e3", "1_000", "\u0663", "\uff15", "1 2"])
def test_parse_int_refuses_what_is_not_a_base_10_integer(text):
    with pytest.raises(Bad, match="is not an integer"):
        parse_int(text, 0, 10**6)


def test_parse_int_out_of_range_names_the_range():
    with pytest.raises(Bad, match=r"101 is out of range \(0\.\.100\)"):
        parse_int("101", 0, 100)
    with pytest.raises(Bad, match=r"-1 is out of range"):
        parse_int("-1", 0, 100)


def test_a_huge_number_is_shown_cut_short_in_the_error():
    # GIVEN a 500-digit number
    text = "9" * 500
    # WHEN it is refused
    with pytest.raises(Bad) as info:
        parse_int(text, 0, 10)
    # THEN the message does not repeat it whole
    assert len(str(info.value)) < 100 and "..." in str(info.value)


def test_text_in_an_error_is_ascii_escaped():
    # GIVEN a control character and non-ASCII in a number
    with pytest.raises(Bad) as info:
        parse_int("1\x1b[2J\u00e9", 0, 10)
    # THEN the message carries them escaped, never raw
    said = str(info.value)
    assert "\x1b" not in said and "\u00e9" not in said
    assert "\\x1b" in said


@pytest.mark.parametrize("text", ["nan", "inf", "-inf", "1e400"])
def test_parse_float_refuses_what_is_not_finite(text):
    with pytest.raises(Bad, match="not a finite number"):
        parse_float(text, 0.0, 10.0)


def test_parse_float_low_bound_is_open_unless_asked():
    with pytest.raises(Bad, match=r"out of range \(0, 10\]"):
        parse_float("0", 0.0, 10.0)
    assert parse_float("0", 0.0, 10.0, low_open=False) == 0.0
    with pytest.raises(Bad, match=r"out of range \[0, 10\]"):
        parse_float("-0.5", 0.0, 10.0, low_open=False)
    assert parse_float("10", 0.0, 10.0) == 10.0
    with pytest.raises(Bad, match="out of range"):
        parse_float("10.001", 0.0, 10.0)


def test_parse_float_refuses_words_with_what_it_wanted():
    with pytest.raises(Bad, match="is not a number of seconds"):
        seconds("soon")


def test_seconds_are_positive_and_at_most_a_day():
    assert seconds("0.5") == 0.5
    assert seconds(str(MAX_SECONDS)) == MAX_SECONDS
    for text in ("0", "-1", str(MAX_SECONDS + 1)):
        with pytest.raises(Bad, match="out of range"):
            seconds(text)


def test_the_argparse_types_bound_what_they_say():
    # GIVEN the factories
    two_to_five = bounded_int(2, 5)
    up_to_three = positive_float(3.0)
    zero_to_three = nonnegative_float(3.0)
    # THEN each keeps to its bounds
    assert two_to_five("2") == 2 and two_to_five("5") == 5
    with pytest.raises(Bad):
        two_to_five("6")
    assert up_to_three("3") == 3.0
    with pytest.raises(Bad):
        up_to_three("0")
    assert zero_to_three("0") == 0.0
    with pytest.raises(Bad):
        zero_to_three("3.5")


def test_the_types_make_an_argparse_usage_error_that_names_the_option(capsys):
    # GIVEN a parser using a bounded type
    parser = argparse.ArgumentParser(prog="dynprof")
    parser.add_argument("--steps", type=bounded_int(1, 10))
    # WHEN a bad value is given
    with pytest.raises(SystemExit) as info:
        parser.parse_args(["--steps", "11"])
    # THEN exit 2, and the option and the range are named
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "--steps" in err and "1..10" in err


def test_path_arg_takes_a_name_and_refuses_empty_nul_and_too_long():
    assert path_arg("out/trace.json") == "out/trace.json"
    with pytest.raises(Bad, match="empty"):
        path_arg("")
    with pytest.raises(Bad, match="NUL"):
        path_arg("a\x00b")
    assert path_arg("a" * MAX_PATH_BYTES)
    with pytest.raises(Bad, match="longer than"):
        path_arg("a" * (MAX_PATH_BYTES + 1))
    # Bytes count, not characters: two-byte characters reach the limit at half the length
    with pytest.raises(Bad, match="longer than"):
        path_arg("\u00e9" * (MAX_PATH_BYTES // 2 + 1))


@pytest.mark.parametrize("text", ["node1", "gpu-01.cluster.local", "node1.", "10.0.0.1", "::1", "fe80::1"])
def test_host_arg_takes_addresses_and_host_names(text):
    assert host_arg(text) == text


@pytest.mark.parametrize(
    "text",
    ["", ".", "a..b", "-node", "node-", "node_1", "a b", "http://node", "node;rm", "a" * 64, "a." * 127 + "a"],
)
def test_host_arg_refuses_what_is_not_a_host_name(text):
    with pytest.raises(Bad, match="is not an IP address or a host name"):
        host_arg(text)


def test_port_is_1_to_65535():
    assert port("1") == 1 and port("65535") == 65535
    for text in ("0", "65536"):
        with pytest.raises(Bad, match="out of range"):
            port(text)
    with pytest.raises(Bad, match="is not a port number"):
        port("http")


def test_parse_pid_is_one_to_pid_max():
    assert parse_pid(" 7 ") == 7
    assert parse_pid(str(MAX_PID)) == MAX_PID
    for text in ("0", "-3", str(MAX_PID + 1)):
        with pytest.raises(Bad, match="is not a valid pid"):
            parse_pid(text)
    with pytest.raises(Bad, match="is not a pid"):
        parse_pid("self")


def test_parse_pids_reads_a_comma_list_and_skips_empty_parts():
    assert parse_pids("1, 2,,3,") == [1, 2, 3]
    with pytest.raises(Bad, match="no pid given"):
        parse_pids(" , ,")
    with pytest.raises(Bad, match="is not a pid"):
        parse_pids("1,x")


@pytest.mark.parametrize("text", ["\u0664", "\u0664.\u0665", "1_0", "\uff14"])
def test_parse_float_takes_ascii_digits_only(text):
    # GIVEN a number float() reads, written with another script's digits or underscores
    # WHEN it is given as an option THEN it is not a number
    with pytest.raises(Bad, match="is not a number"):
        parse_float(text, 0.0, 100.0)


@pytest.mark.parametrize("text", ["\u0661\u0662", "1_2", "\uff11\uff12"])
def test_a_pid_takes_ascii_digits_only(text):
    with pytest.raises(Bad, match="is not a pid"):
        parse_pid(text)
