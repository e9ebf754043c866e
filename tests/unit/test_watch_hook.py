"""The user's --on-verdict hook (dynprof.watch.hook): what it is given, and how its failures are said."""

from __future__ import annotations

import json

from dynprof.watch.hook import run_hook
from dynprof.watch.model import Verdict


def test_the_hook_gets_the_verdict_on_stdin_and_its_file_in_the_environment(tmp_path):
    # GIVEN a hook that records what it got
    out = tmp_path / "got"
    verdict = Verdict(kind="hang", job="j", conclusion="rank 1 on n is stuck", detected_at=1.0, decided_at=2.0)
    hook = f'printf "%s %s %s\\n" "$DYNPROF_VERDICT_KIND" "$DYNPROF_VERDICT_JOB" "$DYNPROF_VERDICT_FILE" > {out}; cat >> {out}'
    # WHEN
    result = run_hook(hook, verdict, str(tmp_path / "art"))
    # THEN
    assert result.ok
    first, rest = out.read_text().split("\n", 1)
    assert first == f"hang j {tmp_path / 'art' / 'verdict.json'}"
    assert json.loads(rest)["conclusion"] == "rank 1 on n is stuck"


def test_a_failing_or_hanging_hook_is_reported_never_raised(tmp_path):
    verdict = Verdict(kind="hang", job="j", conclusion="c", detected_at=1.0, decided_at=2.0)
    # WHEN a hook fails, and one runs past its time
    failed = run_hook("echo nope >&2; exit 3", verdict, None)
    slow = run_hook("sleep 30", verdict, None, timeout=0.5)
    # THEN both say why
    assert not failed.ok and failed.exit_code == 3 and failed.message == "--on-verdict exited 3: nope"
    assert not slow.ok and "ran past 0.5 s and was killed" in slow.message
