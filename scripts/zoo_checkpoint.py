#!/usr/bin/env python3
"""`dynprof run --checkpoint` over a zoo of model architectures nobody listed: does it apply, keep
the losses bit for bit, predict its own peak, and never harm the job?

    PYTHONPATH=. python scripts/zoo_checkpoint.py                       # every architecture, 70 %
    PYTHONPATH=. python scripts/zoo_checkpoint.py --arch llama,t5 --budget 50%

For each architecture of scripts/_zoo_job.py (tiny random-init Hugging Face models: decoders with
tied embeddings, encoders, encoder-decoders, a ViT; dropout on, synthetic data, the CPU, one
thread) it runs the job twice for --steps steps: plain, and under `dynprof run --checkpoint
BUDGET`. It reads the agent's final line on the job's stderr and the memory-plan artifact the
agent kept, and prints one row per architecture: the state (applied, fits-already, unreachable,
refused with its reason), the blocks recomputed, the budget, the predicted and verified peak (and
the error), the predicted and verified step time, whether every loss is the plain run's bit for
bit, and whether the job ended by itself (exit 0). With --accumulate N the jobs take N
micro-batches per optimizer step. Exits 1 when a job died, a loss changed, or a verified peak is
over its budget.

Needs transformers (the `frameworks` extra).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

from _zoo_job import PLAIN, ZOO  # noqa: E402

MIB = 1024**2


def run_job(argv: list[str], env: dict[str, str], timeout: float) -> tuple[int, list[str], str]:
    """(exit code, its stdout lines, its stderr); -9 on a timeout (killed)."""
    try:
        p = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        err = e.stderr.decode() if isinstance(e.stderr, bytes) else (e.stderr or "")
        return -9, out.splitlines(), err + "\n(timed out)"
    return p.returncode, p.stdout.splitlines(), p.stderr


def losses(lines: list[str]) -> list[str]:
    return [line for line in lines if line.startswith("LOSS ")]


def first_differ(a: list[str], b: list[str]) -> int | None:
    """The first step whose loss line differs between two runs (a run cut short differs at its
    end); None when they are the same."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def said_losses(r: dict[str, Any], same: str = "yes") -> str:
    """The losses column: ``same``, or from which step they differ and from which step the job
    ran with the wrappers (a difference before it is not the wrappers')."""
    if r["losses_same"]:
        return same
    wrapped = r.get("wrapped_from_step")
    return f"no, from step {r.get('first_differ')} (wrapped from {'-' if wrapped is None else wrapped})"


def artifact_state(env: dict[str, str]) -> dict[str, Any] | None:
    """The kept memory-plan artifact's ``checkpoint`` section (dynprof show --json)."""
    ls = subprocess.run(
        [sys.executable, "-m", "dynprof", "ls", "--kind", "memory-plan", "--json"],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    if ls.returncode != 0:
        return None
    arts = json.loads(ls.stdout)["artifacts"]
    if not arts:
        return None
    shown = subprocess.run(
        [sys.executable, "-m", "dynprof", "show", arts[0]["path"], "--json"],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    if shown.returncode != 0:
        return None
    c = json.loads(shown.stdout).get("contents", {}).get("checkpoint")
    return c if isinstance(c, dict) else None


def run_rows(names: list[str], run_one: Any, losses_judged: bool) -> tuple[list[dict[str, Any]], int]:
    """Each of ``names`` run by ``run_one`` (its row), the agent's final line printed; and how
    many had a problem: a job died, a verified peak over its budget, or (``losses_judged``) a
    loss that changed."""
    rows = []
    bad = 0
    for i, name in enumerate(names, 1):
        print(f"[{i}/{len(names)}] {name} ...", flush=True)
        r = run_one(name)
        rows.append(r)
        died = r["rc"] != 0 or r["rc_plain"] != 0
        over = isinstance(r["verified"], int) and isinstance(r["budget"], int) and r["verified"] > r["budget"]
        wrong = losses_judged and not r["losses_same"]
        if died or over or wrong:
            bad += 1
            print(f"  PROBLEM: exit {r['rc_plain']}/{r['rc']}, losses same {r['losses_same']}, over budget {over}")
            print("  " + r["tail"].replace("\n", "\n  "))
        print(f"  {r['said'] or 'no final line on stderr'}", flush=True)
    return rows, bad


def job_env(work: Path, job_id: str) -> dict[str, str]:
    """A job's environment: its own run and artifact directories under ``work``, offline, one
    thread, this checkout on the path."""
    env = dict(os.environ)
    env.pop("DYNPROF", None)
    env.update(
        PYTHONUNBUFFERED="1",
        OMP_NUM_THREADS="1",
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        DYNPROF_RUN_DIR=str(work / "run"),
        DYNPROF_ARTIFACT_DIR=str(work / "artifacts"),
        DYNPROF_JOB_ID=job_id,
        PYTHONPATH=os.pathsep.join([str(HERE.parent), env.get("PYTHONPATH", "")]),
    )
    return env


def one(arch: str, args: argparse.Namespace) -> dict[str, Any]:
    work = Path(tempfile.mkdtemp(prefix="dpzoo-"))
    try:
        env = job_env(work, f"zoo-{arch}")
        job = [sys.executable, str(HERE / "_zoo_job.py"), "--arch", arch, "--steps", str(args.steps)]
        job += ["--accumulate", str(args.accumulate)]
        return {"arch": arch, **plain_and_checkpointed(job, env, args.budget, args.timeout)}
    finally:
        shutil.rmtree(work, ignore_errors=True)


def plain_and_checkpointed(job: list[str], env: dict[str, str], budget: str, timeout: float) -> dict[str, Any]:
    """Run ``job`` plain, then under `dynprof run --checkpoint BUDGET`; what each did, the agent's
    final line and the kept memory-plan artifact's ``checkpoint`` section, and the losses."""
    rc_plain, out_plain, err_plain = run_job(job, env, timeout)
    ckpt = [sys.executable, "-m", "dynprof", "run", "-q", "--checkpoint", budget, "--", *job]
    rc, out, err = run_job(ckpt, env, timeout)
    said = [line for line in err.splitlines() if line.startswith(f"dynprof: checkpoint {budget}:")]
    state = artifact_state(env) or {}
    return {
        "rc_plain": rc_plain,
        "rc": rc,
        "said": said[-1] if said else None,
        "state": state.get("state"),
        "modules": state.get("modules") or [],
        "refused": state.get("refused") or [],
        "budget": state.get("budget_bytes"),
        "measured": state.get("measured_peak_bytes"),
        "predicted": state.get("predicted_peak_bytes"),
        "verified": state.get("verified_peak_bytes"),
        "before_s": state.get("baseline_step_s"),
        "predicted_s": state.get("predicted_step_s"),
        "verified_s": state.get("verified_step_s"),
        "losses_same": bool(losses(out_plain)) and losses(out_plain) == losses(out),
        "first_differ": first_differ(losses(out_plain), losses(out)),
        "plain_losses": losses(out_plain),
        "wrapped_from_step": state.get("wrapped_from_step"),
        "verified_source": state.get("verified_peak_source"),
        "steps": len(losses(out)),
        "tail": (err_plain if rc_plain else err)[-1500:],
    }


def mib(b: Any) -> str:
    return "-" if not isinstance(b, (int, float)) else f"{b / MIB:.2f}"


def pct(real: Any, predicted: Any) -> str:
    if not isinstance(real, (int, float)) or not predicted:
        return "-"
    return f"{(real - predicted) / predicted * 100:+.1f} %"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arch", default=",".join([*ZOO, *PLAIN]), help="comma-separated architectures")
    parser.add_argument("--budget", default="70%")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--accumulate", type=int, default=1)
    parser.add_argument("--timeout", type=float, default=400.0, help="seconds per job")
    args = parser.parse_args(argv)
    try:
        import transformers  # noqa: F401
    except ImportError:
        parser.error("needs transformers: pip install -e '.[frameworks]'")
    archs = [a.strip() for a in args.arch.split(",") if a.strip()]
    unknown = [a for a in archs if a not in ZOO and a not in PLAIN]
    if unknown:
        parser.error(f"unknown architecture(s) {', '.join(unknown)}; known: {', '.join([*ZOO, *PLAIN])}")
    rows, bad = run_rows(archs, lambda arch: one(arch, args), losses_judged=True)
    print()
    print(
        "| arch | state | blocks | budget MiB | measured | predicted | verified | peak error | "
        "step before / predicted / verified ms | losses bit-identical | exit plain / checkpoint |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        state = r["state"] or "-"
        if r["refused"]:
            state += f" ({'; '.join(str(x) for x in r['refused'])[:80]})"
        times = " / ".join(
            "-" if r[k] is None else f"{r[k] * 1000:.0f}" for k in ("before_s", "predicted_s", "verified_s")
        )
        print(
            f"| {r['arch']} | {state} | {len(r['modules'])} | {mib(r['budget'])} | {mib(r['measured'])} "
            f"| {mib(r['predicted'])} | {mib(r['verified'])} | {pct(r['verified'], r['predicted'])} | {times} "
            f"| {said_losses(r)} ({r['steps']}) | {r['rc_plain']} / {r['rc']} |"
        )
    print(f"\n{len(rows)} architecture(s), {bad} with a problem (a job died, a loss changed, a peak over budget)")
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
