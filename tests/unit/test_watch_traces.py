"""The watch's sampled traces in the store: the latest few and those that named a straggler are
kept, the others deleted (dynprof.watch.traces.SampleTraces), and a local sample that cannot
trace says why (dynprof.watch.traces.local_traces, through this node's source)."""

from __future__ import annotations

from pathlib import Path

from collectors.torch_trace.samples import prune_sample_traces
from dynprof import errors
from dynprof.store import ArtifactStore
from dynprof.watch.sources import LocalSource
from dynprof.watch.straggler.sampler import sample_stragglers
from dynprof.watch.traces import KEEP_SAMPLES, SampleTraces


def trace_artifact(store: ArtifactStore, rank: int, group: str) -> str:
    writer = store.create("trace", job="j", rank=rank, options={"group_id": group})
    writer.write_json("trace.json", {"traceEvents": []})
    return str(writer.finish("complete").path)


def test_only_the_latest_samples_and_those_that_named_a_straggler_keep_their_traces():
    # GIVEN a store with a trace that no sample wrote, and a watch's 8 samples of 2 ranks each,
    # the third of which named a straggler
    store = ArtifactStore()
    other = trace_artifact(store, 0, "by-hand")
    traces = SampleTraces(store)
    samples = [[trace_artifact(store, r, f"s{i}") for r in (0, 1)] for i in range(8)]
    removed: list[str] = []
    # WHEN each is handed to it in turn
    for i, paths in enumerate(samples):
        removed += traces.add(paths, named=(i == 2))
    # THEN the latest KEEP_SAMPLES samples' traces and the straggler's are there, the others gone
    kept = {i for i, paths in enumerate(samples) if all(Path(p).is_dir() for p in paths)}
    gone = {i for i, paths in enumerate(samples) if not any(Path(p).is_dir() for p in paths)}
    assert kept == {2, *range(8 - KEEP_SAMPLES, 8)}
    assert gone == set(range(8)) - kept
    assert sorted(removed) == sorted(p for i in gone for p in samples[i])
    # and the store lists what is left, the trace written by hand among it
    listed = {str(a.path) for a in store.list(kind="trace")}
    assert listed == {other, *(p for i in kept for p in samples[i])}


def test_a_node_keeps_its_newest_samples_and_those_named_and_deletes_no_other_trace():
    # GIVEN a node's store with a trace by hand, one of another job, and 6 samples of 2 ranks
    # (groups sample-<12 hex>, oldest first), the second of which named a straggler
    import time

    store = ArtifactStore()
    by_hand = trace_artifact(store, 0, "0123456789ab")
    other_job_writer = store.create("trace", job="k", rank=0, options={"group_id": "sample-ffffffffffff"})
    other_job_writer.write_json("trace.json", {"traceEvents": []})
    other_job = str(other_job_writer.finish("complete").path)
    groups = [f"sample-{i:012x}" for i in range(6)]
    samples = []
    for g in groups:
        samples.append([trace_artifact(store, r, g) for r in (0, 1)])
        time.sleep(0.002)  # created_at orders them
    # WHEN a new sample prunes before it starts, keeping 2 older ones and the named one
    removed = prune_sample_traces("j", 2, {groups[1]}, store)
    # THEN the newest two samples and the named one stay; the others are gone, nothing else touched
    left = {i for i, paths in enumerate(samples) if all(Path(p).is_dir() for p in paths)}
    assert left == {1, 4, 5}
    assert sorted(removed) == sorted(p for i in (0, 2, 3) for p in samples[i])
    assert Path(by_hand).is_dir() and Path(other_job).is_dir()
    # AND pruning again deletes nothing more
    assert prune_sample_traces("j", 2, {groups[1]}, store) == []


def test_a_path_outside_the_store_is_never_deleted(tmp_path):
    # GIVEN a "trace" handed over that is a directory outside the store
    outside = tmp_path / "elsewhere" / "trace-dir"
    outside.mkdir(parents=True)
    traces = SampleTraces(ArtifactStore(), keep=1)
    # WHEN it becomes an old sample's
    traces.add([str(outside)], named=False)
    removed = traces.add([], named=False)
    # THEN it is left alone
    assert removed == [] and outside.is_dir()


def _local(trace, traces: SampleTraces) -> LocalSource:
    """This node's source on host ``h``, its traces taken by ``trace`` and kept by ``traces``."""
    source = LocalSource(host="h", run_trace=trace)
    source.sample_traces = traces
    return source


def test_a_local_sample_that_cannot_trace_says_why_and_keeps_nothing():
    # GIVEN a trace that fails (no agent), and one whose ranks wrote no trace
    def no_agent(job: str, steps: int, limit_s: float) -> dict:
        raise errors.NoAgent(f"no process of job {job!r} with a dynprof agent")

    def nothing(job: str, steps: int, limit_s: float) -> dict:
        return {"results": [{"pid": 7, "rank": 0, "start_step": 12, "status": "failed", "error": "process exited"}]}

    traces = SampleTraces(ArtifactStore())
    # WHEN each is sampled
    failed = sample_stragglers(_local(no_agent, traces), "j")
    empty = sample_stragglers(_local(nothing, traces), "j")
    # THEN the notes say why, nothing is decided
    assert failed.verdict is None and "no process of job 'j' with a dynprof agent" in failed.note
    assert empty.verdict is None and empty.at_step == 12
    assert empty.note == "no trace was written: rank 0 (pid 7): process exited"
    assert empty.traces == []


def test_an_artifact_an_answer_names_that_is_not_the_samples_trace_is_neither_read_nor_deleted():
    # GIVEN a store with a verdict and another request's trace, and a trace request whose ranks'
    # answers name those as their traces
    store = ArtifactStore()
    writer = store.create("verdict", job="j")
    writer.write_json("verdict.json", {})
    verdict = str(writer.finish("complete").path)
    other = trace_artifact(store, 1, "another-request")

    def answers(job: str, steps: int, limit_s: float) -> dict:
        return {
            "group_id": "this-sample",
            "results": [
                {"pid": 7, "rank": 0, "start_step": 12, "status": "complete", "artifact": verdict},
                {"pid": 8, "rank": 1, "start_step": 12, "status": "complete", "artifact": other},
            ],
        }

    traces = SampleTraces(store, keep=1)
    # WHEN it is sampled twice (the first sample's traces would be pruned by the second)
    first = sample_stragglers(_local(answers, traces), "j")
    sample_stragglers(_local(answers, traces), "j")
    # THEN neither is taken for a trace of the sample, and both are still there
    assert first.traces == [] and first.verdict is None
    assert "rank 0 (pid 7): " in first.note and "is not a trace of this sample in the store" in first.note
    assert Path(verdict).is_dir() and Path(other).is_dir()
