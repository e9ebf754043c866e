"""The web page of an analysis artifact, rendered by a real headless Chromium.

Needs a Chromium: Debian's (`apt-get install chromium`) on the PATH as `chromium`, or the
binary named by DYNPROF_TEST_CHROMIUM. Skipped without one (CI does not install it).
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import pytest

from dynprof.cli import main

TRACES = Path(__file__).resolve().parents[1] / "unit" / "data" / "traces"


def _chromium() -> str | None:
    return os.environ.get("DYNPROF_TEST_CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")


pytestmark = pytest.mark.skipif(
    _chromium() is None,
    reason="no Chromium here: install Debian's (apt-get install chromium) or set DYNPROF_TEST_CHROMIUM",
)


def _headless(url: str, *extra: str, timeout: float = 90) -> subprocess.CompletedProcess[str]:
    profile = tempfile.mkdtemp(prefix="dp-chromium-")
    try:
        return subprocess.run(
            [
                str(_chromium()),
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


def test_analysis_page_draws_the_charts_offline(dynprof_dirs, tmp_path, capsys):
    # GIVEN an analysis artifact of a recorded 2-rank job, served by `dynprof serve`
    shutil.copytree(TRACES / "slow1", dynprof_dirs["artifacts"], dirs_exist_ok=True)
    assert main(["analyze", "--job", "fixture-slow1"]) == 0
    out = capsys.readouterr().out
    art_id = re.search(r"saved as (\S+)", out).group(1)  # type: ignore[union-attr]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = subprocess.Popen(
        [sys.executable, "-m", "dynprof", "serve", "--port", str(port)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        url = f"http://127.0.0.1:{port}/artifact/{art_id}"
        deadline = time.monotonic() + 30
        while True:
            try:
                urllib.request.urlopen(url, timeout=2).read()
                break
            except OSError:
                if time.monotonic() > deadline or server.poll() is not None:
                    raise AssertionError("dynprof serve did not answer") from None
                time.sleep(0.2)

        # WHEN headless Chromium loads the page (no network beyond the sidecar)
        dom = _headless(url, "--dump-dom")
        shot = tmp_path / "page.png"
        shot_run = _headless(url, f"--screenshot={shot}", "--window-size=1000,1400")
    finally:
        server.terminate()
        server.wait(timeout=10)

    # THEN the rendered DOM holds both SVG charts, a bar segment per category and rank, the
    # timeline lanes, the verdict, and no script; and a screenshot is drawn
    assert dom.returncode == 0, dom.stderr[-2000:]
    html = dom.stdout
    assert html.count("<svg") == 2, html[:2000]
    assert len(re.findall(r"class=\"seg outside_ops\"", html)) == 2
    assert re.search(r"class=\"lane cpu_wait\"", html)
    assert "Straggler: rank 1" in html
    assert "<script" not in html
    assert shot_run.returncode == 0, shot_run.stderr[-2000:]
    assert shot.exists() and shot.stat().st_size > 10_000
