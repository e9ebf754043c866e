"""`dynprof run --checkpoint` under Hugging Face ``Trainer`` and Lightning ``Trainer.fit`` on the
CPU: the agent measures a step, plans, wraps the chosen layers at a step boundary and verifies the
next step's peak under the budget; the losses are bit-identical to a plain run of the same steps,
and the kept memory-plan artifact says what was applied and verified."""

from __future__ import annotations

import shutil
import sys
import tempfile
from pathlib import Path

import pytest
from _scenario import PROGRAMS, JobRun, _Job, base_env, cli
from conftest import _install_hint, _installed

pytestmark = [pytest.mark.frameworks, pytest.mark.timeout(600)]

STEPS = 30  # the plan is applied and verified by about the 12th step (3 warm-up, measure, plan, wrap, verify, time 3)
BUDGET = "80%"
CASES = {
    # tiny random-init GPT-2 (use_cache=False in its config: a recompute must not fill a KV cache)
    "hf_trainer": (("transformers", "accelerate"), "hf_trainer_program.py", ()),
    # 4 residual blocks of width 64 on batches of 256 rows: activations next to the parameters
    "lightning": (("lightning|pytorch_lightning",), "lightning_program.py", ("--blocks", "4", "--batch", "256")),
}


def _losses(run: JobRun) -> list[str]:
    return [line for line in run.lines if line.startswith("LOSS ")]


@pytest.mark.parametrize("case", sorted(CASES))
def test_checkpoint_is_applied_under_the_framework_and_the_losses_are_unchanged(case, tmp_path):
    needs, program, args = CASES[case]
    for spec in needs:
        if not _installed(spec):
            pytest.skip(f"{spec.replace('|', ' or ')} is not installed ({_install_hint(spec)})")
    # GIVEN the framework's job of STEPS optimizer steps, plain and under --checkpoint 80%
    run_dir = Path(tempfile.mkdtemp(prefix="dpc-", dir="/tmp"))
    try:
        env = base_env(run_dir, tmp_path / "artifacts", f"ckpt-{case}")
        command = [sys.executable, str(PROGRAMS / program), *args, "--stop-after", str(STEPS)]
        plain = _Job(command, env)
        rc_plain = plain.finish(timeout=300)
        applied = _Job([sys.executable, "-m", "dynprof", "run", "-q", "--checkpoint", BUDGET, "--", *command], env)

        # WHEN both have trained
        rc = applied.finish(timeout=300)
        listed = cli(env, "ls", "--kind", "memory-plan", "--json")
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)
    a, b = JobRun(list(plain.lines), rc_plain), JobRun(list(applied.lines), rc)

    # THEN both finished, and the agent said on the job's stderr that it applied the plan
    assert rc_plain == 0 and rc == 0, a.tail() + "\n---\n" + b.tail()
    said = [line for line in b.lines if line.startswith(f"dynprof: checkpoint {BUDGET}:")]
    assert len(said) == 1 and ": applied: " in said[0], b.tail()
    # AND the losses of every step are the plain run's, bit for bit
    assert len(_losses(a)) >= STEPS and _losses(a) == _losses(b), (_losses(a)[:3], _losses(b)[:3])
    # AND the memory-plan artifact keeps the state: applied, its verified peak under the budget
    assert listed.ok, listed.describe()
    (row,) = listed.json()["artifacts"]
    shown = cli(env, "show", row["path"], "--json")
    assert shown.ok, shown.describe()
    c = shown.json()["contents"]["checkpoint"]
    assert c["state"] == "applied" and c["modules"], c
    assert c["verified_peak_bytes"] <= c["budget_bytes"] and c["verified_step_s"] > 0, c
