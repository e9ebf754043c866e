"""`dynprof run --checkpoint` under Hugging Face ``Trainer``, Lightning ``Trainer.fit`` and
DeepSpeed's engine on the CPU: the agent measures a step, plans, wraps the chosen layers at a step
boundary and verifies the next step's peak under the budget; the losses are bit-identical to a
plain run of the same steps, and the kept memory-plan artifact says what was applied and
verified. Under DeepSpeed's ZeRO optimizer (stage 1 or 2), which steps flattened partitions, the
model cannot be seen: refused in words, the job unchanged."""

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


DEEPSPEED = {
    # ZeRO stage: what each rank's agent ends in
    "0": "applied",
    "2": "refused",
}


@pytest.mark.parametrize("zero", sorted(DEEPSPEED))
def test_checkpoint_under_deepspeed_applies_with_its_engine_and_refuses_zero_partitions(zero, tmp_path):
    if not _installed("deepspeed"):
        pytest.skip(f"deepspeed is not installed ({_install_hint('deepspeed')})")
    # GIVEN DeepSpeed's engine on two gloo ranks (torchrun) training 6 residual blocks, plain and
    # under --checkpoint 70%
    run_dir = Path(tempfile.mkdtemp(prefix="dpc-", dir="/tmp"))
    program = str(PROGRAMS / "deepspeed_program.py")
    args = ["--zero", zero, "--blocks", "6", "--batch", "256", "--stop-after", str(STEPS)]
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", program, *args]
    try:
        env = base_env(run_dir, tmp_path / "artifacts", f"ckpt-ds{zero}")
        plain = _Job(launch, env)
        rc_plain = plain.finish(timeout=300)
        applied = _Job([sys.executable, "-m", "dynprof", "run", "-q", "--checkpoint", "70%", "--", *launch], env)

        # WHEN both have trained
        rc = applied.finish(timeout=300)
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)
    a, b = JobRun(list(plain.lines), rc_plain), JobRun(list(applied.lines), rc)

    # THEN both finished, and each rank's agent said its final state on the job's stderr
    assert rc_plain == 0 and rc == 0, a.tail() + "\n---\n" + b.tail()
    said = [line for line in b.lines if line.startswith("dynprof: checkpoint 70%:")]
    assert len(said) == 2 and all(f": {DEEPSPEED[zero]}: " in line for line in said), b.tail()
    if DEEPSPEED[zero] == "refused":
        assert all("DeepSpeed" in line and "nothing is wrapped" in line for line in said), said
    # AND every rank's losses are the plain run's, bit for bit
    assert len(_losses(a)) >= 2 * STEPS and sorted(_losses(a)) == sorted(_losses(b)), (_losses(a)[:3], _losses(b)[:3])
