"""OOM advice: rules against real H200 snapshots (tests/data), each piece of
advice carrying the figure that triggered it, and size classes that account for every byte."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from collectors.memory.advice import advise, size_classes
from collectors.memory.reader import load_snapshot
from collectors.memory.summary import summarize_snapshot

DATA = Path(__file__).resolve().parent.parent / "data"
ARTIFACTS = sorted(p for p in DATA.glob("memory_*artifact*") if (p / "snapshot.pickle").exists())
GIB = 2**30


@pytest.fixture(params=ARTIFACTS, ids=[p.name for p in ARTIFACTS])
def real(request):
    art = request.param
    return load_snapshot(art / "snapshot.pickle"), json.loads((art / "summary.json").read_text())


def test_size_classes_account_for_every_reserved_byte(real):
    snapshot, _ = real
    rows = size_classes(snapshot)
    summary = summarize_snapshot(snapshot)
    assert sum(r["bytes"] for r in rows) == summary["totals"]["reserved_bytes"]
    assert sum(r["bytes"] for r in rows if r["state"] == "allocated") == summary["totals"]["allocated_bytes"]
    assert {r["pool"] for r in rows} <= {"small", "large"}


def test_the_committed_oom_gets_only_advice_its_figures_support():
    # GIVEN the 1 GiB-capped OOM of tests/data: 939 MiB of 1 010 MiB allocated at one site, 2 MiB
    # of cached free memory (nothing to defragment), the cap far below the device's free memory
    summary = json.loads((DATA / "memory_oom_artifact" / "summary.json").read_text())

    # WHEN advised
    rules = {a["rule"]: a for a in advise(summary)}

    # THEN the dominating site is named with its share; no fragmentation or cache advice
    assert set(rules) == {"site"}
    assert "93 %" in rules["site"]["reason"] and "oom_program.py:27 in make_inputs" in rules["site"]["advice"]


def _with(summary: dict, **device: int) -> dict:
    s = copy.deepcopy(summary)
    s["devices"][0].update(device)
    return s


def test_fragmented_cache_advises_expandable_segments_with_its_figures():
    summary = json.loads((DATA / "memory_oom_artifact" / "summary.json").read_text())
    # 300 MiB cached free, the largest piece 32 MiB, a 256 MiB request
    s = _with(summary, inactive_bytes=300 << 20, largest_inactive_block=32 << 20, fragmentation=0.89)
    (frag,) = [a for a in advise(s) if a["rule"] == "fragmentation"]
    assert "expandable_segments:True" in frag["advice"]
    assert "0.29 GiB" in frag["reason"] and "0.03 GiB" in frag["reason"] and "0.25 GiB" in frag["reason"]


def test_free_cache_large_enough_for_the_request_points_at_streams_and_pools():
    summary = json.loads((DATA / "memory_oom_artifact" / "summary.json").read_text())
    s = _with(summary, inactive_bytes=512 << 20, largest_inactive_block=512 << 20, fragmentation=0.0)
    rules = [a["rule"] for a in advise(s)]
    assert "cache" in rules and "fragmentation" not in rules


def test_memory_held_outside_the_allocator_is_measured():
    summary = json.loads((DATA / "memory_oom_artifact" / "summary.json").read_text())
    s = copy.deepcopy(summary)
    # an 80 GiB device, 10 GiB reserved here, 1 GiB free: 69 GiB is someone else's
    s["failing_allocation"].update(device_limit_bytes=80 * GIB, device_free_bytes=1 * GIB)
    s["devices"][0]["reserved_bytes"] = 10 * GIB
    (held,) = [a for a in advise(s) if a["rule"] == "held-elsewhere"]
    assert "69.00 GiB" in held["reason"]


def test_optimizer_state_and_gradients_dominating_are_named():
    summary = json.loads((DATA / "memory_oom_artifact" / "summary.json").read_text())
    total = summary["totals"]["allocated_bytes"]
    s = copy.deepcopy(summary)
    s["attribution"] = {
        "optimizers": 1,
        "parameters_bytes": total // 8,
        "gradients_bytes": total // 4,
        "optimizer_state_bytes": total // 2,
    }
    rules = {a["rule"]: a for a in advise(s)}
    assert "50 %" in rules["optimizer-state"]["reason"] and "25 %" in rules["gradients"]["reason"]
    assert "activations" not in rules
    s["attribution"].update(optimizer_state_bytes=0, gradients_bytes=0)
    assert "activations" in {a["rule"] for a in advise(s)}


def test_a_local_holding_much_of_the_memory_is_named_and_not_called_activations():
    summary = json.loads((DATA / "memory_oom_artifact" / "summary.json").read_text())
    total = summary["totals"]["allocated_bytes"]
    s = copy.deepcopy(summary)
    s["attribution"] = {
        "optimizers": 1,
        "parameters_bytes": 0,
        "gradients_bytes": 0,
        "optimizer_state_bytes": 0,
        "frame_tensors_bytes": total * 9 // 10,
        "frame_tensors": [
            {"name": "kept (list of tensors)", "frame": "main (train.py:40)", "bytes": total * 9 // 10, "tensors": 700}
        ],
    }
    rules = {a["rule"]: a for a in advise(s)}
    assert "held-by-frame" in rules and "activations" not in rules
    assert "700 tensors" in rules["held-by-frame"]["reason"] and "90 %" in rules["held-by-frame"]["reason"]


def test_no_figures_no_advice():
    assert advise({}) == []
    assert advise({"devices": [], "totals": {}, "top_sites": []}) == []


@pytest.mark.parametrize("policy", ["auto", "off"])
def test_leak_oom_captured_on_h200_names_the_list_holding_the_leak(policy):
    # GIVEN the launch-bound loop that leaks 2 MiB a step until its 0.5 GiB cap, captured on an
    # H200 under each policy (tests/data/make_memory_snapshot.py --leak-policy auto/off)
    art = DATA / f"memory_leak_{policy}_artifact"
    stored = json.loads((art / "summary.json").read_text())
    snapshot = load_snapshot(art / "snapshot.pickle")

    # WHEN the advice is computed again from the snapshot and the stored attribution
    summary = summarize_snapshot(snapshot)
    summary.update(failing_allocation=stored["failing_allocation"], attribution=stored["attribution"])
    advice = advise(summary)

    # THEN it is the advice the agent wrote at the OOM, naming the leaking list with its size
    assert advice == stored["advice"]
    (held,) = [a for a in advice if a["rule"] == "held-by-frame"]
    assert "`kept (list of tensors)` (210 tensors)" in held["reason"] and "0.41 GiB" in held["reason"]
    assert "activations" not in {a["rule"] for a in advice}


def test_auto_samples_the_leak_site_and_off_has_no_stacks():
    auto = json.loads((DATA / "memory_leak_auto_artifact" / "summary.json").read_text())
    off = json.loads((DATA / "memory_leak_off_artifact" / "summary.json").read_text())
    assert auto["stacks_recorded"] and any("in remember" in s["site"] for s in auto["top_sites"])
    assert not off["stacks_recorded"] and [s["site"] for s in off["top_sites"]] == ["(no Python stack recorded)"]
    manifest = json.loads((DATA / "memory_leak_auto_artifact" / "manifest.json").read_text())
    assert "of the time" in manifest["options"]["memory_history_detail"]
