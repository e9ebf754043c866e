"""CI runs the suite against the real programs its tests use; none of their tests may skip there.

On a user's machine a test skips when one of these is missing (each test says which); `.ci/run`
installs them and sets DYNPROF_CI=1, where this test fails if any is still missing.
"""

from __future__ import annotations

import os
import shutil

import pytest

# program -> the tests that need it
PROGRAMS = {
    "prometheus": "a real Prometheus scrapes a sidecar (tests/integration/test_prometheus.py)",
    "promtool": "the shipped alert rules and scrape config (tests/unit/test_deploy_prometheus.py)",
    "chromium": "the sidecar and analyze pages in a browser (test_analyze_page, test_sidecar_actions_processes)",
    "openssl": "TLS sidecars (test_sidecar_actions_processes, test_hostile_sidecar_http, test_job_client)",
    "gdb": "attach to Python < 3.14 (test_attach_processes, test_bad_targets, test_roles_under_launchers)",
    "gcore": "core files of hung ranks (test_stacks)",
    "ip": "link tests across network namespaces (tests/support/links.py)",
    "tc": "link tests with a slowed link (tests/support/links.py)",
    "taskset": "link tests pinned to CPUs (tests/support/links.py)",
    "setpriv": "other users' processes (test_attach_processes, test_stacks)",
    "runuser": "a serve run as another user (test_serve_abuse)",
}


@pytest.mark.skipif(not os.environ.get("DYNPROF_CI"), reason="checks CI's machine (DYNPROF_CI=1, set by .ci/run)")
def test_ci_has_every_program_the_suite_runs_against():
    missing = {name: why for name, why in PROGRAMS.items() if shutil.which(name) is None}
    assert not missing, f"CI lacks programs its tests would skip without: {missing}"
