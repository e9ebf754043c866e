"""The sidecar's progress book and its ``GET /metrics`` (read back with prometheus_client's own
parser), fed with progress documents as the node's agents would give them."""

from __future__ import annotations

import time
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from dynprof.sidecar.app import create_app
from dynprof.sidecar.metrics import CAPTURE_KINDS, SERIES_PER_RANK, SERIES_PER_RANK_WITH_WATCH
from dynprof.sidecar.progress import STEP_BUCKETS, ProgressBook, stall_after_s
from dynprof.store import ArtifactStore
from dynprof.watch.model import NodeProgress, RankProgress, WatchGauges

TOKEN = "metrics-test-token-0123456789"


class FakeNode:
    """What read_progress would answer, row by row, set by the test before each poll."""

    def __init__(self) -> None:
        self.rows: list[RankProgress] = []
        self.reads = 0

    def rank(self, rank: int | None, pid: int, job: str = "j", **kw: Any) -> RankProgress:
        row = RankProgress(job=job, rank=rank, world_size=2, pid=pid, host="node-1", **kw)
        self.rows.append(row)
        return row

    def read(self, records: Any, host: str, job: Any, timeout: float, every: float) -> NodeProgress:
        self.reads += 1
        return NodeProgress(host=host, time=time.time(), poll_every_s=every, ranks=[_copy(r) for r in self.rows])


def _copy(r: RankProgress) -> RankProgress:
    return RankProgress.from_json(r.to_json())  # type: ignore[return-value]


def _book(node: FakeNode, **kw: Any) -> ProgressBook:
    return ProgressBook("node-1", kw.pop("every_s", 2.0), records=lambda: [], read=node.read, **kw)


def _scrape(client: Any) -> dict[str, Any]:
    answer = client.get("/metrics", headers={"Authorization": f"Bearer {TOKEN}"})
    assert answer.status_code == 200, answer.get_data(as_text=True)
    text = answer.get_data(as_text=True)
    return {"content_type": answer.headers["Content-Type"], "text": text, "families": _families(text)}


def _families(text: str) -> dict[str, Any]:
    return {f.name: f for f in text_string_to_metric_families(text)}


def _samples(text: str) -> list[tuple[str, dict[str, str], float]]:
    return [(s.name, s.labels, s.value) for f in text_string_to_metric_families(text) for s in f.samples]


def test_steps_between_polls_fill_the_histogram_at_their_mean_duration():
    # GIVEN a rank at step 10 whose next 5 steps take 1.5 s in all (0.3 s each)
    node = FakeNode()
    row = node.rank(0, 100, step=10, last_step_at=1000.0, step_time_s=0.3)
    book = _book(node)
    book.poll()
    row.step, row.last_step_at = 15, 1001.5
    # WHEN the book polls again
    view = book.poll()
    # THEN the 5 steps are counted in the 0.3 s bucket, with their 1.5 s
    h = view.entries[("j", 0)].histogram
    assert h.count == 5 and h.total_s == pytest.approx(1.5)
    assert h.counts[STEP_BUCKETS.index(0.3)] == 5


def test_an_unresponsive_agent_keeps_its_last_steps_and_a_new_process_starts_afresh():
    # GIVEN a rank that stepped, then stopped answering (read_progress then says step 0)
    node = FakeNode()
    row = node.rank(0, 100, step=40, last_step_at=1000.0, step_time_s=0.2)
    book = _book(node)
    book.poll()
    row.step, row.last_step_at = 50, 1002.0
    book.poll()
    row.step, row.last_step_at, row.step_time_s, row.agent = 0, 0.0, 0.0, "unresponsive"
    # WHEN the book polls
    kept = book.poll().entries[("j", 0)]
    # THEN it keeps step 50 and its time, and the histogram
    assert (kept.row.step, kept.row.last_step_at, kept.row.agent) == (50, 1002.0, "unresponsive")
    assert kept.histogram.count == 10
    # WHEN another process takes rank 0's place
    node.rows = []
    node.rank(0, 200, step=1, last_step_at=2000.0)
    fresh = book.poll().entries[("j", 0)]
    # THEN its counters start afresh
    assert (fresh.row.pid, fresh.row.step, fresh.histogram.count) == (200, 1, 0)


def test_a_gone_process_is_kept_a_few_polls_then_forgotten():
    # GIVEN a rank whose process ends
    node = FakeNode()
    node.rank(0, 100, step=3, last_step_at=1000.0)
    book = _book(node, forget_after=2)
    book.poll()
    node.rows = []
    # WHEN the book polls without it, three times
    views = [book.poll() for _ in range(3)]
    # THEN it is kept (as gone) for two polls, then forgotten
    assert [("j", 0) in v.entries for v in views] == [True, True, False]
    assert views[0].entries[("j", 0)].row.agent == "gone" and views[0].entries[("j", 0)].row.step == 3


def test_the_book_holds_at_most_max_ranks_and_one_process_per_rank():
    # GIVEN 5 ranks, and two processes of the same job without a rank
    node = FakeNode()
    for rank in range(5):
        node.rank(rank, 100 + rank)
    node.rank(None, 300)
    node.rank(None, 301)
    book = _book(node, max_ranks=4)
    # WHEN the book polls
    view = book.poll()
    # THEN it keeps 4 ranks and counts what it dropped
    assert len(view.entries) == 4 and view.dropped == 3


def test_stall_time_default_and_given():
    assert stall_after_s([], None) == 60.0
    assert stall_after_s([0.5, 1.0, 0.0], None) == 60.0
    assert stall_after_s([4.0, 5.0, 6.0], None) == 100.0
    assert stall_after_s([4.0], 7.5) == 7.5


def test_a_failed_read_leaves_the_book_as_it_was():
    # GIVEN a book with one rank, and a read that then fails
    node = FakeNode()
    node.rank(0, 100, step=1, last_step_at=1000.0)
    book = _book(node)
    before = book.poll()

    def broken(*args: Any) -> NodeProgress:
        raise RuntimeError("no /proc")

    book._read = broken  # type: ignore[assignment]
    # WHEN it polls
    after = book.poll()
    # THEN nothing is lost and nothing raised
    assert after is before


def test_metrics_exports_every_rank_with_bounded_labels(tmp_path):
    # GIVEN two ranks of a job, one stepping (0.25 s steps), one whose agent stopped answering,
    # and 3 stacks artifacts and 1 trace of the job in the store
    node = FakeNode()
    r0 = node.rank(0, 100, step=10, last_step_at=time.time() - 1, step_time_s=0.25)
    r1 = node.rank(1, 101, step=10, last_step_at=time.time() - 1, step_time_s=0.25)
    store = ArtifactStore(tmp_path / "store")
    for kind in ("stacks", "stacks", "stacks", "trace", "something-else"):
        w = store.create(kind, job="j", rank=0)
        w.write_text("x.txt", "x")
        w.finish("complete")
    book = _book(node)
    book.poll()
    r0.step, r0.last_step_at = 14, r0.last_step_at + 1.0
    r1.agent, r1.step, r1.last_step_at = "unresponsive", 0, 0.0
    book.poll()
    client = create_app(store, token=TOKEN, progress=book).test_client()

    # WHEN Prometheus scrapes /metrics
    got = _scrape(client)

    # THEN the text format is served, with every family, labels job_id/host/rank only
    assert got["content_type"].startswith("text/plain; version=0.0.4")
    fams = got["families"]
    assert {
        "dynprof_rank_steps",
        "dynprof_rank_step_seconds",
        "dynprof_rank_seconds_since_step",
        "dynprof_rank_agent_up",
        "dynprof_stall_after_seconds",
        "dynprof_captures",
        "dynprof_sidecar_info",
    } <= set(fams)
    samples = _samples(got["text"])
    assert ("dynprof_rank_steps_total", {"job_id": "j", "host": "node-1", "rank": "0"}, 14.0) in samples
    assert ("dynprof_rank_steps_total", {"job_id": "j", "host": "node-1", "rank": "1"}, 10.0) in samples
    assert ("dynprof_rank_agent_up", {"job_id": "j", "host": "node-1", "rank": "1"}, 0.0) in samples
    assert ("dynprof_rank_agent_up", {"job_id": "j", "host": "node-1", "rank": "0"}, 1.0) in samples
    bucket = {"job_id": "j", "host": "node-1", "rank": "0", "le": "0.3"}
    assert ("dynprof_rank_step_seconds_bucket", bucket, 4.0) in samples
    assert ("dynprof_rank_step_seconds_count", {"job_id": "j", "host": "node-1", "rank": "0"}, 4.0) in samples
    since = {s[1]["rank"]: s[2] for s in samples if s[0] == "dynprof_rank_seconds_since_step"}
    assert set(since) == {"0", "1"} and all(v >= 0 for v in since.values())
    assert ("dynprof_stall_after_seconds", {"job_id": "j", "host": "node-1"}, 60.0) in samples
    captures = {s[1]["kind"]: s[2] for s in samples if s[0] == "dynprof_captures_total"}
    assert captures == {"stacks": 3.0, "trace": 1.0, "other": 1.0}
    assert set(CAPTURE_KINDS) >= {"stacks", "trace", "memory", "hang", "verdict", "healthcheck"}
    labels = {k for _, labels, _ in samples for k in labels}
    assert labels <= {"job_id", "host", "rank", "kind", "le", "version"}
    # AND each rank has SERIES_PER_RANK series (15)
    per_rank = [s for s in samples if s[1].get("rank") == "0"]
    assert len(per_rank) == SERIES_PER_RANK == 15


def test_metrics_needs_the_token(tmp_path):
    # GIVEN a sidecar with a token
    client = create_app(ArtifactStore(tmp_path / "s"), token=TOKEN).test_client()
    # WHEN /metrics is asked without it, with a wrong one, with it
    # THEN 401, 401, 200
    assert client.get("/metrics").status_code == 401
    assert client.get("/metrics", headers={"Authorization": "Bearer wrong-token-0123456789"}).status_code == 401
    assert client.get("/metrics", headers={"Authorization": f"Bearer {TOKEN}"}).status_code == 200


def test_a_gone_rank_is_neither_down_nor_stalled(tmp_path):
    # GIVEN a job whose one rank ended after stepping
    node = FakeNode()
    node.rank(0, 100, step=7, last_step_at=time.time() - 500)
    book = _book(node)
    book.poll()
    node.rows = []
    book.poll()
    # WHEN scraped
    samples = _samples(
        _scrape(create_app(ArtifactStore(tmp_path / "s"), token=TOKEN, progress=book).test_client())["text"]
    )
    # THEN its steps stay readable, but no agent-up nor since-step series speaks of it
    names = {s[0] for s in samples if s[1].get("rank") == "0"}
    assert "dynprof_rank_steps_total" in names
    assert not names & {"dynprof_rank_agent_up", "dynprof_rank_seconds_since_step"}


def test_stall_after_given_is_exported_for_every_job(tmp_path):
    node = FakeNode()
    node.rank(0, 100, job="a", step=1, last_step_at=time.time(), step_time_s=10.0)
    node.rank(0, 101, job="b", step=1, last_step_at=time.time(), step_time_s=10.0)
    for given, expected in ((None, 200.0), (5.0, 5.0)):
        book = _book(node, stall_after=given)
        book.poll()
        samples = _samples(
            _scrape(create_app(ArtifactStore(tmp_path / "s"), token=TOKEN, progress=book).test_client())["text"]
        )
        stall = {s[1]["job_id"]: s[2] for s in samples if s[0] == "dynprof_stall_after_seconds"}
        assert stall == {"a": expected, "b": expected}


def test_the_watch_gauges_of_a_hosted_watch(tmp_path):
    # GIVEN a hosted watch (a fake) that says job j stalled, with scores and verdicts
    node = FakeNode()
    node.rank(0, 100, step=1, last_step_at=time.time())
    book = _book(node)
    book.poll()
    gauges = [
        WatchGauges(
            "j", stalled=True, straggler_scores={("node-1", 0): 0.0, ("node-2", 5): 0.31}, verdicts={"hang": 2}
        ),
        WatchGauges("k", verdicts={"no-such-kind": 9}),
    ]
    client = create_app(
        ArtifactStore(tmp_path / "s"), token=TOKEN, progress=book, watch_gauges=lambda: gauges
    ).test_client()
    # WHEN scraped
    samples = _samples(_scrape(client)["text"])
    # THEN stalled, scores and verdict counts are there (unknown verdict kinds are not)
    assert ("dynprof_watch_stalled", {"job_id": "j"}, 1.0) in samples
    assert ("dynprof_watch_stalled", {"job_id": "k"}, 0.0) in samples
    assert ("dynprof_watch_straggler_score", {"job_id": "j", "host": "node-2", "rank": "5"}, 0.31) in samples
    assert ("dynprof_watch_verdicts_total", {"job_id": "j", "kind": "hang"}, 2.0) in samples
    assert not [s for s in samples if s[0] == "dynprof_watch_verdicts_total" and s[1]["job_id"] == "k"]
    # AND a rank has SERIES_PER_RANK_WITH_WATCH series (16) when the watch scores it
    assert SERIES_PER_RANK_WITH_WATCH == 16


def test_a_failing_watch_does_not_take_the_scrape_down(tmp_path):
    def broken() -> list[WatchGauges]:
        raise RuntimeError("watch failed")

    node = FakeNode()
    node.rank(0, 100, step=1, last_step_at=time.time())
    book = _book(node)
    book.poll()
    client = create_app(ArtifactStore(tmp_path / "s"), token=TOKEN, progress=book, watch_gauges=broken).test_client()
    fams = _scrape(client)["families"]
    assert "dynprof_rank_steps" in fams and not fams["dynprof_watch_stalled"].samples


def test_the_store_is_scanned_at_most_once_per_ttl(tmp_path):
    # GIVEN a sidecar and its store
    node = FakeNode()
    node.rank(0, 100, step=1, last_step_at=time.time())
    book = _book(node)
    book.poll()
    store = ArtifactStore(tmp_path / "s")
    calls = []
    scan = store.scan

    def counted(*a: Any, **kw: Any) -> Any:
        calls.append(1)
        return scan(*a, **kw)

    store.scan = counted  # type: ignore[method-assign]
    client = create_app(store, token=TOKEN, progress=book).test_client()
    # WHEN scraped five times in a row
    for _ in range(5):
        _scrape(client)
    # THEN the store was read once
    assert len(calls) == 1


def test_progress_answers_from_a_fresh_book_without_asking_the_agents(tmp_path):
    # GIVEN a book polled just now, its rank's agent since unresponsive
    node = FakeNode()
    row = node.rank(0, 100, step=9, last_step_at=time.time() - 2, step_time_s=0.1)
    book = _book(node, every_s=600.0)  # fresh for 20 minutes: however slow the machine
    book.poll()
    row.agent, row.step = "unresponsive", 0
    book.poll()
    client = create_app(ArtifactStore(tmp_path / "s"), token=TOKEN, progress=book).test_client()
    reads = node.reads
    # WHEN /api/progress is asked
    doc = NodeProgress.from_json(
        client.get("/api/progress?job=j", headers={"Authorization": f"Bearer {TOKEN}"}).get_json()
    )
    # THEN it answers from the book: the last known step, no read made
    assert node.reads == reads
    (rank,) = doc.ranks
    assert (rank.step, rank.agent, rank.pid) == (9, "unresponsive", 100)
    assert rank.last_step_age_s is not None and rank.last_step_age_s >= 2
    assert doc.poll_every_s == 600.0


def test_progress_fresh_reads_the_agents_now_even_from_a_fresh_book(tmp_path):
    # GIVEN a book polled just now (fresh for 20 minutes), the rank having stepped since
    node = FakeNode()
    row = node.rank(0, 100, step=9, last_step_at=time.time() - 2, step_time_s=0.1)
    book = _book(node, every_s=600.0)
    book.poll()
    book.on_demand_max_age_s = 0.0  # every fresh request reads (the rate bound is tested below)
    row.step = 12
    client = create_app(ArtifactStore(tmp_path / "s"), token=TOKEN, progress=book).test_client()
    auth = {"Authorization": f"Bearer {TOKEN}"}
    reads = node.reads
    # WHEN asked plainly, then with fresh=1
    plain = NodeProgress.from_json(client.get("/api/v1/progress?job=j", headers=auth).get_json())
    fresh = NodeProgress.from_json(client.get("/api/v1/progress?job=j&fresh=1", headers=auth).get_json())
    # THEN the plain answer is the book's, the fresh one a read made for it
    assert [r.step for r in plain.ranks] == [9]
    assert [r.step for r in fresh.ranks] == [12] and node.reads == reads + 1
    # AND fresh takes 0 or 1 only
    answer = client.get("/api/v1/progress?job=j&fresh=yes", headers=auth)
    assert answer.status_code == 400 and "fresh" in answer.get_json()["error"]


def test_progress_fresh_in_a_loop_reads_the_agents_at_most_once_per_interval(tmp_path):
    # GIVEN a book whose on-demand reads are bounded to one per 10 minutes
    node = FakeNode()
    node.rank(0, 100, step=1, last_step_at=time.time())
    book = _book(node, every_s=600.0)
    book.on_demand_max_age_s = 600.0
    client = create_app(ArtifactStore(tmp_path / "s"), token=TOKEN, progress=book).test_client()
    # WHEN a client asks for a fresh read ten times in a row
    for _ in range(10):
        answer = client.get("/api/v1/progress?fresh=1", headers={"Authorization": f"Bearer {TOKEN}"})
        assert answer.status_code == 200
    # THEN the agents were read once
    assert node.reads == 1


def test_without_a_poller_metrics_reads_at_most_once_a_second(tmp_path):
    # GIVEN a book without a poller
    node = FakeNode()
    node.rank(0, 100, step=1, last_step_at=time.time())
    book = _book(node, every_s=0.0)
    book.on_demand_max_age_s = 3600.0  # a far bound: however slow the machine
    client = create_app(ArtifactStore(tmp_path / "s"), token=TOKEN, progress=book).test_client()
    # WHEN scraped three times at once
    for _ in range(3):
        fams = _scrape(client)["families"]
    # THEN one read served them
    assert node.reads == 1 and fams["dynprof_rank_steps"].samples


def test_the_poller_thread_polls_and_stops():
    node = FakeNode()
    node.rank(0, 100, step=1, last_step_at=time.time())
    book = _book(node, every_s=0.2)
    book.start()
    try:
        deadline = time.monotonic() + 30
        while node.reads < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        book.stop()
    assert node.reads >= 2 and book.view().entries


@pytest.mark.parametrize(
    "argv,says",
    [
        (["--progress-every", "0.1"], "--progress-every 0.1 is below 0.2 s"),
        (["--progress-every", "-1"], "argument --progress-every:"),
        (["--stall-after", "0"], "argument --stall-after:"),
        (["--stall-after", "nan"], "argument --stall-after:"),
    ],
)
def test_serve_refuses_bad_progress_options_before_listening(argv, says, capsys):
    from dynprof.cli import main

    # WHEN serve is given a poll interval or a stall time it cannot use
    try:
        code = main(["serve", "--port", "1", *argv])
    except SystemExit as exc:  # argparse's own refusal
        code = exc.code
    # THEN it is a usage error naming the option, and nothing listens
    assert code == 2
    err = capsys.readouterr().err
    assert says in err and "serving on" not in err


def test_a_process_that_learns_its_rank_moves_rather_than_leaving_a_gone_row():
    # GIVEN a process of job j without a rank yet, then the same process with rank 3
    node = FakeNode()
    row = node.rank(None, 100, step=0)
    book = _book(node)
    book.poll()
    row.rank, row.step, row.last_step_at = 3, 1, 1000.0
    # WHEN the book polls
    view = book.poll()
    # THEN it is rank 3 only: no "none" row of it left behind as gone
    assert list(view.entries) == [("j", 3)]


def test_the_progress_read_finds_every_descendant_of_a_rank():
    # GIVEN a process with a child that has a child of its own (DataLoader workers and theirs)
    import subprocess
    import sys

    import psutil

    from dynprof.watch.progress import _children_of

    code = (
        "import subprocess, sys, time; "
        "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)']); "
        "print(p.pid, flush=True); time.sleep(600)"
    )
    top = subprocess.Popen(
        [
            sys.executable,
            "-c",
            f"import subprocess, sys; p = subprocess.Popen([sys.executable, '-c', {code!r}]); "
            "print(p.pid, flush=True); import time; time.sleep(600)",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert top.stdout is not None
        child, grandchild = int(top.stdout.readline()), int(top.stdout.readline())
        # WHEN the read looks for its descendants
        found = {p.pid for p in _children_of([top.pid])[top.pid]}
        # THEN it finds both, as psutil's own walk does
        assert found == {child, grandchild} == {p.pid for p in psutil.Process(top.pid).children(recursive=True)}
    finally:
        for p in psutil.Process(top.pid).children(recursive=True):
            p.kill()
        top.kill()
        top.wait(timeout=30)


def test_hostile_job_ids_give_a_scrape_prometheus_reads(tmp_path):
    # GIVEN ranks whose job ids hold quotes, a newline, a backslash, and two 5000-character ids
    # alike in their first 200 characters
    node = FakeNode()
    long_a, long_b = "a" * 4999 + "1", "a" * 4999 + "2"
    for pid, job in enumerate(['q"u\\ote\nnl', long_a, long_b, "ünï"]):
        node.rank(0, 100 + pid, job=job, step=1, last_step_at=time.time())
    book = _book(node)
    book.poll()
    gauges = [WatchGauges(long_a, True, {("h" * 999, 0): 1.0})]
    client = create_app(
        ArtifactStore(tmp_path / "s"), token=TOKEN, progress=book, watch_gauges=lambda: gauges
    ).test_client()
    # WHEN scraped
    samples = _samples(_scrape(client)["text"])
    # THEN Prometheus's parser reads it, each label at most 200 characters, no series twice
    jobs = {s[1]["job_id"] for s in samples if s[0] == "dynprof_rank_steps_total"}
    assert jobs == {'q"u\\ote\nnl', "a" * 200, "ünï"}
    assert all(len(v) <= 200 for _, labels, _ in samples for v in labels.values())
    keys = [(s[0], tuple(sorted(s[1].items()))) for s in samples]
    assert len(keys) == len(set(keys))


def test_the_page_shows_the_live_state_from_the_pollers_book(tmp_path):
    # GIVEN a poller's book with a rank at step 4242 (its agent since stopped answering)
    node = FakeNode()
    row = node.rank(7, 100, job="pagejob", step=4242, last_step_at=time.time() - 3, step_time_s=0.1)
    book = _book(node, every_s=600.0)  # fresh for 20 minutes: however slow the machine
    book.poll()
    row.agent, row.step = "unresponsive", 0
    book.poll()
    client = create_app(ArtifactStore(tmp_path / "s"), token=TOKEN, progress=book).test_client()
    reads = node.reads
    # WHEN the page is asked
    page = client.get("/", headers={"Authorization": f"Bearer {TOKEN}"}).get_data(as_text=True)
    # THEN its live state is the book's (the last known step), without a read
    assert "pagejob" in page and "4242" in page
    assert node.reads == reads


def test_every_progress_and_metrics_route_needs_the_token(tmp_path):
    # GIVEN a sidecar with a token, and its routes
    app = create_app(ArtifactStore(tmp_path / "s"), token=TOKEN)
    routes = sorted(r.rule for r in app.url_map.iter_rules() if "progress" in r.rule or "metrics" in r.rule)
    assert routes == ["/api/progress", "/api/v1/progress", "/metrics"]
    client = app.test_client()
    # WHEN each is asked without the token, THEN 401 and no data
    for rule in routes:
        answer = client.get(rule)
        assert answer.status_code == 401, rule
        assert b"dynprof_rank" not in answer.get_data() and b"ranks" not in answer.get_data()
