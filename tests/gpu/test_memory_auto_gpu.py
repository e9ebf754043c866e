"""The default `auto` memory-history policy on a real GPU: what it chooses on a launch-bound
and a GPU-bound loop, and the OOM report it leaves when each of them leaks until OOM.

Run on the GPU machine: ``pytest -m gpu tests/gpu/test_memory_auto_gpu.py -s`` (prints each
OOM report and its capture time).
"""

from __future__ import annotations

import json
import time

import pytest

from collectors.memory.render import format_summary
from dynprof.client import AgentClient
from dynprof.store import ArtifactStore

pytestmark = pytest.mark.gpu

PROGRAM = "tests/integration/programs/oom_leak_program.py"
CASES = {
    # workload: (leak MiB per step, cap GiB)
    "launch": ("2", "1.5"),
    "gpu": ("128", "12"),
}


@pytest.mark.parametrize("workload", sorted(CASES))
def test_auto_policy_chooses_within_budget_and_the_oom_report_attributes_memory(spawn, workload):
    leak_mb, cap = CASES[workload]
    # GIVEN a loop under `dynprof run` with the default history policy, leaking after 4 s
    target = spawn([PROGRAM, "--workload", workload, "--warmup-seconds", "4", "--leak-mb", leak_mb, "--limit-gb", cap])
    (pid,) = target.ready_pids()

    # WHEN the agent has measured the loop at speed (its first look may be of a cold start)
    client = AgentClient.for_pid(pid)
    deadline = time.monotonic() + 60
    status = client.status()
    while time.monotonic() < deadline and not (
        "budget" in status.memory_history_detail
        and (workload != "launch" or "of the time" in status.memory_history_detail)
    ):
        time.sleep(0.2)
        status = client.status()

    # THEN it says which policy it runs and why
    assert status.memory_history == "auto", status
    print(f"\n[{workload}] agent: {status.memory_history_detail}")
    assert "budget" in status.memory_history_detail
    if workload == "launch":  # ~100 000 allocator events/s: recording all the time is over budget
        assert "of the time" in status.memory_history_detail, status.memory_history_detail

    # WHEN the loop leaks until CUDA runs out of memory
    rc = target.proc.wait(timeout=300)
    target._reader.join(timeout=5)
    out = "\n".join(target.lines)
    assert rc == 0 and any(line.startswith("OOM ") for line in target.lines), out[-3000:]

    # THEN one memory artifact holds the failing allocation, attribution and advice
    (art,) = ArtifactStore().list(kind="memory")
    summary = json.loads((art.path / "summary.json").read_text())
    failing = summary["failing_allocation"]
    assert failing["device"] == 0 and failing["requested_bytes"] > 0
    assert summary["memory_history"] == "auto"
    assert "recording" in (art.manifest["options"].get("memory_history_detail") or "")
    att = summary["attribution"]
    assert att["optimizers"] == 1 and att["parameters_bytes"] > 0 and att["optimizer_state_bytes"] > 0
    assert att["took_s"] >= 0  # reported; the figure is printed below (DESIGN: OOM capture <= 2 s)
    assert "remember" in (art.path / "stack.txt").read_text() or "train_step" in (art.path / "stack.txt").read_text()
    assert summary["size_classes"] and isinstance(summary["advice"], list)
    assert summary["capture"]["total_s"] >= 0
    print(f"\n[{workload}] OOM capture {summary['capture']['total_s']} s, attribution {att['took_s']} s")
    # AND the leak is named: by the local that holds it, and (sampled) by its allocation site
    rules = {a["rule"]: a for a in summary["advice"]}
    if workload == "launch":
        assert "held-by-frame" in rules and "`kept (list of tensors)`" in rules["held-by-frame"]["reason"], summary[
            "advice"
        ]
    assert any("in remember" in s["site"] for s in summary["top_sites"]), summary["top_sites"]
    print(f"[{workload}] OOM report ({art.path}):\n{format_summary(summary)}")


def test_attribution_makes_no_cuda_allocation():
    # GIVEN a CUDA model, its AdamW state, and tensors in this frame's locals (one a list)
    import sys

    import torch

    from collectors.memory.capture import job_attribution

    model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(8)]).cuda()
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(64, 1024, device="cuda")).sum().backward()
    opt.step()
    kept = [torch.empty(1 << 20, dtype=torch.uint8, device="cuda") for _ in range(50)]  # noqa: F841
    torch.cuda.synchronize()
    before = torch.cuda.memory_stats()

    # WHEN the job's objects are attributed, as at an OOM
    out = job_attribution(sys._getframe(), [opt])

    # THEN the figures are right and the allocator saw no allocation at all
    after = torch.cuda.memory_stats()
    assert after["allocation.all.allocated"] == before["allocation.all.allocated"]
    assert after["allocated_bytes.all.current"] == before["allocated_bytes.all.current"]
    params = sum(p.numel() * 4 for p in model.parameters())
    assert out["parameters_bytes"] == params and out["gradients_bytes"] == params
    assert out["optimizer_state_bytes"] >= 2 * params  # exp_avg, exp_avg_sq (+ step)
    held = {t["name"]: t for t in out["frame_tensors"]}
    assert held["kept (list of tensors)"]["bytes"] == 50 << 20 and held["kept (list of tensors)"]["tensors"] == 50
    print(f"\nattribution of {out['tensors_looked_at']} tensors: {out['took_s'] * 1000:.2f} ms, no CUDA allocation")
