"""The project's scripts as modules: kept where unit tests still import it from; the loader is
tests/support/scripts.py."""

from __future__ import annotations

from tests.support.scripts import SCRIPTS, load_script

__all__ = ["SCRIPTS", "load_script"]
