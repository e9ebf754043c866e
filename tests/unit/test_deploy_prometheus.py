"""The shipped Prometheus scrape config and alert rules (scripts/deploy/prometheus/), checked by
Debian's promtool: valid, their unit tests pass, and a broken rule is caught (so these tests can
fail). Skipped where promtool is not installed."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from dynprof.sidecar.app import create_app
from dynprof.sidecar.progress import ProgressBook
from dynprof.store import ArtifactStore
from dynprof.watch.model import NodeProgress, RankProgress, WatchGauges

DEPLOY = Path(__file__).resolve().parents[2] / "scripts" / "deploy" / "prometheus"
PROMTOOL = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(
    PROMTOOL is None, reason="promtool is not installed (Debian: apt install prometheus)"
)


def promtool(*args: str, cwd: Path = DEPLOY) -> subprocess.CompletedProcess[str]:
    assert PROMTOOL is not None
    return subprocess.run([PROMTOOL, *args], capture_output=True, text=True, timeout=120, cwd=str(cwd))


@needs_promtool
@pytest.mark.parametrize(
    ("args", "said"),
    [
        (("check", "rules", "dynprof-alerts.yml"), "SUCCESS: 3 rules found"),
        (("check", "config", "prometheus.yml"), "is valid prometheus config file syntax"),
        (("test", "rules", "dynprof-alerts.test.yml"), "SUCCESS"),
    ],
    ids=["the_rules_are_valid", "the_scrape_config_is_valid", "the_rules_unit_tests_pass"],
)
def test_promtool_passes_the_deployed_files(args, said):
    result = promtool(*args)
    assert result.returncode == 0, result.stdout + result.stderr
    assert said in result.stdout


@needs_promtool
def test_a_broken_rule_fails_promtool(tmp_path):
    # GIVEN the rules with a syntax error in the stall expression, and with the stall rule's
    # comparison turned around (valid, but its unit test must then fail)
    text = (DEPLOY / "dynprof-alerts.yml").read_text()
    assert "> on (job_id)" in text
    broken = tmp_path / "broken"
    wrong = tmp_path / "wrong"
    for directory, rules in (
        (broken, text.replace("> on (job_id)", "> on (job_id")),
        (wrong, text.replace("> on (job_id)", "< on (job_id)")),
    ):
        directory.mkdir()
        (directory / "dynprof-alerts.yml").write_text(rules)
        shutil.copy(DEPLOY / "dynprof-alerts.test.yml", directory)
    # WHEN promtool checks them
    syntax = promtool("check", "rules", "dynprof-alerts.yml", cwd=broken)
    semantics = promtool("test", "rules", "dynprof-alerts.test.yml", cwd=wrong)
    # THEN both fail
    assert syntax.returncode != 0 and "FAILED" in syntax.stdout + syntax.stderr
    assert semantics.returncode != 0 and "FAILED" in semantics.stdout + semantics.stderr


def _exported(tmp_path: Path) -> set[str]:
    """The sample names a sidecar with one stepping rank and a hosted watch exports."""
    row = RankProgress(job="j", rank=0, world_size=1, pid=1, host="h", step=3, last_step_at=1.0, step_time_s=0.1)

    def read(*args: object) -> NodeProgress:
        return NodeProgress(host="h", time=2.0, poll_every_s=2.0, ranks=[row])

    book = ProgressBook("h", 2.0, records=lambda: [], read=read)
    book.poll()
    store = ArtifactStore(tmp_path / "s")
    w = store.create("stacks", job="j", rank=0)
    w.write_text("x", "x")
    w.finish("complete")
    gauges = [WatchGauges("j", True, {("h", 0): 0.5}, {"hang": 1})]
    app = create_app(store, token=None, progress=book, watch_gauges=lambda: gauges)
    text = app.test_client().get("/metrics").get_data(as_text=True)
    return {s.name for f in text_string_to_metric_families(text) for s in f.samples}


def test_the_rules_use_only_exported_names(tmp_path):
    # GIVEN every dynprof_ name the rules and their tests use, and what a sidecar exports
    used = set()
    for name in ("dynprof-alerts.yml", "dynprof-alerts.test.yml"):
        used |= set(re.findall(r"\bdynprof_[a-z_]+", (DEPLOY / name).read_text()))
    exported = _exported(tmp_path)
    # THEN each is one the sidecar exports
    assert used and used <= exported, used - exported
