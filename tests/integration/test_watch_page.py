"""The sidecar's page with the watch's parts, served by a real `dynprof serve` over a running
2-rank gloo job and rendered by a real headless Chromium (Debian's `chromium` on the PATH, or
the binary named by DYNPROF_TEST_CHROMIUM; skipped without one): the live state of the ranks,
the verdicts, and a verdict artifact's own page. The verdict's strings are hostile markup: they
must stay text."""

from __future__ import annotations

import re
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from urllib.parse import quote

import pytest

from dynprof.store import ArtifactStore
from dynprof.watch.html import VERDICT_FILE
from dynprof.watch.model import Culprit, Verdict
from tests._ports import free_port as _free_port
from tests.support.chromium import chromium, headless
from tests.support.serving import serve, wait_answering, write_token

PROGRAM = "tests/integration/programs/straggler_program.py"
HOSTILE = "<img src=x onerror=\"document.title='pwned'\"><b id=injected>bold</b>"
needs_chromium = pytest.mark.skipif(
    chromium() is None,
    reason="no Chromium here: install Debian's (apt-get install chromium) or set DYNPROF_TEST_CHROMIUM",
)


@pytest.fixture
def page(spawn, tmp_path) -> Iterator[dict[str, str]]:
    """A 2-rank job stepping on this node, a verdict artifact with hostile strings in the store,
    and `dynprof serve` over both: the URLs of the page and of the verdict's page."""
    master = str(_free_port())
    targets = []
    for rank in (0, 1):
        env = {"RANK": str(rank), "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": master}
        env["DYNPROF_JOB_ID"] = "pagejob"
        targets.append(spawn([PROGRAM, "--base-load-ms", "20", "--max-seconds", "120"], env=env))
    for t in targets:
        t.ready_pids(timeout=120)
    verdict = Verdict(
        kind="hang",
        job="pagejob",
        conclusion=f"rank 1 on node-{HOSTILE} is in load_batch (data.py:88) since step 12",
        detected_at=time.time() - 5,
        decided_at=time.time(),
        culprits=[Culprit(rank=1, host=f"node-{HOSTILE}", where="load_batch (data.py:88)", why="not in all_reduce")],
        ranks=[{"rank": 0, "host": "node-a", "step": 12, "last_step_age_s": 94.0, "state": "waiting in all_reduce"}],
    )
    writer = ArtifactStore().create("verdict", job="pagejob")
    with writer:
        writer.write_json(VERDICT_FILE, verdict.to_json())
        art = writer.finish("complete", summary={"kind": "hang", "conclusion": verdict.conclusion})
    port = _free_port()
    token = "watch-page-test-token-0123456789"
    server = serve(port, write_token(tmp_path / "token", token), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_answering(f"{base}/healthz", server, 60)
        yield {
            "index": f"{base}/?token={token}",
            "verdict": f"{base}/artifact/{quote(art.id)}?token={token}",
        }
    finally:
        server.terminate()
        server.wait(timeout=10)


def test_page_html_holds_live_ranks_and_the_verdict_as_text(page):
    # WHEN the page is fetched over HTTP
    with urllib.request.urlopen(page["index"], timeout=30) as resp:
        text = resp.read().decode()

    # THEN both ranks are in the live table, stepping, and the verdict's conclusion is escaped
    live = text[text.index("<table id=live>") : text.index("</table>", text.index("<table id=live>"))]
    assert live.count("data-live-pid=") == 2 and live.count(">stepping<") == 2, live
    assert "<b id=injected>" not in text and "&lt;b id=injected&gt;" in text


@needs_chromium
def test_chromium_shows_the_job_s_ranks_steps_and_verdict(page):
    # WHEN headless Chromium loads the page
    dom = headless(page["index"], "--dump-dom")

    # THEN the live table has both ranks of the job with a step, stepping; the verdict's
    # conclusion is listed; the hostile name made no element
    assert dom.returncode == 0, dom.stderr[-2000:]
    html = dom.stdout
    rows = re.findall(r"<tr data-live-pid=\"\d+\".*?</tr>", html, re.S)
    assert len(rows) == 2, html[:3000]
    for row in rows:
        assert "pagejob" in row and "stepping" in row
        step = re.search(r"<td class=\"live-step\">(\d+)</td>", row)
        assert step and int(step.group(1)) > 0, row
    assert "is in load_batch (data.py:88) since step 12" in html
    assert 'id="injected"' not in html and "&lt;b id=injected&gt;" in html
    assert "<title>dynprof</title>" in html  # the onerror handler never ran


@needs_chromium
def test_chromium_shows_a_verdict_artifact_s_conclusion_and_culprits(page):
    # WHEN headless Chromium loads the verdict artifact's page
    dom = headless(page["verdict"], "--dump-dom")

    # THEN its conclusion comes first, then its culprits, every hostile string as text
    assert dom.returncode == 0, dom.stderr[-2000:]
    html = dom.stdout
    assert "Hang: job pagejob" in html
    assert html.index('class="conclusion"') < html.index('class="culprits"')
    culprits = html[html.index('class="culprits"') :]
    assert "load_batch (data.py:88)" in culprits and "not in all_reduce" in culprits
    assert 'id="injected"' not in html and "<img" not in html
    assert "&lt;b id=injected&gt;" in html
