#!/usr/bin/env python3
"""`dynprof run --checkpoint` on the memory plan bench's models: the plan applied in a running
job, its verified peak against the budget and its verified step time against the prediction.

    PYTHONPATH=. python scripts/bench_checkpoint.py                       # CUDA: decoder, vit, resnet at 60 %
    PYTHONPATH=. python scripts/bench_checkpoint.py --device cpu --budget 70%

For each model of scripts/bench_memory_plan.py (on CUDA: a 24-block bf16 decoder with a
32 000-word head and an fp32 loss, a ViT-B/16, a ResNet-50; on the CPU their small versions) it
runs the model's training loop twice for --steps steps, in a process of its own: plain, and under
`dynprof run --checkpoint BUDGET`. It reads the agent's final line on the job's stderr and the
memory-plan artifact the agent kept, and prints one row per model: the state, the blocks
recomputed, the budget, the measured, predicted and verified peak, the step time before, predicted
and verified (and the error), whether every loss is the plain run's bit for bit (where not, the
first step that differs and the first step the job ran with the wrappers), with --control whether
the plain job run twice gives the same losses, and whether each job ended by itself. Exits 1 when a job died or a verified peak is over its budget; the step
time's error and the losses are reported, not judged (a GPU's kernels need not be bit-for-bit
deterministic run to run).
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

from zoo_checkpoint import (  # noqa: E402
    first_differ,
    job_env,
    losses,
    pct,
    plain_and_checkpointed,
    run_job,
    run_rows,
    said_losses,
)

GIB = 1024**3
UNIT = (GIB, "GiB")  # MiB for the CPU's small models (set in main)


def train(model_name: str, device_name: str, steps: int) -> int:
    """The job: the bench model's training loop, each step's loss printed (``LOSS i hex``)."""
    import torch
    from bench_memory_plan import build

    device = torch.device(device_name)
    if device.type == "cpu":
        torch.set_num_threads(1)
    torch.manual_seed(0)
    model, batch, loss_of = build(model_name, device, device.type != "cuda")
    model.to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
    for i in range(steps):
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            loss = loss_of(model(batch()))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        print(f"LOSS {i} {loss.item().hex()}", flush=True)
    return 0


def one(model_name: str, args: argparse.Namespace) -> dict[str, Any]:
    work = Path(tempfile.mkdtemp(prefix="dpckpt-"))
    try:
        job = [sys.executable, str(Path(__file__).resolve()), "--job", model_name]
        job += ["--device", args.device, "--steps", str(args.steps)]
        env = job_env(work, f"ckpt-{model_name}")
        row = {"model": model_name, **plain_and_checkpointed(job, env, args.budget, args.timeout)}
        if args.control:
            row["control"] = plain_again(job, env, args.timeout, row["plain_losses"])
        return row
    finally:
        shutil.rmtree(work, ignore_errors=True)


def plain_again(job: list[str], env: dict[str, str], timeout: float, first: list[str]) -> str:
    """The same plain job once more: whether the device's own kernels give the same losses run to
    run (where they do not, a difference under --checkpoint is not the wrappers' alone)."""
    rc, out, _err = run_job(job, env, timeout)
    if rc:
        return f"exit {rc}"
    at = first_differ(first, losses(out))
    return "yes" if at is None else f"no, from step {at}"


def gib(b: Any) -> str:
    return "-" if not isinstance(b, (int, float)) else f"{b / UNIT[0]:.2f}"


def ms(s: Any) -> str:
    return "-" if not isinstance(s, (int, float)) else f"{s * 1000:.1f}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="decoder,vit,resnet")
    parser.add_argument("--device", default="cuda", help="cuda (default) or cpu (the small models)")
    parser.add_argument("--budget", default="60%", help="dynprof run --checkpoint's budget (default 60%%)")
    parser.add_argument("--steps", type=int, default=24, help="training steps per job")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per job")
    parser.add_argument(
        "--control",
        action="store_true",
        help="run each plain job twice, and say whether its own losses are the same run to run",
    )
    parser.add_argument("--job", default="", help=argparse.SUPPRESS)  # the training job itself
    args = parser.parse_args(argv)
    if args.job:
        return train(args.job, args.device, args.steps)
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    unknown = [m for m in models if m not in ("decoder", "vit", "resnet")]
    if unknown:
        parser.error(f"unknown model(s) {', '.join(unknown)}; known: decoder, vit, resnet")
    global UNIT
    if args.device == "cpu":
        UNIT = (1024**2, "MiB")
    rows, bad = run_rows(models, lambda name: one(name, args), losses_judged=False)
    print()
    print(
        f"| model | state | blocks | budget {UNIT[1]} | measured | predicted | verified | peak error | under budget "
        "| step before / predicted / verified ms | step error | losses bit-identical | plain twice | exit plain / checkpoint |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        under = (
            "-"
            if not (isinstance(r["verified"], int) and isinstance(r["budget"], int))
            else ("yes" if r["verified"] <= r["budget"] else "NO")
        )
        print(
            f"| {r['model']} | {r['state'] or '-'} | {len(r['modules'])} | {gib(r['budget'])} | {gib(r['measured'])} "
            f"| {gib(r['predicted'])} | {gib(r['verified'])} | {pct(r['verified'], r['predicted'])} | {under} "
            f"| {ms(r['before_s'])} / {ms(r['predicted_s'])} / {ms(r['verified_s'])} "
            f"| {pct(r['verified_s'], r['predicted_s'])} | {said_losses(r)} | {r.get('control', 'not run')} "
            f"| {r['rc_plain']} / {r['rc']} |"
        )
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
