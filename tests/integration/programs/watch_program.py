"""A small gloo training job with one injected fault, for the watch's fault suite.

Every rank trains (load_next_batch, forward, backward, an all_reduce of the gradients, an
optimizer step). Prints ``READY <pid>`` after its first step, and ``FAULT <pid>`` when it
reaches the fault (every rank for the phases every rank goes through, the faulty rank only
otherwise). ``--fault``:

  sleep-data   rank --fault-rank sleeps forever in load_next_batch at step --fault-at (or,
               with --fault-file, at the first step past it once that file exists)
  skip         rank --fault-rank skips the gradients' all_reduce at that step and goes on to
               the metrics all_reduce (on another process group), where it waits for ever
  stop         rank --fault-rank stops itself with SIGSTOP in load_next_batch
  spin         rank --fault-rank spins in pure Python (spin_in_python) for ever
  gil          rank --fault-rank sleeps in a C call that holds the GIL (hold_gil_in_c)
  checkpoint   every rank writes its checkpoint shard for --phase-seconds (save_checkpoint), then a barrier
  eval         every rank evaluates for --phase-seconds: forward passes, no optimizer step
               (evaluate), an all_reduce of the metric every few batches
  slow-first   the first step takes --phase-seconds on every rank (compile_model: CPU work before it)
  slow-warmup  the DataLoader's workers take --phase-seconds to give the first batch (warm_up)

Ends after --max-seconds (the faulty ranks are killed by the test).
"""

from __future__ import annotations

import argparse
import ctypes
import os
import signal
import sys
import time

import torch
import torch.distributed as dist

FAULTS = ("none", "sleep-data", "skip", "stop", "spin", "gil", "checkpoint", "eval", "slow-first", "slow-warmup")


def say(word: str) -> None:
    os.write(1, f"{word} {os.getpid()}\n".encode())


BURN_SLICE_S = 0.01
BURN_REST_S = 0.03


def burn(seconds: float) -> int:
    """CPU work in Python for ``seconds`` of wall time, a quarter of it on the CPU: slices of
    10 ms of CPU (of this thread's CPU time, not of the clock: a process behind others on a
    loaded machine still spends it), 30 ms apart. The watch calls a rank that spends 0.1 CPU-s
    between its two looks (1.5 s apart here) moving; a quarter of a core is several times that,
    and four ranks that burn together do not take a whole 2-core machine from the tests beside
    them."""
    end = time.monotonic() + seconds
    n = 0
    while time.monotonic() < end:
        slice_end = time.thread_time() + BURN_SLICE_S
        while time.thread_time() < slice_end and time.monotonic() < end:
            n += sum(i * i for i in range(2000)) % 7
        time.sleep(max(0.0, min(BURN_REST_S, end - time.monotonic())))
    return n


class WarmDataset(torch.utils.data.Dataset):  # type: ignore[type-arg]
    """Items whose first takes its worker ``warm_s`` (an index being built, a quarter of a core)."""

    def __init__(self, warm_s: float, width: int) -> None:
        self.warm_s = warm_s
        self.width = width

    def __len__(self) -> int:
        return 1 << 20

    def __getitem__(self, i: int) -> torch.Tensor:
        if i == 0 and self.warm_s:
            warm_up(self.warm_s)
        return torch.randn(self.width)


def warm_up(seconds: float) -> None:
    burn(seconds)


def load_next_batch(args: argparse.Namespace, faulty: bool, x: torch.Tensor) -> torch.Tensor:
    if faulty:
        if args.fault == "sleep-data":
            say("FAULT")
            while True:
                time.sleep(1.0)
        if args.fault == "stop":
            say("FAULT")
            os.kill(os.getpid(), signal.SIGSTOP)
    return x


def spin_in_python() -> None:
    say("FAULT")
    x = 1.0
    while True:
        x = (x * 1.000001) % 7.0


def hold_gil_in_c(seconds: int) -> None:
    say("FAULT")
    ctypes.PyDLL("libc.so.6").sleep(seconds)  # a PyDLL call keeps the GIL: no Python runs meanwhile


def save_checkpoint(path: str, seconds: float) -> None:
    say("FAULT")
    chunk = os.urandom(1 << 20)
    end = time.monotonic() + seconds
    with open(path, "wb") as fh:
        while time.monotonic() < end:
            fh.write(chunk)
            fh.flush()
            os.fsync(fh.fileno())
            fh.seek(0)  # keep the file small: the shard is rewritten, not grown
            time.sleep(0.1)  # a slow file system: ~10 MiB/s, far above the watch's 1 MiB a look
    os.unlink(path)


def evaluate(model: torch.nn.Module, x: torch.Tensor, seconds: float) -> float:
    say("FAULT")
    end = time.monotonic() + seconds
    total = 0.0
    with torch.no_grad():
        while True:
            for _ in range(20):
                total += float(model(x).sum())
                burn(BURN_SLICE_S)
                time.sleep(BURN_REST_S)  # the batch's rest of the time: its data, its device
            # the metric, and whether any rank is past the end: every rank stops at the same batch
            t = torch.tensor([total, 1.0 if time.monotonic() >= end else 0.0])
            dist.all_reduce(t)
            if t[1].item() > 0:
                return float(t[0].item())


def compile_model(seconds: float) -> None:
    say("FAULT")
    burn(seconds)


def report_metrics(loss: torch.Tensor, group: object) -> None:
    dist.all_reduce(loss.detach().clone(), group=group)  # type: ignore[arg-type]


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--fault", choices=FAULTS, default="none")
    parser.add_argument("--fault-rank", type=int, default=1)
    parser.add_argument("--fault-at", type=int, default=8, help="the step at which the fault comes")
    parser.add_argument(
        "--fault-file", default="", help="the faulty rank's fault waits, past --fault-at, until this file exists"
    )
    parser.add_argument("--phase-seconds", type=float, default=20.0)
    # 10 steps a second: a rank's own steady cost is then about 4 % of a core (at 20 a second it
    # was 8 %), and four ranks per case share a small machine with the rest of the suite
    parser.add_argument("--step-sleep", type=float, default=0.1)
    parser.add_argument("--max-seconds", type=float, default=120.0)
    parser.add_argument("--end-file", default="", help="every rank ends at the step after this file exists")
    parser.add_argument("--out", default="/tmp", help="where checkpoint shards are written")
    args = parser.parse_args()

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    metrics_group = dist.new_group(list(range(dist.get_world_size())))
    torch.manual_seed(rank)
    model = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    loader = None
    if args.fault == "slow-warmup":
        loader = iter(torch.utils.data.DataLoader(WarmDataset(args.phase_seconds, 32), batch_size=16, num_workers=1))
    x = torch.randn(16, 32)
    deadline = time.monotonic() + args.max_seconds
    step = 0
    fault_step: int | None = None
    while True:
        if (
            fault_step is None
            and rank == args.fault_rank
            and step >= args.fault_at
            and (not args.fault_file or os.path.exists(args.fault_file))
        ):
            fault_step = step
        faulty = step == fault_step
        if step == 0 and args.fault == "slow-first":
            compile_model(args.phase_seconds)
        if loader is not None:
            if step == 0:
                say("FAULT")
            x = next(loader)
        x = load_next_batch(args, faulty, x)
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        if faulty and args.fault == "spin":
            spin_in_python()
        if faulty and args.fault == "gil":
            hold_gil_in_c(int(args.max_seconds) + 60)
        if not (faulty and args.fault == "skip"):
            for p in model.parameters():
                assert p.grad is not None
                dist.all_reduce(p.grad)
        elif faulty:
            say("FAULT")
        if step % 5 == 4 or (faulty and args.fault == "skip"):
            report_metrics(loss, metrics_group)
        opt.step()
        step += 1
        if step == 1:
            say("READY")
        if step == args.fault_at and args.fault == "checkpoint":
            save_checkpoint(os.path.join(args.out, f"shard-{rank}-{os.getpid()}.pt"), args.phase_seconds)
            dist.barrier()
        if step == args.fault_at and args.fault == "eval":
            evaluate(model, x, args.phase_seconds)
        time.sleep(args.step_sleep)
        # Every rank ends at the same step (one that ends alone breaks its peers' collectives).
        end = time.monotonic() >= deadline or bool(args.end_file and os.path.exists(args.end_file))
        past = torch.tensor([1.0 if end else 0.0])
        dist.all_reduce(past, op=dist.ReduceOp.MAX)
        if past.item() > 0:
            break
    dist.barrier()
    dist.destroy_process_group()
    print(f"DONE {step}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
