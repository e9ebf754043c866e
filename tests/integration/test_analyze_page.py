"""The web page of an analysis artifact, served by a real `dynprof serve`, and rendered by a
real headless Chromium where one is installed: Debian's (`apt-get install chromium`) on the
PATH as `chromium`, or the binary named by DYNPROF_TEST_CHROMIUM. The Chromium test is skipped
without one (CI does not install it)."""

from __future__ import annotations

import re
import shutil
import subprocess
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from dynprof.cli import main
from tests._ports import free_port
from tests.support.chromium import chromium, headless
from tests.support.serving import serve, wait_answering, write_token

TRACES = Path(__file__).resolve().parents[1] / "unit" / "data" / "traces"


@pytest.fixture
def analysis_page(dynprof_dirs, tmp_path, capsys) -> Iterator[str]:
    """The URL (with its token) of the page of an analysis of a recorded 2-rank job, served
    by `dynprof serve`."""
    shutil.copytree(TRACES / "slow1", dynprof_dirs["artifacts"], dirs_exist_ok=True)
    assert main(["analyze", "--job", "fixture-slow1"]) == 0
    art_id = re.search(r"saved as (\S+)", capsys.readouterr().out).group(1)  # type: ignore[union-attr]
    port = free_port()
    token = "analysis-page-test-token-0123"
    server = serve(
        port, write_token(tmp_path / "token", token), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    url = f"http://127.0.0.1:{port}/artifact/{art_id}?token={token}"
    try:
        wait_answering(url, server, 30)
        yield url
    finally:
        server.terminate()
        server.wait(timeout=10)


def test_sidecar_serves_the_charts_inline(analysis_page):
    # WHEN the page is fetched over HTTP
    with urllib.request.urlopen(analysis_page, timeout=10) as resp:
        page = resp.read().decode()

    # THEN it holds both charts inline, nothing to load from elsewhere
    assert page.count("<svg") == 2
    assert "class='seg outside_ops'" in page and "class='lane cpu_wait'" in page
    assert "<script" not in page and "src=" not in page


@pytest.mark.skipif(
    chromium() is None,
    reason="no Chromium here: install Debian's (apt-get install chromium) or set DYNPROF_TEST_CHROMIUM",
)
def test_chromium_draws_the_analysis_page_offline(analysis_page, tmp_path):
    # WHEN headless Chromium loads the page (no network beyond the sidecar)
    dom = headless(analysis_page, "--dump-dom")
    shot = tmp_path / "page.png"
    shot_run = headless(analysis_page, f"--screenshot={shot}", "--window-size=1000,1400")

    # THEN the rendered DOM holds both SVG charts, a bar segment per rank for the time outside
    # operators, the timeline lanes, the verdict, and no script; and a screenshot is drawn
    assert dom.returncode == 0, dom.stderr[-2000:]
    html = dom.stdout
    assert html.count("<svg") == 2, html[:2000]
    assert len(re.findall(r"class=\"seg outside_ops\"", html)) == 2
    assert re.search(r"class=\"lane cpu_wait\"", html)
    assert "Straggler: rank 1" in html
    assert "<script" not in html
    assert shot_run.returncode == 0, shot_run.stderr[-2000:]
    assert shot.exists() and shot.stat().st_size > 10_000
