"""A stand-in for Slurm's ``srun`` that starts every task on this machine.

Reads ``--ntasks=N`` (or ``--nodes=N``) and ``--label``, ignores srun's other options, and runs
the command (everything from the first argument that is not an option) N times at once, with
``SLURM_PROCID``/``SLURM_NODEID`` set; with ``--label`` each task's output line is written as
``T: line``, as srun does. ``FAKE_SRUN_TASKS`` makes tasks misbehave instead of running:
``2=silent,3=garbage,4=flood,5=chatty,6=terse,7=unlabelled`` (prints nothing, prints text that
is not JSON, prints 5 MiB, prints short lines until it is stopped, prints one-character lines
until it is stopped, prints lines without a label until it is stopped).
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading


def main() -> int:
    args = sys.argv[1:]
    ntasks, label = 1, False
    while args and args[0].startswith("-"):
        opt = args.pop(0)
        if opt.startswith(("--ntasks=", "--nodes=")):
            ntasks = int(opt.split("=", 1)[1])
        elif opt == "--label":
            label = True
    modes = dict(item.split("=", 1) for item in os.environ.get("FAKE_SRUN_TASKS", "").split(",") if "=" in item)
    lock = threading.Lock()

    def write(task: int, line: str, labelled: bool = True) -> None:
        with lock:
            sys.stdout.write((f"{task}: " if label and labelled else "") + line)
            sys.stdout.flush()

    def run(task: int) -> None:
        mode = modes.get(str(task))
        if mode == "silent":
            return
        if mode == "garbage":
            write(task, "Traceback (most recent call last): not a report\n")
            return
        if mode == "chatty":
            while True:
                write(task, "still here\n")
        if mode == "terse":
            chunk = f"{task}: x\n" * 64 if label else "x\n" * 64  # 64 labelled lines a write
            while True:
                write(task, chunk, labelled=False)
        if mode == "unlabelled":
            while True:
                write(task, "no label\n", labelled=False)
        if mode == "flood":
            for _ in range(5 * 1024):
                write(task, "x" * 1023 + "\n")
            return
        env = dict(os.environ, SLURM_PROCID=str(task), SLURM_NODEID=str(task))
        proc = subprocess.Popen(args, stdout=subprocess.PIPE, text=True, env=env)
        assert proc.stdout is not None
        for line in proc.stdout:
            write(task, line)
        proc.wait()

    threads = [threading.Thread(target=run, args=(t,)) for t in range(ntasks)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return 0


if __name__ == "__main__":
    sys.exit(main())
