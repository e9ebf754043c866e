"""The floor's decoder of kinds' requests: a JSON object of options, each of a kind, bounded."""

from __future__ import annotations

import pytest

from dynprof import errors
from dynprof.requests import MAX_ITEMS, MAX_TEXT, read_options

SPEC = {"job": "str", "pid": "ints", "all": "bool", "n": "int", "t": "float", "names": "strs"}


def test_known_options_are_read_and_unset_ones_left_out():
    doc = {"job": "j", "pid": 7, "all": False, "n": 3, "t": 2, "names": ["a", "b"], "unset": None}
    with pytest.raises(errors.UsageError, match="unknown option 'unset'"):
        read_options(doc, SPEC, "x")
    del doc["unset"]
    got = read_options({**doc, "job": None}, SPEC, "x")
    # one item stands for a list of one; an integer is a number; None is unset
    assert got == {"pid": [7], "all": False, "n": 3, "t": 2.0, "names": ["a", "b"]}
    assert isinstance(got["t"], float)


@pytest.mark.parametrize(
    ("doc", "said"),
    [
        (None, "must be a JSON object"),
        ({"nope": 1}, "unknown option 'nope'; known: all, job, n, names, pid, t"),
        ({"n": 1.0}, "'n' must be an integer"),
        ({"n": False}, "'n' must be an integer"),
        ({"t": float("nan")}, "'t' must be a finite number"),
        ({"names": ["a", 1]}, "'names' must be a list of strings"),
        ({"names": ["a" * (MAX_TEXT + 1)]}, "'names' must be a list of strings"),
        ({"names": ["a"] * (MAX_ITEMS + 1)}, "a list of 1 to"),
        ({"job": "x" * (MAX_TEXT + 1)}, f"at most {MAX_TEXT} characters"),
    ],
)
def test_what_is_not_an_option_of_its_kind_is_a_usage_error(doc, said):
    with pytest.raises(errors.UsageError) as refused:
        read_options(doc, SPEC, "x")
    assert said in refused.value.message and refused.value.message.startswith("x: ")
