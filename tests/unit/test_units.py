"""Human-readable quantities (dynprof.units): sizes as people write them."""

from __future__ import annotations

import pytest

from dynprof.errors import ArtifactError
from dynprof.units import ascii_float, parse_size


@pytest.mark.parametrize(
    "text,value", [("1024", 1024), ("2K", 2048), ("1.5G", int(1.5 * 1024**3)), ("3MiB", 3 * 1024**2)]
)
def test_parse_size(text, value):
    assert parse_size(text) == value


def test_parse_size_rejects_garbage():
    with pytest.raises(ArtifactError):
        parse_size("lots")


# Arabic-Indic and Devanagari digits, and underscores: int() and float() read "٤٠" as 40
OTHER_DIGITS = ["\u0664\u0660G", "\u0664\u0660", "\u096a\u0966M", "4\u0660", "1_0G", "\uff14\uff10G"]


@pytest.mark.parametrize("text", OTHER_DIGITS)
def test_parse_size_takes_ascii_digits_only(text):
    # GIVEN a size written with another script's digits WHEN parsed THEN it is refused
    with pytest.raises(ArtifactError, match="cannot read size"):
        parse_size(text)


@pytest.mark.parametrize("text", ["\u0664\u0660", "\u0664.\u0665", "1_0", "4\u00a0", "\uff14"])
def test_ascii_float_refuses_what_float_would_read(text):
    # GIVEN text that float() reads as a number WHEN read as a number a person typed THEN refused
    float(text)
    with pytest.raises(ValueError, match="ASCII digits"):
        ascii_float(text)


@pytest.mark.parametrize(("text", "value"), [("40", 40.0), (" 0.5 ", 0.5), ("-2", -2.0), ("1e3", 1000.0), (".5", 0.5)])
def test_ascii_float_reads_numbers_people_type(text, value):
    assert ascii_float(text) == value
