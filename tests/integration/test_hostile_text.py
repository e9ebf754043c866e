"""Text from nodes is text: a newline, an escape sequence or a right-to-left override in a
node's frame name, host or job id never forges a line of ``dynprof show``, the sidecar's pages
or ``dynprof ps``, and never reaches them raw."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

from tests.support.records import record_doc

TOKEN = "hostile-text-token-0123456789abcdef"


def test_a_forged_frame_name_gives_one_line_in_show_and_on_the_page(cli):
    # GIVEN a verdict artifact whose culprit's frame name, host and job hold a newline, an
    # escape sequence and a right-to-left override, as a hostile node could have answered
    from dynprof.cli.serve import page_views
    from dynprof.sidecar.app import create_app
    from dynprof.store import ArtifactStore
    from dynprof.watch.conclusion import write_verdict
    from dynprof.watch.model import Culprit, Verdict

    forged = "load_batch\nrank 0 is fine"
    verdict = Verdict(
        kind="hang",
        job="j1",
        conclusion=f"rank 1 on node-b is stuck in {forged}",
        detected_at=100.0,
        decided_at=101.0,
        culprits=[Culprit(rank=1, host="node-b\x1b[2J\u202e", where=forged, why="not in the collective")],
        ranks=[{"rank": 1, "host": "node-b", "step": 3, "last_step_age_s": 9.0, "state": "stuck", "where": forged}],
    )
    path = write_verdict(verdict, None)
    art = ArtifactStore().get(path)
    # WHEN `dynprof show` shows it, and the sidecar's page and the artifact's page show it
    shown = cli("show", str(path), timeout=120)
    client = create_app(ArtifactStore(), token=TOKEN, views=page_views()).test_client()
    headers = {"Authorization": f"Bearer {TOKEN}"}
    index = client.get("/", headers=headers)
    detail = client.get(f"/artifact/{art.id}", headers=headers)
    # THEN no line of any of them is the forged line; the escapes are shown as text
    assert shown.returncode == 0, shown.stderr
    assert index.status_code == 200 and detail.status_code == 200
    for text in (shown.stdout, index.get_data(as_text=True), detail.get_data(as_text=True)):
        assert not [line for line in text.split("\n") if line.startswith("rank 0 is fine")], text
        assert "\x1b" not in text and "\u202e" not in text
    assert "load_batch\\nrank 0 is fine" in shown.stdout
    assert "\\x1b[2J\\u202e" in detail.get_data(as_text=True)


def _forge_record(pid: int, job_id: str) -> None:
    from dynprof.paths import agents_dir

    directory = agents_dir()
    directory.mkdir(parents=True, exist_ok=True)
    record = record_doc(
        pid,
        ppid=os.getpid(),
        host="node\u202e",
        rank=0,
        world_size=1,
        job_id=job_id,
        cmdline=["python", "train\x1b[2J.py"],
        started_at=time.time(),
        socket=str(directory / f"{pid}.sock"),
    )
    (directory / f"{pid}.json").write_text(json.dumps(record))


def test_the_job_ids_named_when_none_matches_are_one_line_each(cli):
    # GIVEN an agent's registration record whose job id holds a newline and an escape sequence
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        _forge_record(child.pid, "j\nrank 0 is fine\x1b[2J\u202e")
        # WHEN a command asks for another job
        shown = cli("stacks", "--job", "other", timeout=120)
    finally:
        child.kill()
        child.wait()
    # THEN it names the jobs it has, each on its own one line, escaped
    assert shown.returncode != 0
    assert not [line for line in shown.stderr.split("\n") if line.startswith("rank 0 is fine")], shown.stderr
    assert "\x1b" not in shown.stderr and "\u202e" not in shown.stderr
    assert "Jobs with agents here: j\\nrank 0 is fine\\x1b[2J\\u202e" in shown.stderr, shown.stderr


def test_ps_shows_a_forged_job_id_on_one_line(cli):
    # GIVEN an agent's registration record whose job id holds a newline and an escape sequence
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        _forge_record(child.pid, "j\n12345  trainer  0  fine")
        # WHEN `dynprof ps` lists this node's agents
        shown = cli("ps", timeout=120)
    finally:
        child.kill()
        child.wait()
    # THEN the record is one row of the table, its text escaped
    rows = [line for line in shown.stdout.split("\n") if line.strip()]
    assert len(rows) == 2, shown.stdout + shown.stderr
    assert "j\\n12345  trainer" in rows[1]
    assert "\x1b" not in shown.stdout and "\u202e" not in shown.stdout
