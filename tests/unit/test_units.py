"""Human-readable quantities (dynprof.units): sizes as people write them."""

from __future__ import annotations

import pytest

from dynprof.errors import ArtifactError
from dynprof.units import parse_size


@pytest.mark.parametrize(
    "text,value", [("1024", 1024), ("2K", 2048), ("1.5G", int(1.5 * 1024**3)), ("3MiB", 3 * 1024**2)]
)
def test_parse_size(text, value):
    assert parse_size(text) == value


def test_parse_size_rejects_garbage():
    with pytest.raises(ArtifactError):
        parse_size("lots")
