"""`dynprof watch` on this node's agents (no sidecar), `serve --watch`, and a job without agents."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dynprof.identity import detect
from tests._ports import free_port

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.ptrace
def test_watch_once_on_this_node_names_the_rank_that_holds_the_others(hang_job, cli):
    # GIVEN a 2-rank job: rank 0 waits in an all_reduce, rank 1 sleeps in wait_for_data
    hang_job("wjob")
    # WHEN the watch checks once, on this node's agents (with the job idle past the stall time)
    progressing = cli("watch", "--job", "wjob", "--once", "--json", "--stall-after", "60", timeout=120)
    time.sleep(2)  # the job is hung for good: this only puts its last step more than 1 s back
    out = cli("watch", "--job", "wjob", "--once", "--json", "--stall-after", "1", "--look-interval", "1", timeout=180)
    # THEN it exits with the hang code and one verdict naming rank 1 on this host
    assert progressing.returncode == 0, progressing.stderr
    (ok,) = [json.loads(line)["verdict"] for line in progressing.stdout.splitlines()]
    assert ok["kind"] == "ok" and "2 rank(s) progress" in ok["conclusion"]
    assert out.returncode == 20, out.stderr
    (event,) = [json.loads(line) for line in out.stdout.splitlines()]
    assert event["schema"] == "dynprof.watch.event" and event["schema_version"] == 1
    verdict = event["verdict"]
    host = detect().host
    assert verdict["kind"] == "hang"
    assert [(c["rank"], c["host"]) for c in verdict["culprits"]] == [(1, host)]
    assert verdict["culprits"][0]["where"].startswith("wait_for_data (")
    assert f"rank 1 on {host} is in wait_for_data" in verdict["conclusion"]
    assert set(verdict["evidence"]["healthcheck"]) == {host}
    # and the job runs without the flight recorder: the verdict says so, and no nccl artifact is left
    assert verdict["evidence"]["flight_recorder"]["note"] == "not on for this job (`dynprof run --flight-recorder`)"
    listed = cli("ls", "--job", "wjob", "--kind", "nccl", "--json")
    assert json.loads(listed.stdout)["artifacts"] == [], listed.stdout
    # and `dynprof show` prints the verdict artifact
    shown = cli("show", event["artifact"])
    assert shown.returncode == 0, shown.stderr
    assert "HANG job wjob: rank 1 on" in shown.stdout


def test_watch_of_a_job_without_agents_says_what_it_can_still_do(cli):
    # GIVEN no agent of job "nothere" on this node
    # WHEN
    out = cli("watch", "--job", "nothere", "--once")
    # THEN a clear error: what the watch needs, and what works without agents
    assert out.returncode == 5, out.stderr
    assert "no rank of job 'nothere' with a dynprof agent was found" in out.stderr
    assert "dynprof attach --job JOB" in out.stderr and "dynprof stacks --job JOB" in out.stderr


def _port_and_token(directory: Path, token: str) -> tuple[int, Path]:
    """A free loopback port (nothing listens on it once returned), and a token file of mode 0600."""
    port = free_port()
    path = directory / "token"
    path.write_text(token + "\n")
    path.chmod(0o600)
    return port, path


@pytest.mark.ptrace
def test_serve_hosts_the_watch_and_logs_its_verdict(hang_job, tmp_path):
    # GIVEN a hung 2-rank job, and a sidecar started with --watch on it
    hang_job("sjob")
    port, token = _port_and_token(tmp_path, "serve-watch-token-0123456789")
    log = tmp_path / "serve.log"
    cmd = [
        sys.executable, "-m", "dynprof", "serve", "--port", str(port), "--token-file", str(token),
        "--watch", "--job", "sjob", "--interval", "1", "--stall-after", "1", "--look-interval", "1", "--no-healthcheck",
    ]  # fmt: skip
    with open(log, "wb") as fh:
        proc = subprocess.Popen(
            cmd,
            stdout=subprocess.DEVNULL,
            stderr=fh,
            cwd=str(ROOT),
            env=dict(os.environ),
            start_new_session=True,
        )
    try:
        # WHEN it runs
        deadline = time.monotonic() + 150
        text = ""
        while time.monotonic() < deadline and "HANG job sjob" not in text:
            assert proc.poll() is None, log.read_text()
            time.sleep(0.5)
            text = log.read_text()
        # THEN its log says the verdict, naming rank 1
        assert "dynprof: watching job sjob" in text
        assert "HANG job sjob: rank 1 on" in text, text
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_serve_refuses_a_watch_without_a_job(cli):
    out = cli("serve", "--watch")
    assert out.returncode == 2 and "--watch needs --job JOB" in out.stderr


def test_watch_once_whose_only_node_does_not_answer_says_so_not_no_agent(cli, tmp_path):
    # GIVEN a node where nothing listens
    port, token = _port_and_token(tmp_path, "watch-node-token-0123456789")
    # WHEN the watch checks once through it
    out = cli("watch", "--job", "j", "--once", "--hosts", f"127.0.0.1:{port}", "--token-file", str(token))
    # THEN the node that did not answer is the verdict (exit 12), not "no agent" (exit 5)
    assert out.returncode == 12, out.stderr
    assert f"127.0.0.1:{port}" in out.stderr and "no rank of job" in out.stderr


STRAGGLER_PROGRAM = "tests/integration/programs/straggler_program.py"


def test_watch_sample_every_on_this_nodes_agents_names_the_straggler_and_prunes_its_traces(spawn, cli):
    # GIVEN a 3-rank gloo job on this node (no sidecar), rank 2 loading each batch in 130 ms
    # where the others take 100 ms
    _local_job(
        spawn,
        "wlocal-slow",
        3,
        ["--slow-ranks", "2", "--load-ms", "130", "--base-load-ms", "100", "--max-seconds", "150"],
    )

    # WHEN the watch runs on this node's agents, sampling every second, for 45 s
    out = cli(
        "watch", "--job", "wlocal-slow", "--sample-every", "1", "--interval", "1", "--stall-after", "600",
        "--no-healthcheck", "--json", "--max-seconds", "45", timeout=180,
    )  # fmt: skip

    # THEN it took samples of every rank here, and said each one
    assert out.returncode == 0, out.stderr
    events = [json.loads(line) for line in out.stdout.splitlines()]
    samples = [e["sample"] for e in events if e["event"] == "straggler_sample"]
    assert len(samples) >= KEEP_PLUS_ONE, (len(samples), out.stderr[-3000:])
    host = detect().host
    scored = [s for s in samples if {(x["host"], x["rank"]) for x in s["scores"]} == {(host, 0), (host, 1), (host, 2)}]
    assert scored, [s["note"] for s in samples]
    assert all(isinstance(s["at_step"], int) and s["at_step"] > 0 for s in scored)
    assert out.stderr.count("dynprof: watch: straggler sample at step") >= len(scored)
    # and a sample named rank 2 on this node, its cause the input pipeline, and said it as a verdict
    named = [s for s in samples if s["verdict"] is not None]
    assert any(
        (s["verdict"]["culprits"][0]["rank"], s["verdict"]["culprits"][0]["host"]) == (2, host) for s in named
    ), [s["note"] for s in samples]
    verdicts = [e["verdict"] for e in events if e["event"] == "verdict"]
    assert any(v["kind"] == "straggler" for v in verdicts)
    # and its traces did not pile up: the traces of the samples older than the latest few that
    # named no straggler are gone, those of the samples that named one are there
    older = samples[:-3]
    for s in older:
        assert s["traces"], s
        if s["verdict"] is None:
            assert not any(Path(p).exists() for p in s["traces"]), s["traces"]
        else:
            assert all(Path(p).is_dir() for p in s["traces"]), s["traces"]
            assert s["verdict"]["evidence"]["samples"]["traces"] == s["traces"]
    # (a sample still in flight as the watch stopped may have pruned, unsaid: the last two said are kept)
    for s in samples[-2:]:
        assert all(Path(p).is_dir() for p in s["traces"]), s["traces"]
    pruned = sum(1 for s in older if s["verdict"] is None)
    print(f"\nWATCH-LOCAL-SAMPLES samples={len(samples)} named={len(named)} pruned={pruned} scored={len(scored)}")


KEEP_PLUS_ONE = 4  # enough samples that some are older than the latest 3 the watch keeps


def _local_job(spawn, job: str, ranks: int, args: list[str]) -> None:
    port = str(free_port())
    targets = []
    for rank in range(ranks):
        env = {
            "RANK": str(rank),
            "WORLD_SIZE": str(ranks),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": port,
            "DYNPROF_JOB_ID": job,
        }
        cmd = ["-m", "dynprof", "run", "-q", "--", sys.executable, STRAGGLER_PROGRAM, *args]
        targets.append(spawn(cmd, under_run=False, env=env))
    for t in targets:
        t.ready_pids(timeout=120)


def test_watch_sample_every_on_this_nodes_agents_keeps_only_the_latest_samples_traces(spawn, cli):
    # GIVEN an even 2-rank gloo job on this node (no sidecar): no sample names a straggler
    _local_job(spawn, "wlocal-even", 2, ["--load-ms", "50", "--base-load-ms", "50", "--max-seconds", "150"])
    # WHEN the watch samples it every second for 30 s
    out = cli(
        "watch", "--job", "wlocal-even", "--sample-every", "1", "--interval", "1", "--stall-after", "600",
        "--no-healthcheck", "--json", "--max-seconds", "30", timeout=180,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    samples = [json.loads(line)["sample"] for line in out.stdout.splitlines() if '"straggler_sample"' in line]
    traced = [s for s in samples if s["traces"]]
    # THEN the traces of every sample but the latest few are gone from the store (but those of a
    # sample that named a straggler: on a loaded machine one rank's 50 ms sleep can overshoot by
    # a tenth, a real straggler by the rule, and its traces are kept as evidence), those of the
    # latest are there, and the store holds no more of the job's traces than those
    assert len(traced) >= KEEP_PLUS_ONE, ([s["note"] for s in samples], out.stderr[-3000:])
    older = traced[:-3]
    assert any(s["verdict"] is None for s in older), [s["verdict"]["conclusion"] for s in older]
    for s in older:
        if s["verdict"] is None:
            assert not any(Path(p).exists() for p in s["traces"]), s["traces"]
        else:
            assert all(Path(p).is_dir() for p in s["traces"]), (s["verdict"]["conclusion"], s["traces"])
    for s in traced[-2:]:
        assert all(Path(p).is_dir() for p in s["traces"]), s["traces"]
    listed = json.loads(cli("ls", "--job", "wlocal-even", "--kind", "trace", "--json").stdout)["artifacts"]
    # 2 traces for each of the latest 3 samples, for one more that was in flight as the watch
    # stopped, and for each older one that named a straggler
    named = sum(1 for s in older if s["verdict"] is not None)
    assert len(listed) <= 2 * (4 + named), listed
    print(f"\nWATCH-LOCAL-PRUNE samples={len(samples)} traced={len(traced)} traces_left={len(listed)}")


UNEVEN_PROGRAM = "tests/integration/programs/uneven_data_program.py"


@pytest.mark.ptrace
@pytest.mark.parametrize("short", [0, 1])
def test_watch_names_the_rank_that_ran_out_of_data_whatever_its_number(spawn, cli, short):
    # GIVEN a 2-rank job on this node whose rank `short` runs out of batches a step early: it
    # waits in the barrier after its loop, the other rank in the next step's all_reduce
    job = f"wuneven{short}"
    port = str(free_port())
    targets = []
    for rank in (0, 1):
        env = {"RANK": str(rank), "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}
        env["DYNPROF_JOB_ID"] = job
        cmd = ["-m", "dynprof", "run", "-q", "--", sys.executable, UNEVEN_PROGRAM, "--short-rank", str(short)]
        targets.append(spawn(cmd, under_run=False, env=env))
    targets[short].wait_for_line("END", timeout=120)
    time.sleep(2)  # the job is stuck for good: this only puts its last step more than 1 s back
    # WHEN the watch looks once, on this node's agents
    out = cli("watch", "--job", job, "--once", "--json", "--stall-after", "1", "--look-interval", "1", timeout=180)
    # THEN a hang naming the rank that left the loop, in its barrier, and only it
    assert out.returncode == 20, out.stderr
    (verdict,) = [json.loads(line)["verdict"] for line in out.stdout.splitlines()]
    host = detect().host
    assert [(c["rank"], c["host"]) for c in verdict["culprits"]] == [(short, host)], verdict["conclusion"]
    assert f"rank {short} on {host} waits in barrier at main (" in verdict["conclusion"], verdict["conclusion"]
    assert "it left the loop the others are in (a barrier after it)" in verdict["conclusion"]
    assert "the other rank waits in all_reduce at train_step (" in verdict["conclusion"]
    print(f"\nWATCH-UNEVEN short={short}: {verdict['conclusion']}")
