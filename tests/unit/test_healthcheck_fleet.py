"""healthcheck.fleet: many nodes' reports decoded (hostile ones too), peers compared across
nodes, the verdict and the drain lines."""

from __future__ import annotations

import copy
import json
import shlex
from typing import Any

import pytest

from healthcheck import fleet
from healthcheck.fleet import NodeOutcome, NodeReport, ReportError
from healthcheck.fleet_text import render_fleet


def check(name: str, status: str = "pass", device: int | None = None, value: Any = None, **extra: Any) -> dict:
    doc = {"name": name, "status": status, "device": device, "value": value, "unit": None, "metric": None}
    doc.update(extra)
    return doc


def report(
    gemm: list[float] | None = None, host_gflops: float | None = 40.0, exit_code: int = 0, extra: list | None = None
) -> dict[str, Any]:
    """A node's report: ``gemm`` per device (TFLOP/s), the host's CPU figure."""
    gemm = gemm if gemm is not None else [660.0, 662.0]
    checks = [check("devices", value=len(gemm), critical=True)]
    for i, v in enumerate(gemm):
        checks.append(
            check("gemm_bf16", device=i, value=v, unit="TFLOP/s", metric="gemm_bf16_tflops", details={"correct": True})
        )
    if host_gflops is not None:
        checks.append(
            check(
                "host_gemm_fp32",
                value=host_gflops,
                unit="GFLOP/s",
                metric="host_gemm_fp32_gflops",
                details={"correct": True, "peer_group": "cpu EPYC"},
            )
        )
    checks += extra or []
    return {
        "schema": "dynprof.healthcheck",
        "schema_version": 1,
        "host": "whatever-the-node-says",
        "level": "standard",
        "exit_code": exit_code,
        "duration_s": 12.5,
        "devices": [{"index": i, "sku": "NVIDIA H200 140GiB"} for i in range(len(gemm))],
        "checks": checks,
        "artifact": None,
    }


def node(name: str, doc: Any = None, **kw: Any) -> NodeOutcome:
    return NodeOutcome(name, name, kw.pop("answered", True), doc if doc is not None else report(), **kw)


def codes(verdict: fleet.NodeVerdict) -> list[str]:
    return [r.code for r in verdict.reasons]


def by_label(result: fleet.FleetReport) -> dict[str, fleet.NodeVerdict]:
    return {v.outcome.label: v for v in result.verdicts}


# -- peers -----------------------------------------------------------------------------------------
def test_a_healthy_fleet_flags_nothing_and_exits_0():
    # GIVEN five nodes whose figures are within a few percent of each other
    nodes = [node(f"n{i}", report([660.0 + i, 655.0 - i], 40.0 + i)) for i in range(5)]

    # WHEN they are judged together
    result = fleet.judge(nodes)

    # THEN nothing is drained, every figure was compared, exit 0
    assert result.exit_code == 0 and result.verdict == "healthy"
    assert result.drained() == []
    assert all(p.compared for p in result.peers)
    assert json.loads(json.dumps(result.to_json()))["counts"] == {
        "nodes": 5, "healthy": 5, "warning": 0, "unhealthy": 0, "unknown": 0, "drain": 0,
    }  # fmt: skip


def test_a_gpu_12_percent_below_the_fleet_median_fails_its_node_even_when_the_node_passed():
    # GIVEN four nodes; on n2, GPU 1 is 12 % slower than the rest (its own report passed: no baseline said no)
    nodes = [node(f"n{i}", report([660.0, 660.0 * (0.88 if i == 2 else 1.0)])) for i in range(4)]

    # WHEN they are judged together
    result = fleet.judge(nodes)

    # THEN n2 is drained for peer-slow on device 1 with the figure and the median, the others are healthy
    verdicts = by_label(result)
    assert codes(verdicts["n2"]) == ["peer-slow"]
    reason = verdicts["n2"].reasons[0]
    assert (reason.check, reason.device, reason.metric) == ("gemm_bf16", 1, "gemm_bf16_tflops")
    assert reason.median == 660.0 and reason.ratio == pytest.approx(0.88) and reason.nodes == 4
    assert [v.outcome.label for v in result.drained()] == ["n2"]
    assert result.exit_code == 2
    assert verdicts["n2"].check_cells()["gemm_bf16"] == "slow"


def test_a_gpu_8_percent_slow_passes_the_default_threshold_and_fails_a_stricter_one():
    # GIVEN four nodes, one GPU 8 % slow on n3
    nodes = [node(f"n{i}", report([660.0, 660.0 * (0.92 if i == 3 else 1.0)])) for i in range(4)]

    # WHEN judged at the default 10 % and at 5 %
    default, strict = fleet.judge(nodes), fleet.judge(nodes, threshold=0.05)

    # THEN only the stricter threshold drains it
    assert default.drained() == [] and default.exit_code == 0
    assert [v.outcome.label for v in strict.drained()] == ["n3"]


def test_a_whole_node_slow_is_named_and_one_node_with_many_devices_gets_one_vote():
    # GIVEN three normal 2-GPU nodes and one node whose 64 "GPUs" all claim a huge figure
    nodes = [node(f"n{i}", report([660.0, 661.0], 40.0)) for i in range(3)]
    nodes.append(node("big", report([1e9] * 64, 40.0)))
    nodes.append(node("slow", report([500.0, 505.0], 20.0)))

    # WHEN judged together
    result = fleet.judge(nodes)

    # THEN the median stays the normal nodes' (the big node is one vote), the slow node is named for its
    # GPUs and its CPU figure, and the honest nodes are not
    verdicts = by_label(result)
    assert {r.device for r in verdicts["slow"].reasons} == {0, 1, None}
    assert {r.metric for r in verdicts["slow"].reasons} == {"gemm_bf16_tflops", "host_gemm_fp32_gflops"}
    assert all(verdicts[f"n{i}"].status == "healthy" for i in range(3))
    gemm = next(p for p in result.peers if p.metric == "gemm_bf16_tflops")
    assert gemm.median == pytest.approx(660.5) and gemm.nodes == 5


def test_below_three_nodes_figures_are_not_compared_and_nobody_is_flagged_by_them():
    # GIVEN two nodes, one far slower
    nodes = [node("a", report([660.0, 660.0])), node("b", report([300.0, 300.0]))]

    # WHEN judged
    result = fleet.judge(nodes)

    # THEN no peer finding: the document says why
    assert result.drained() == [] and result.exit_code == 0
    figures = result.to_json()["peer"]["figures"]
    assert figures and all(not f["compared"] and "at least 3" in f["why"] for f in figures)


def test_figures_are_compared_within_their_sku_and_cpu_only():
    # GIVEN three H200 nodes and three nodes of another SKU, twice as slow
    fast = [node(f"h{i}", report([660.0, 660.0])) for i in range(3)]
    other = []
    for i in range(3):
        doc = report([330.0, 330.0])
        for d in doc["devices"]:
            d["sku"] = "NVIDIA H100 80GiB"
        other.append(node(f"o{i}", doc))

    # WHEN judged together
    result = fleet.judge(fast + other)

    # THEN nobody is slow: each SKU has its own median
    assert result.drained() == []
    assert {(p.group, p.median) for p in result.peers if p.metric == "gemm_bf16_tflops"} == {
        ("NVIDIA H200 140GiB", 660.0),
        ("NVIDIA H100 80GiB", 330.0),
    }


def test_wrong_results_and_unknown_checks_give_no_figure():
    # GIVEN a node whose GEMM gave wrong results (check failed, correct False) at a tiny figure
    bad = report([660.0, 660.0])
    bad["checks"][1] = check(
        "gemm_bf16", "fail", 0, 1.0, unit="TFLOP/s", metric="gemm_bf16_tflops", details={"correct": False}
    )
    nodes = [node(f"n{i}", report([660.0, 660.0])) for i in range(3)] + [node("bad", bad)]

    # WHEN judged
    result = fleet.judge(nodes)

    # THEN it is drained for the failed check only, not also as peer-slow
    assert codes(by_label(result)["bad"]) == ["check-failed"]


# -- nodes that did not answer, or not well ---------------------------------------------------------------
def test_nodes_that_did_not_answer_refused_timed_out_or_did_not_finish_are_named_never_healthy():
    # GIVEN healthy nodes and one of each failure
    healthy = [node(f"n{i}") for i in range(3)]
    incomplete = report()
    incomplete["checks"].append(check("gemm_bf16", "unknown", 1, None, critical=True, reason="timed out after 60 s"))
    incomplete["exit_code"] = 3
    odd = [
        NodeOutcome("down", "down", False, error="connection refused: is `dynprof serve` running on down:8787?"),
        NodeOutcome("token", "token", False, error="401: wrong token", refused=True),
        NodeOutcome("slowpoke", "slowpoke", True, None, 9, "healthcheck ran past 600 s", "Timeout"),
        NodeOutcome("ro", "ro", True, None, 2, "read-only", "UsageError"),
        NodeOutcome("killed", "killed", True, None, 3, "killed by SIGKILL", "DynprofError"),
        node("half", incomplete),
    ]

    # WHEN judged
    result = fleet.judge(healthy + odd)

    # THEN each is drained with its code; exit 3 (could not check some node, none unhealthy)
    verdicts = by_label(result)
    assert {label: codes(verdicts[label])[0] for label in ("down", "token", "slowpoke", "ro", "killed", "half")} == {
        "down": "unreachable",
        "token": "refused",
        "slowpoke": "timed-out",
        "ro": "refused",
        "killed": "incomplete",
        "half": "incomplete",
    }
    assert verdicts["half"].reasons[0].check == "gemm_bf16"
    assert all(verdicts[label].status == "unknown" for label in ("down", "half"))
    assert result.exit_code == 3 and len(result.drained()) == 6
    text = render_fleet(result)
    assert "down" in text and "connection refused" in text and "verdict: COULD NOT RUN (exit 3)" in text


def test_a_failed_check_beats_an_unknown_node_for_the_exit_code():
    # GIVEN one node with a failed check and one that did not answer
    failed = report(extra=[check("ecc_errors", "fail", 0, 3.0, reason="3 uncorrectable")])
    failed["exit_code"] = 2
    nodes = [node("n0"), node("bad", failed), NodeOutcome("down", "down", False, error="timed out")]

    # WHEN judged
    result = fleet.judge(nodes)

    # THEN exit 2, and the failed check is named with its device
    assert result.exit_code == 2
    (reason,) = by_label(result)["bad"].reasons
    assert (reason.code, reason.check, reason.device, reason.value) == ("check-failed", "ecc_errors", 0, 3.0)


def test_a_node_that_warns_is_listed_but_not_drained():
    warned = report(extra=[check("disk_free", "warn", None, 3.0, reason="3 GiB free")])
    warned["exit_code"] = 1
    result = fleet.judge([node("n0"), node("w", warned)])
    assert result.exit_code == 1 and result.drained() == []
    assert by_label(result)["w"].status == "warning"


def test_no_nodes_is_could_not_run():
    assert fleet.judge([]).exit_code == 3


HOSTILE: list[tuple[str, Any]] = [
    ("not an object", ["x"]),
    ("wrong schema", {**report(), "schema": "evil"}),
    ("newer schema", {**report(), "schema_version": 2}),
    ("exit code as text", {**report(), "exit_code": "0"}),
    ("exit code as bool", {**report(), "exit_code": False}),
    ("exit code out of range", {**report(), "exit_code": 7}),
    ("checks not a list", {**report(), "checks": {"a": 1}}),
    ("no checks", {**report(), "checks": []}),
    ("too many checks", {**report(), "checks": [check("x")] * (fleet.MAX_CHECKS + 1)}),
    ("too many devices", {**report(), "devices": [{"index": 0, "sku": "x"}] * (fleet.MAX_DEVICES + 1)}),
    ("a check name with shell", {**report(), "checks": [check("gemm; rm -rf /")]}),
    ("a huge name", {**report(), "checks": [check("a" * 10_000)]}),
    ("a NaN figure", {**report(), "checks": [check("gemm_bf16", value=float("nan"), metric="gemm_bf16_tflops")]}),
    ("an infinite figure", {**report(), "checks": [check("gemm_bf16", value=float("inf"), metric="m")]}),
    ("a huge figure", {**report(), "checks": [check("gemm_bf16", value=1e300, metric="m")]}),
    ("a bool figure", {**report(), "checks": [check("gemm_bf16", value=True, metric="m")]}),
    ("an unknown status", {**report(), "checks": [check("x", status="great")]}),
    ("a negative device", {**report(), "checks": [check("x", device=-1)]}),
    ("a device as text", {**report(), "checks": [check("x", device="0")]}),
    ("critical as text", {**report(), "checks": [check("x", critical="yes")]}),
    ("details as a list", {**report(), "checks": [check("x", details=[1])]}),
    ("reason as a number", {**report(), "checks": [check("x", reason=5)]}),
]


@pytest.mark.parametrize(("what", "doc"), HOSTILE, ids=[h[0] for h in HOSTILE])
def test_hostile_reports_are_refused_and_the_node_is_bad_report_never_healthy(what, doc):
    # GIVEN three honest nodes and one that sends a malformed report
    nodes = [node(f"n{i}") for i in range(3)] + [node("evil", copy.deepcopy(doc))]

    # WHEN judged
    result = fleet.judge(nodes)

    # THEN the evil node is bad-report with a reason, the honest ones are healthy
    verdicts = by_label(result)
    assert codes(verdicts["evil"]) == ["bad-report"], what
    assert verdicts["evil"].reasons[0].detail
    assert all(verdicts[f"n{i}"].status == "healthy" for i in range(3))
    assert result.exit_code == 3
    json.dumps(result.to_json(), allow_nan=False)  # the document stays strict JSON


def test_long_and_control_character_text_from_a_node_is_cut_and_made_printable():
    doc = report(extra=[check("disk_free", "warn", None, 1.0, reason="\x1b[2J" + "x" * 100_000)])
    decoded = NodeReport.from_json(doc)
    (disk,) = [c for c in decoded.checks if c.name == "disk_free"]
    assert len(disk.reason) <= fleet.MAX_TEXT_CHARS and "\x1b" not in disk.reason


def test_from_json_names_what_is_wrong():
    with pytest.raises(ReportError, match="exit_code"):
        NodeReport.from_json({**report(), "exit_code": None})


# -- drain lines ---------------------------------------------------------------------------------------
HOSTILE_NAMES = ["n1;reboot", "$(rm -rf /)", "`id`", "a\nscontrol update NodeName=all State=DOWN", "x' y", "-rf"]


def test_slurm_drain_lines_name_each_drained_node_with_its_reasons_quoted_for_the_shell():
    # GIVEN a fleet with one peer-slow node and one unreachable node
    nodes = [node(f"gpu{i:02d}", report([660.0, 660.0])) for i in range(3)]
    nodes.append(node("gpu03", report([660.0, 500.0])))
    nodes.append(NodeOutcome("gpu04", "gpu04", False, error="timed out; a firewall 'drops' $PORT"))
    result = fleet.judge(nodes)

    # WHEN the slurm lines are made
    lines = fleet.drain_commands(result, "slurm")

    # THEN one scontrol line per drained node, each read back by a shell as exactly its argv
    assert len(lines) == 2
    argv = [shlex.split(line) for line in lines]
    assert argv[0][:4] == ["scontrol", "update", "NodeName=gpu03", "State=DRAIN"]
    assert argv[0][4].startswith("Reason=dynprof preflight: peer-slow gemm_bf16_tflops device 1 500.0")
    assert argv[1] == ["scontrol", "update", "NodeName=gpu04", "State=DRAIN", "Reason=dynprof preflight: unreachable"]
    assert "$PORT" not in lines[1]  # the node's own words never reach the line


def test_k8s_lines_cordon_and_taint_with_the_code():
    nodes = [node(f"n{i}") for i in range(3)] + [NodeOutcome("w", "worker-7", False, error="down")]
    lines = fleet.drain_commands(fleet.judge(nodes), "k8s")
    assert [shlex.split(x) for x in lines] == [
        ["kubectl", "cordon", "worker-7"],
        ["kubectl", "taint", "nodes", "worker-7", "dynprof.io/preflight=unreachable:NoSchedule", "--overwrite"],
    ]


@pytest.mark.parametrize("name", HOSTILE_NAMES)
@pytest.mark.parametrize("kind", ["slurm", "k8s"])
def test_a_hostile_node_name_cannot_inject_shell(name, kind):
    # GIVEN a drained node whose name holds shell syntax or a newline
    nodes = [node(f"n{i}") for i in range(3)] + [NodeOutcome(name, name, False, error="down")]

    # WHEN the drain lines are made
    lines = fleet.drain_commands(fleet.judge(nodes), kind)

    # THEN the node gets one comment line (no command), with no newline inside it
    assert len(lines) == 1 and lines[0].startswith("# ") and "\n" not in lines[0]
    assert shlex.split(lines[0], comments=True) == []


def test_the_document_lists_the_drain_lines_and_every_reason_code_is_documented():
    nodes = [node(f"n{i}") for i in range(3)] + [NodeOutcome("x", "x", False, error="down")]
    doc = fleet.judge(nodes).to_json("slurm")
    assert doc["schema"] == "dynprof.healthcheck.fleet" and doc["schema_version"] == 1
    assert doc["drain"] == [{"node": "x", "name": "x", "reasons": [{"code": "unreachable", "detail": "down"}]}]
    assert doc["drain_commands"] == ["scontrol update NodeName=x State=DRAIN 'Reason=dynprof preflight: unreachable'"]
    from pathlib import Path

    text = (Path(__file__).resolve().parents[2] / "docs" / "preflight.md").read_text()
    assert all(f"`{code}`" in text for code in fleet.REASON_CODES)


def test_link_findings_drain_the_isolated_node_and_warn_about_the_undecided_ones():
    from healthcheck.links.rounds import LinkFinding

    # GIVEN four healthy nodes and the link tests' findings: node b isolated slow, node c a
    # failed test, node d in a slow pair links alone could not decide
    result = fleet.judge([node(n) for n in "abcd"])

    def finding(name: str, code: str, isolated: bool, bw: float | None = None) -> LinkFinding:
        return LinkFinding(name, name, code, isolated, bw, 10.0 if bw else None, None, [], f"{code} {name}")

    findings = [
        (1, finding("b", "link-slow", True, 2.0)),
        (2, finding("c", "link-failed", True)),
        (3, finding("d", "link-slow", False, 4.0)),
        (99, finding("x", "link-hung", True)),  # not a node of the fleet: ignored
    ]
    # WHEN they are joined to the verdicts
    fleet.add_link_findings(result, findings, {"schema": "dynprof.healthcheck.links", "rounds": [[], []]})
    # THEN b is unhealthy for link-slow with its figure, c not checked, d warned, a healthy
    v = by_label(result)
    assert (v["a"].status, v["b"].status, v["c"].status, v["d"].status) == (
        "healthy",
        "unhealthy",
        "unknown",
        "warning",
    )
    assert codes(v["b"]) == ["link-slow"] and v["b"].reasons[0].ratio == 0.2
    assert [r.code for r in v["d"].warnings] == ["link-slow"]
    assert result.exit_code == 2 and [d.outcome.label for d in result.drained()] == ["b", "c"]
    doc = result.to_json("slurm")
    assert doc["links"]["schema"] == "dynprof.healthcheck.links"
    assert "link-slow busbw" in doc["drain_commands"][0]
    assert "links: 2 round(s)" in render_fleet(result)


# -- the peer comparison on its own ----------------------------------------------------------------
def fig(node_index: int, value: float, device: int | None = 0, group: str = "NVIDIA H200 140GiB") -> fleet.Figure:
    return fleet.Figure(node_index, "gemm_bf16", "gemm_bf16_tflops", device, value, "TFLOP/s", group)


def test_compare_peers_names_a_figure_below_the_fleet_median_by_the_threshold():
    # GIVEN three nodes' GEMM figures, one node 20 % under the others
    figures = [fig(0, 660.0), fig(1, 650.0), fig(2, 520.0)]
    # WHEN compared with a 10 % threshold
    findings, groups = fleet.compare_peers(figures, threshold=0.10)
    # THEN that node is peer-slow against the median of the nodes, with its ratio
    [(index, reason)] = findings
    assert (index, reason.code, reason.median, reason.nodes) == (2, fleet.PEER_SLOW, 650.0, 3)
    assert reason.ratio == round(520.0 / 650.0, 4)
    [row] = groups
    assert (row.compared, row.slow, row.nodes, row.per_device) == (True, 1, 3, True)


def test_compare_peers_takes_each_nodes_median_first():
    # GIVEN one node with many devices: it counts once in the fleet median
    figures = [fig(0, 100.0, device=d) for d in range(8)] + [fig(1, 600.0), fig(2, 610.0)]
    findings, groups = fleet.compare_peers(figures)
    assert groups[0].median == 600.0
    assert {i for i, _ in findings} == {0}


def test_fewer_nodes_than_the_minimum_are_not_compared_and_the_summary_says_why():
    findings, groups = fleet.compare_peers([fig(0, 10.0), fig(1, 600.0)])
    assert findings == []
    assert groups[0].compared is False
    assert "at least 3 make a median" in groups[0].to_json()["why"]


def test_figures_of_different_groups_or_scope_are_not_compared_with_each_other():
    figures = [fig(0, 600.0), fig(1, 600.0), fig(2, 600.0), fig(3, 100.0, group="NVIDIA A100 80GiB")]
    figures += [fig(4, 100.0, device=None)]
    findings, groups = fleet.compare_peers(figures)
    assert findings == []
    assert len(groups) == 3


def test_a_zero_median_compares_nothing():
    findings, groups = fleet.compare_peers([fig(0, 0.0), fig(1, 0.0), fig(2, 0.0)])
    assert findings == [] and groups[0].compared is False
