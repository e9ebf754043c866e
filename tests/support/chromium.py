"""A real headless Chromium for the tests of dynprof's pages (the sidecar's, the analysis's).

CI installs Debian's `chromium` (tests/unit/test_ci_programs.py); on a user's machine the page
tests skip without it, or run with the browser DYNPROF_TEST_CHROMIUM names.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile


def chromium() -> str | None:
    """The browser to drive: DYNPROF_TEST_CHROMIUM, else `chromium` on PATH (None: none)."""
    return os.environ.get("DYNPROF_TEST_CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")


def headless(url: str, *extra: str, timeout: float = 90) -> subprocess.CompletedProcess[str]:
    """One headless Chromium run over ``url`` with ``extra`` flags (``--dump-dom``,
    ``--screenshot=PATH``), in a throw-away profile."""
    profile = tempfile.mkdtemp(prefix="dp-chromium-")
    try:
        return subprocess.run(
            [
                str(chromium()),
                "--headless",
                "--no-sandbox",
                "--disable-gpu",
                "--no-first-run",
                "--disable-background-networking",
                "--disable-component-update",
                "--disable-sync",
                f"--user-data-dir={profile}",
                *extra,
                url,
            ],
            capture_output=True,
            text=True,
            timeout=timeout,
        )
    finally:
        shutil.rmtree(profile, ignore_errors=True)
