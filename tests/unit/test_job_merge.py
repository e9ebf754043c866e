"""dynprof/job/merge.py: the nodes' answers merged into a job-wide answer (exit code, messages,
per-node envelope, artifacts, per-rank rows)."""

from __future__ import annotations

from dynprof.job import merge as job
from dynprof.job.merge import Reach
from dynprof.job.stop import Stopped
from tests.support.job_answers import A, B, FakeClient, answered, silent


def test_the_default_job_wide_answer_waits_the_options_timeout_else_the_default():
    client = FakeClient({A: answered(A, {"results": [{"rank": 0, "status": "ok"}]})})
    result = job.collect_per_rank("stop", {"job": "j"}, [A], Reach(client), 120.0, Stopped.from_json)  # type: ignore[arg-type]
    job.collect_per_rank("stop", {"timeout": 3.0}, [A], Reach(client), 120.0, Stopped.from_json)  # type: ignore[arg-type]
    assert [c[3] for c in client.calls] == [125.0, 8.0]
    assert [r["node"] for r in result.doc["results"]] == ["node-a"]


def test_a_per_rank_job_is_the_per_rank_merge_of_its_action_with_its_decoder():
    client = FakeClient({A: answered(A, {"results": [{"rank": 0, "status": "ok"}]})})
    job_wide = job.PerRankJob("stop", 120.0, Stopped.from_json)
    result = job_wide({"job": "j"}, [A], Reach(client))  # type: ignore[arg-type]
    assert [(c[1], c[3]) for c in client.calls] == [("stop", 125.0)]
    assert result.doc == job.collect_per_rank("stop", {"job": "j"}, [A], Reach(client), 120.0, Stopped.from_json).doc  # type: ignore[arg-type]


def test_exit_code_is_12_when_a_node_is_silent_else_the_highest():
    assert job.exit_code([]) == 0
    assert job.exit_code([answered(A, {}), answered(B, {}, code=8)]) == 8
    assert job.exit_code([answered(A, {}, code=8), silent(B)]) == job.NODES_FAILED_EXIT == 12


def test_a_failed_fetch_makes_a_success_exit_1_only():
    assert job.with_fetch(0, None) == 0
    assert job.with_fetch(0, [{"error": None}]) == 0
    assert job.with_fetch(0, [{"error": None}, {"error": "gone"}]) == 1
    assert job.with_fetch(8, [{"error": "gone"}]) == 8


def test_node_messages_name_each_node_bounded_and_escaped():
    many = [f"dynprof: line {i}" for i in range(job.MAX_MESSAGES_SHOWN + 3)]
    out = job.node_messages([silent(A, "timed out\x1b[2J"), answered(B, {}, messages=many), answered(A, {}, code=5)])
    assert out[0].startswith("node node-a:8787: timed out") and "\x1b" not in out[0]
    assert out[1] == "node node-b:9000: line 0"  # the node's own prefix is not repeated
    assert out[job.MAX_MESSAGES_SHOWN + 1] == "node node-b:9000: ... 3 more line(s)"
    assert out[-1] == "node node-a:8787: exit 5"


def test_envelope_keeps_each_nodes_answer_without_the_merged_lists():
    doc = job.envelope([answered(A, {"agents": [1], "kept": True}), silent(B)], strip=("agents",))
    assert doc["per_node"] == {"node-a:8787": {"kept": True}, "node-b:9000": None}
    assert [n["node"] for n in doc["nodes"]] == ["node-a:8787", "node-b:9000"]
    assert [n["answered"] for n in doc["nodes"]] == [True, False]


def test_artifacts_of_lists_the_paths_of_answered_nodes():
    answers = [answered(A, {"paths": ["/s/1", "", 7]}), silent(B)]
    rows = job.artifacts_of(answers, {A: "node-a", B: "node-b"}, lambda a: a.result["paths"])
    assert rows == [{"node": "node-a", "node_address": "node-a:8787", "path": "/s/1"}]


def test_per_rank_rows_merge_in_rank_order_with_their_node():
    answers = [
        answered(A, {"results": [{"rank": 2, "status": "ok", "artifact": "/s/2"}]}),
        answered(B, {"results": [{"rank": 0, "status": "ok", "artifact": "/s/0"}, {"rank": 1, "status": "x"}]}),
    ]
    reach = Reach(FakeClient({}))  # type: ignore[arg-type]
    result = job.per_rank_result(reach, None, [A, B], answers, Stopped.from_json, ("results",))
    assert [(r["rank"], r["node"]) for r in result.doc["results"]] == [(0, "node-b"), (1, "node-b"), (2, "node-a")]
    assert [a["path"] for a in result.doc["artifacts"]] == ["/s/2", "/s/0"]
    assert result.exit_code == 0 and result.doc["per_node"]["node-a:8787"] == {}
