"""`dynprof memory plan --pid` against a real training process on the CPU."""

from __future__ import annotations

import json
import os

from tests._ports import free_port
from tests.conftest import ROOT

PROGRAM = "tests/integration/programs/plan_program.py"
F32 = 4


def test_memory_plan_measures_the_next_step_and_leaves_nothing_behind(spawn, cli, tmp_path):
    # GIVEN a CPU training loop of 4 blocks (width 32, batch 16) under `dynprof run`
    probe = tmp_path / "probe"
    target = spawn(
        # trains for up to 10 minutes (the fixture stops it): a loaded machine's three plans must
        # not outlast it
        [PROGRAM, "--width", "32", "--depth", "4", "--batch", "16", "--probe-file", str(probe), "--max-seconds", "600"],
        env={"PYTHONPATH": str(ROOT)},
    )
    (pid,) = target.ready_pids()

    # WHEN a plan is asked for, to save two blocks' freeable bytes
    block = 16 * 4 * 32 * F32 * 2  # the up projection's output and the GELU's, per block
    res = cli("memory", "plan", "--pid", str(pid), "--save", str(2 * block), "--json", "--timeout", "60")

    # THEN the measurement has each block's hand-computed bytes and a forward time
    assert res.returncode == 0, res.stderr + target.state(pid)
    (row,) = json.loads(res.stdout)["results"]
    assert row["status"] == "ok" and row["pid"] == pid
    plan = row["plan"]
    m = plan["measurement"]
    assert [b["name"] for b in m["blocks"]] == ["blocks.0", "blocks.1", "blocks.2", "blocks.3"]
    for b in m["blocks"]:
        assert b["freeable_bytes"] == block
        assert b["saved_bytes"] == block + 16 * 32 * F32  # and its input, which a checkpoint keeps
        assert b["forward_s"] > 0 and b["calls"] == 1
    params = (32 * 32 + 32) + 4 * (2 * 32 * 128 + 128 + 32) + (32 + 1)
    assert m["parameter_bytes"] == params * F32
    assert m["optimizer_state_bytes"] == 2 * params * F32  # Adam
    assert m["step_s"] > 0 and m["typical_step_s"] > 0
    # AND the step's memory timeline came with it (a segment per block event), and the plan
    # predicts a peak two blocks' worth under the measured one, less its margin
    assert len(m["timeline"]) >= 1 + 3 * 4 and m["peak_bytes"] == max(max(t) for t in m["timeline"])
    assert plan["status"] == "fits" and plan["plan"]["modules"], plan
    assert plan["margin_bytes"] > 0
    assert plan["plan"]["predicted_peak_bytes"] <= m["peak_bytes"] - 2 * block - plan["margin_bytes"]
    # AND the plan is kept as a memory-plan artifact that `dynprof show` renders as it was printed
    shown = cli("show", row["artifact"])
    assert shown.returncode == 0, shown.stderr
    n = len(plan["plan"]["modules"])
    assert "memory-plan artifact" in shown.stdout and f"plan: checkpoint {n} module(s): blocks." in shown.stdout, (
        shown.stdout
    )
    shown_json = json.loads(cli("show", row["artifact"], "--json").stdout)
    assert shown_json["contents"]["status"] == "fits" and len(shown_json["contents"]["modules"]) == n, shown_json

    # AND after it, the process has no forward hook, no saved-tensor hook, grad mode on
    probe.write_text("")
    (line,) = target.wait_for_line("HOOKS")
    assert line == "HOOKS forward=0 saved_tensors=False grad=True mode=False", line

    # AND the text form names the modules and how to apply them; a budget under the floor says so
    text = cli("memory", "plan", "--pid", str(pid), "--budget", "10%", "--timeout", "60")
    assert text.returncode == 0, text.stderr + target.state(pid)
    assert "no set of blocks reaches the budget" in text.stdout and "offload the optimizer state" in text.stdout
    plain = cli("memory", "plan", "--pid", str(pid), "--save", "1K", "--timeout", "60")
    assert "torch.utils.checkpoint" in plain.stdout and "blocks." in plain.stdout, plain.stderr + target.state(pid)
    assert os.path.exists(f"/proc/{pid}")  # the job goes on


def test_memory_plan_bad_arguments(cli):
    res = cli("memory", "plan", "--all")
    assert res.returncode == 2 and "--budget SIZE or --save SIZE" in res.stderr
    res = cli("memory", "plan", "--all", "--budget", "150%")
    assert res.returncode == 2 and "between 0 and 100" in res.stderr
    res = cli("memory", "plan", "--all", "--budget", "lots")
    assert res.returncode == 2 and "cannot read size" in res.stderr
    res = cli("memory", "--all", "--budget", "4G")
    assert res.returncode == 2 and "options of `dynprof memory plan`" in res.stderr
    res = cli("memory", "plan", "--all", "--budget", "4G", "--save", "1G")
    assert res.returncode == 2  # argparse: not allowed together


def _losses(lines: list[str]) -> list[str]:
    return [line.split()[2] for line in lines if line.startswith("LOSS ")]


def test_a_model_compiled_in_place_is_refused_and_its_losses_are_unchanged(spawn, cli):
    # GIVEN the same deterministic loop run twice, its blocks compiled in place (the regional
    # recipe), once alone and once under dynprof with plans asked while it trains
    args = [
        PROGRAM,
        "--compile",
        "blocks",
        "--steps",
        "150",
        "--losses",
        "--step-sleep",
        "0.05",
        "--max-seconds",
        "600",
    ]
    plain = spawn(args, under_run=False, env={"PYTHONPATH": str(ROOT)})
    measured = spawn(args, env={"PYTHONPATH": str(ROOT)})
    (pid,) = measured.ready_pids()

    # WHEN a plan is asked twice
    refusals = [cli("memory", "plan", "--pid", str(pid), "--save", "1K", "--timeout", "60") for _ in range(2)]

    # THEN each is refused, naming torch.compile and what to do instead
    for res in refusals:
        assert res.returncode != 0, res.stdout + measured.state(pid)
        assert "torch.compile" in res.stdout + res.stderr and "TORCHDYNAMO_DISABLE=1" in res.stdout + res.stderr
    # AND the job computes exactly what it computes alone: all 150 losses, bit for bit
    measured.wait_for_line("DONE", timeout=600)
    plain.wait_for_line("DONE", timeout=600)
    a, b = _losses(plain.lines), _losses(measured.lines)
    assert len(a) == 150 and a == b, (a[:5], b[:5])


def test_an_evaluation_after_the_last_step_ends_the_measurement_and_the_cli_says_so(spawn, cli):
    # GIVEN a job that stops training as soon as a measurement's hooks are on (the plan armed
    # before its last optimizer step) and then evaluates until it ends
    target = spawn([PROGRAM, "--eval-when-measured", "--max-seconds", "600"], env={"PYTHONPATH": str(ROOT)})
    (pid,) = target.ready_pids()

    # WHEN a plan is asked
    res = cli("memory", "plan", "--pid", str(pid), "--save", "1K", "--timeout", "120")

    # THEN the CLI answers while the job runs: the steps the plan times did not end, and why
    assert res.returncode != 0, res.stdout
    out = res.stdout + res.stderr
    assert "the steps timed before the measured one did not end: a forward ran without grad" in out, out + target.state(
        pid
    )
    assert "no listening dynprof agent" not in out
    # AND the evaluation runs with nothing of the measurement left on it
    (line,) = target.wait_for_line("EVAL")
    assert line == "EVAL forward=0 saved_tensors=False grad=False mode=False", line
    assert os.path.exists(f"/proc/{pid}")


def test_a_job_s_identical_ddp_ranks_get_one_plan_with_each_rank_s_figures(spawn, cli):
    # GIVEN a 2-rank gloo job, its model in DDP, each rank under `dynprof run` with the job's id
    port = str(free_port())
    targets = []
    for rank in (0, 1):
        env = {
            "PYTHONPATH": str(ROOT),
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": "2",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": port,
            "DYNPROF_JOB_ID": "planjob",
        }
        args = [PROGRAM, "--ddp", "--width", "32", "--depth", "4", "--batch", "512", "--max-seconds", "600"]
        targets.append(spawn(args, env=env))
    pids = [pid for t in targets for pid in t.ready_pids(timeout=120)]

    # WHEN the job's plan is asked for, for 80 % of the peak
    res = cli("memory", "plan", "--job", "planjob", "--budget", "80%", "--json", "--timeout", "120")
    text = cli("memory", "plan", "--job", "planjob", "--budget", "80%", "--timeout", "120")

    # THEN both ranks were measured, and the job has one plan for ranks 0 and 1
    assert res.returncode == 0, res.stderr + "".join(t.state(p) for t, p in zip(targets, pids))
    doc = json.loads(res.stdout)
    assert sorted(r["pid"] for r in doc["results"]) == sorted(pids)
    (job,) = doc["jobs"]
    assert job["job"] == "planjob" and job["ranks"] == [0, 1] and job["differs_from"] == [], job["how"]
    # AND it names the blocks as the user's code holds the model: no DDP `module.` before them
    plan = job["plan"]
    assert plan["status"] == "fits", plan
    assert plan["plan"]["modules"] and all(n.startswith("blocks.") for n in plan["plan"]["modules"]), plan["plan"]
    assert [b["name"] for b in plan["measurement"]["blocks"]] == [f"blocks.{i}" for i in range(4)]
    # AND it is timed by the slower rank, and each rank's own peak fits the budget with it
    step = {f["rank"]: f["typical_step_s"] or f["step_s"] for f in job["rank_figures"]}
    assert job["times_of"]["rank"] == max(step, key=lambda r: step[r])
    for f in job["rank_figures"]:
        assert f["predicted_peak_bytes"] <= plan["budget_bytes"] < f["peak_bytes"], (f, plan["budget_bytes"])
    # AND the text says it once, for both ranks, with a row per rank
    assert text.returncode == 0, text.stderr
    head = f"job planjob, ranks 0-1 (pids {', '.join(map(str, pids))}): one plan, their measured steps agree"
    assert text.stdout.startswith(head) or head in text.stdout, text.stdout
    assert text.stdout.count("plan: checkpoint ") == 1, text.stdout
    rows = text.stdout.split("each rank, measured and with the plan:\n")[1].splitlines()
    assert [r.split()[0] for r in rows[1:3]] == ["0", "1"], rows
