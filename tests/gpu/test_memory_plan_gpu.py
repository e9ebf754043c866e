"""The memory plan on a real GPU: its predicted peak against the peak of the checkpointed run.

Run on the GPU machine: ``pytest -m gpu tests/gpu/test_memory_plan_gpu.py -s``. It prints what
a wrong prediction is diagnosed from: the measurement (its parts, each block's freeable bytes,
casts, kept inputs and events), for each checkpointed run the predicted and real peak, where
the prediction's peak is (segment or recompute; level measured there, bytes freed, inputs
kept, untracked), and what is live at the real peak, by where it was made (a CUDA memory
history of that step). With ``DYNPROF_GPU_KEEP`` set to a folder, the measurement
(``measure-<variant>.json``, replayable with ``collectors.memory.plan.measurement.from_json``) and each
run's memory snapshot (``<variant>-<case>.pickle``: pytorch.org/memory_viz,
``torch.cuda._memory_viz``) are kept there.
"""

from __future__ import annotations

import json
import os
import pickle
from collections import defaultdict
from pathlib import Path

import pytest
import torch

from collectors.memory.plan.capture import measure_step
from collectors.memory.plan.measurement import from_json
from collectors.memory.plan.predict import predict
from collectors.memory.plan.solve import make_plan
from collectors.memory.summary import allocation_site
from tests.support.plan_models import Model, checkpointed

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("eager_process")]

MIB = 1 << 20


def _made_by(frames) -> str:
    """Where an allocation was made: the innermost operator (``at::_ops``), the autograd
    formula running it (backward has no Python frames), whether a checkpoint's recompute ran
    it, and the innermost Python frame outside torch."""
    op = formula = ""
    for f in frames or []:
        name = str(f.get("name", ""))
        if "at::_ops::" in name and not op:
            called = name.split("at::_ops::", 1)[1].split("::", 1)[0]
            op = "" if called.startswith("empty") else called  # the operator that asked for it
        elif "autograd::generated::" in name and not formula:
            formula = name.split("autograd::generated::", 1)[1].split("(", 1)[0].split("<", 1)[0]
    python = [f for f in frames or [] if str(f.get("filename", "")).endswith(".py")]
    recompute = any(f.get("name") == "recompute_fn" for f in python)
    site = allocation_site(python) if python else "(no Python frame: the autograd thread)"
    return f"{op or '?'}{' in ' + formula if formula else ''}{' (recompute)' if recompute else ''} at {site}"


def live_at_peak(snapshot: dict, device: int = 0, top: int = 25) -> tuple[int, int, list[tuple[int, int, str]]]:
    """The highest level of a memory snapshot's recorded history and what was live there:
    (bytes, event index, [(bytes, count, where made)], largest first). What was allocated
    before the recording began is one group (its level is inferred from the snapshot's live
    blocks at the end)."""
    traces = snapshot.get("device_traces") or []
    events = traces[device] if device < len(traces) else []
    end = {
        int(b["address"]): int(b["size"])
        for seg in snapshot.get("segments", [])
        if int(seg.get("device", 0) or 0) == device
        for b in seg.get("blocks", [])
        if b.get("state") == "active_allocated"
    }
    for e in reversed(events):  # back to the recording's start
        if e["action"] == "alloc":
            end.pop(int(e["addr"]), None)
        elif e["action"] == "free_completed":
            end[int(e["addr"])] = int(e["size"])
    live = {a: (size, "(allocated before the recording began)") for a, size in end.items()}
    level = sum(end.values())
    best, at, at_peak = level, -1, dict(live)
    for i, e in enumerate(events):
        addr, size = int(e.get("addr", 0)), int(e.get("size", 0))
        if e["action"] == "alloc":
            live[addr] = (size, _made_by(e.get("frames")))
            level += size
            if level > best:
                best, at, at_peak = level, i, dict(live)
        elif e["action"] == "free_completed" and addr in live:
            level -= live.pop(addr)[0]
    groups: dict[str, list[int]] = defaultdict(list)
    for size, where in at_peak.values():
        groups[where].append(size)
    rows = sorted(((sum(v), len(v), k) for k, v in groups.items()), reverse=True)
    return best, at, rows[:top]


def _describe_measurement(m, plan, budget) -> list[str]:
    lines = [
        f"measured peak {m.peak_bytes} ({m.peak_source}); budget {budget}, margin {plan['margin_bytes']}, "
        f"floor {plan['floor_bytes']}, search exact {plan['exact']}",
        f"  parameters {m.parameter_bytes}, gradients {m.gradient_bytes}, optimizer state {m.optimizer_state_bytes}, "
        f"activations {m.activation_bytes} ({m.unrecomputable_activation_bytes} no block frees), "
        f"temporaries {m.temporary_bytes}, untracked {m.untracked_bytes}, drift {m.drift_bytes}, "
        f"{len(m.timeline)} segments",
        f"  chosen {len((plan['plan'] or {}).get('modules', []))}/{len(m.blocks)}: "
        f"{sorted((plan['plan'] or {}).get('modules', []))}",
    ]
    for b in m.blocks:
        kept = sum(size for _, size, _ in b.kept_inputs)
        lines.append(
            f"  {b.name}: freeable {b.freeable_bytes} (casts {b.cast_bytes}), kept inputs {kept} "
            f"{[list(x) for x in b.kept_inputs[:4]]}, forward end {b.forward_end}, backward start "
            f"{b.backward_start} at {b.backward_start_bytes}, recompute rise {b.recompute_bytes}, "
            f"late {b.late_freeable[:4]}"
        )
    return lines


@pytest.mark.parametrize("reset_peak", [True, False], ids=["own-process", "as-the-agent"])
def test_the_predicted_peak_is_within_10_percent_of_the_real_one_and_under_the_budget(reset_peak):
    # GIVEN a small activation-heavy model on the GPU under bf16 autocast, trained a few steps
    variant = "own-process" if reset_peak else "as-the-agent"
    keep = Path(os.environ["DYNPROF_GPU_KEEP"]) if os.environ.get("DYNPROF_GPU_KEEP") else None
    print(f"\n[{variant}] allocated before the test: {torch.cuda.memory_allocated()} (another test's leftovers?)")
    torch.manual_seed(0)
    dev = torch.device("cuda")
    model = Model(256, 12, layer_norm=True).to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randn(64, 512, 256, device=dev)
    block_input = 64 * 512 * 256 * 2  # one block's bf16 input

    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(x).float().square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(3):
        step()
    torch.cuda.synchronize()

    # WHEN one step is measured (resetting the peak statistic at each block event, as in the
    # caller's own process; or never, as the agent does) and planned for 60 % of its peak
    raw = measure_step(model, opt, step, reset_peak=reset_peak)
    if keep is not None:
        keep.mkdir(parents=True, exist_ok=True)
        (keep / f"measure-{variant}.json").write_text(json.dumps(raw))
    m = from_json(raw)
    budget = int(m.peak_bytes * 0.6)
    plan = make_plan(m, budget=budget)
    print("\n".join(_describe_measurement(m, plan, budget)))
    assert plan["status"] == "fits", plan
    every = {b.name for b in m.blocks}
    figures = {}
    for label, names in (("plan", set(plan["plan"]["modules"])), ("every block", every)):
        # AND the blocks are checkpointed in a second run
        with checkpointed(model, names):
            step()
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            torch.cuda.memory._record_memory_history(max_entries=300_000)
            try:
                step()
                torch.cuda.synchronize()
                snapshot = torch.cuda.memory._snapshot()
            finally:
                torch.cuda.memory._record_memory_history(enabled=None)
        real = torch.cuda.max_memory_allocated()
        said = predict(m, names)
        figures[label] = (said["predicted_peak_bytes"], real)
        predicted = said["predicted_peak_bytes"]
        print(
            f"[{variant}] {label}: predicted {predicted}, real {real}, real - predicted {real - predicted} "
            f"({(real - predicted) / MIB:+.1f} MiB, {(real - predicted) / block_input:+.2f} block inputs, "
            f"{(real - predicted) / predicted * 100:+.2f} %)"
        )
        print(f"  the prediction's peak: {said['peak_at']}")
        high, event, rows = live_at_peak(snapshot)
        print(f"  live at the real peak ({high} bytes in the history, event {event}), by where it was made:")
        for size, count, where in rows:
            print(f"    {size:>12} {count:>4} x  {where}")
        if keep is not None:
            name = f"{variant}-{label.replace(' ', '-')}.pickle"
            with open(keep / name, "wb") as f:
                pickle.dump(snapshot, f)
            print(f"  kept {keep / name}")

    # THEN the plan's real peak is under the budget, and each real peak within 10 % of its prediction
    assert figures["plan"][1] <= budget, figures
    for predicted, real in figures.values():
        assert abs(real - predicted) <= 0.10 * predicted, figures


def test_a_plan_of_a_cuda_job_under_dynprof_run_answers_and_leaves_the_job_as_it_was(spawn, cli, tmp_path):
    # GIVEN a CUDA training loop under `dynprof run`
    from tests.conftest import ROOT

    probe = tmp_path / "probe"
    program = "tests/integration/programs/plan_program.py"
    probe_args = ["--probe-file", str(probe), "--max-seconds", "600"]
    target = spawn(
        [program, "--device", "cuda", "--width", "256", "--depth", "6", "--batch", "64", *probe_args],
        env={"PYTHONPATH": str(ROOT)},
    )
    (pid,) = target.ready_pids(timeout=240)

    # WHEN plans are asked three times (the figures made from dynprof's CUDA events, off the
    # training thread, once the GPU ran past them)
    rows = []
    for budget in ("50%", "0", "90%"):
        res = cli("memory", "plan", "--pid", str(pid), "--budget", budget, "--json", "--timeout", "120")
        assert res.returncode in (0, 1), res.stderr + target.state(pid)
        (row,) = json.loads(res.stdout)["results"]
        rows.append(row)

    # THEN each measured the six blocks on the GPU, with GPU times
    for row in rows:
        m = row["plan"]["measurement"]
        assert m["device"].startswith("cuda") and len(m["blocks"]) == 6, m
        assert all(b["forward_s"] > 0 and b["freeable_bytes"] > 0 for b in m["blocks"]), m["blocks"]
    # AND the job runs on with nothing of the measurement left on it
    probe.write_text("")
    (line,) = target.wait_for_line("HOOKS")
    assert line == "HOOKS forward=0 saved_tensors=False grad=True mode=False", line
    assert os.path.exists(f"/proc/{pid}")


@pytest.mark.parametrize("budget", ["70%", "auto"])
def test_checkpoint_on_a_cuda_job_applies_a_plan_that_fits_and_ps_shows_it(spawn, cli, budget):
    # GIVEN a CUDA loop with large activations under `dynprof run --checkpoint BUDGET`
    import sys

    from tests.conftest import ROOT

    program = "tests/integration/programs/plan_program.py"
    args = [program, "--device", "cuda", "--width", "512", "--depth", "8", "--batch", "4096", "--max-seconds", "600"]
    target = spawn(
        ["-m", "dynprof", "run", "-q", "--checkpoint", budget, "--", sys.executable, *args],
        under_run=False,
        env={"PYTHONPATH": str(ROOT)},
    )
    (pid,) = target.ready_pids(timeout=240)
    # WHEN it has measured, planned, applied and checked (or said why not)
    import time

    said = target.wait_for_line(f"dynprof: checkpoint {budget}:", timeout=300)[0]
    deadline = time.monotonic() + 300
    while True:
        ps = cli("ps", "--json")
        (row,) = [r for r in json.loads(ps.stdout)["agents"] if r["pid"] == pid]
        c = row["checkpoint"]
        if c["state"] in ("applied", "fits-already", "unreachable", "refused", "failed") or time.monotonic() > deadline:
            break
        time.sleep(1)
    # the step time against the prediction is reported (target: within 25 %), not asserted: a
    # time on a shared machine is no test
    step = c.get("verified_step_s"), c.get("predicted_step_s")
    within = "n/a" if None in step else ("yes" if abs(step[0] - step[1]) <= 0.25 * step[1] else "NO")
    row = f"CHECKPOINT-ROW {budget}: step within 25 % of the prediction: {within}; {said}\n{json.dumps(c)}"
    print("\n" + row)
    if os.environ.get("DYNPROF_GPU_ROWS"):
        with open(os.environ["DYNPROF_GPU_ROWS"], "a") as f:
            f.write(row + "\n")
    # THEN at 70 % the plan was applied on the GPU and its verified peak is under the budget;
    # `auto` fits the device (nothing to recompute for a loop this small: said, or applied under
    # the budget)
    if budget == "70%":
        assert c["state"] == "applied" and c["modules"], c
        assert c["verified_peak_bytes"] <= c["budget_bytes"], c
        assert c["verified_step_s"] > 0 and c["predicted_step_s"] > 0, c
    else:
        assert c["state"] in ("applied", "fits-already"), c
    assert os.path.exists(f"/proc/{pid}")
