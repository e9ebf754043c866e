"""Enumerate the ways a training loop waits for its GPU, as torch itself says them.

Each candidate idiom of a training loop (scalar reads, Python conditions and formatting on CUDA
tensors, data-dependent shapes, host copies either way, waits on streams, events and the device,
cuBLAS/cuDNN calls and kernel launches behind a full launch queue, NCCL host waits) is run on
the GPU under ``torch.cuda.set_sync_debug_mode("warn")`` (does torch say it synchronizes?) and,
when it does, again under ``"error"`` with a dispatch mode that names each aten operator that
raised torch's "called a synchronizing CUDA operation" at its synchronize. An idiom torch
reports is in the suite with the operators it named; an idiom whose wait is the API's
contract (an explicit synchronize, a launch into a full queue, a host wait on NCCL work: torch
does not warn for those) is in the suite by that contract, said so; an idiom torch does not
report and no contract makes a wait (a non-blocking copy into pinned memory, say) is left out
and printed as such. So the suite (tests/gpu/test_gpu_faults.py, one rank blocked behind an
endless kernel per idiom) follows what the installed torch does.

    python scripts/enumerate_gpu_waits.py            # enumerate, print, write tests/gpu/gpu_waits.json
    python scripts/enumerate_gpu_waits.py --check    # print only

Without CUDA it says so and exits 0, writing nothing (the suite then takes every candidate).
The candidates' code is :data:`IDIOMS`: tests/gpu/programs/gpu_fault_program.py runs one behind
an endless kernel (``--fault NAME``).
"""

from __future__ import annotations

import argparse
import json
import sys
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
SUITE_JSON = ROOT / "tests" / "gpu" / "gpu_waits.json"
SYNC_WARNING = "synchronizing CUDA operation"


@dataclass
class Context:
    """What an idiom works on: the device, a small CUDA tensor, a model and its optimizer, and the
    rank's own one-member NCCL group (None where the process has none)."""

    device: Any
    probe: Any
    model: Any = None
    opt: Any = None
    own: Any = None
    scratch: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Idiom:
    name: str
    family: str  # what kind of wait it is
    how: str  # the code, as a training loop writes it
    run: Callable[[Context], object]
    contract: str | None = None  # why it waits where torch does not report it; None: torch must
    needs: str = ""  # "nccl": the rank's own NCCL group (TORCH_NCCL_BLOCKING_WAIT=1)
    expected: bool = True  # False: a candidate torch is expected not to report (a check of the enumeration)


def _cond(c: Context) -> None:
    if c.probe.sum() > 0:  # a Python condition on a CUDA tensor
        c.scratch["seen"] = True


def _nan_check(c: Context) -> None:
    if torch().isnan(c.probe).any():  # the usual NaN guard
        c.scratch["nan"] = True


def _launch_loop(c: Context) -> None:
    tiny = c.probe.clone()
    for _ in range(200_000):  # each launch queues behind the endless kernel until the queue is full
        tiny.add_(1.0)


def _matmul_loop(c: Context) -> None:
    a = torch().ones(64, 64, device=c.device)
    for _ in range(200_000):  # cuBLAS launches, until the queue is full
        a = torch().mm(a, a)


def _conv_loop(c: Context) -> None:
    x = torch().ones(1, 4, 16, 16, device=c.device)
    w = torch().ones(4, 4, 3, 3, device=c.device)
    for _ in range(200_000):  # cuDNN launches, until the queue is full
        x = torch().nn.functional.conv2d(x, w, padding=1)


def _clip(c: Context) -> None:
    for p in c.model.parameters():
        p.grad = torch().ones_like(p)
    torch().nn.utils.clip_grad_norm_(c.model.parameters(), 1.0, error_if_nonfinite=True)


def _scaler_step(c: Context) -> None:
    scaler = torch().amp.GradScaler("cuda")
    loss = c.model(torch().ones(2, c.model[0].in_features, device=c.device)).sum()
    scaler.scale(loss).backward()
    scaler.step(c.opt)  # reads whether the gradients were finite


def _save(c: Context) -> None:
    import io

    torch().save({"probe": c.probe}, io.BytesIO())


def _event_sync(c: Context) -> None:
    event = torch().cuda.Event()
    event.record()
    event.synchronize()


def _h2d_pageable(c: Context) -> None:
    host = torch().ones(1 << 20)  # pageable: the copy waits for the stream, then copies
    host.to(c.device)
    torch().cuda.current_stream(c.device).synchronize()


def _nccl_wait(c: Context) -> None:
    import torch.distributed as dist

    dist.all_reduce(c.probe, group=c.own, async_op=True).wait()


def _copy_to_host(c: Context) -> None:
    out = torch().empty(c.probe.shape)
    out.copy_(c.probe)


def _index_assign(c: Context) -> None:
    t = c.probe.clone()
    t[t > 0] = 0.0


IDIOMS: tuple[Idiom, ...] = (
    # scalar reads
    Idiom("item", "scalar read", "loss.item()", lambda c: c.probe.sum().item()),
    Idiom("float", "scalar read", "float(loss)", lambda c: float(c.probe.sum())),
    Idiom("int", "scalar read", "int(count)", lambda c: int(c.probe.sum())),
    Idiom("tensor-of-scalars", "scalar read", "torch.tensor([a, b])", lambda c: torch().tensor([c.probe.sum()])),
    # Python conditions and formatting on CUDA tensors
    Idiom("if-tensor", "python condition", "if loss > 0:", _cond),
    Idiom("nan-check", "python condition", "if torch.isnan(x).any():", _nan_check),
    Idiom("equal", "python condition", "torch.equal(a, b)", lambda c: torch().equal(c.probe, c.probe)),
    Idiom("format", "formatting", 'f"{loss:.3f}"', lambda c: f"{c.probe.sum():.3f}"),
    Idiom("str", "formatting", "str(tensor) / print(tensor)", lambda c: str(c.probe)),
    Idiom("tolist", "host copy", "tensor.tolist()", lambda c: c.probe.tolist()),
    # data-dependent shapes
    Idiom("nonzero", "data-dependent shape", "x.nonzero()", lambda c: c.probe.nonzero()),
    Idiom("masked-select", "data-dependent shape", "x.masked_select(m)", lambda c: c.probe.masked_select(c.probe > 0)),
    Idiom("unique", "data-dependent shape", "torch.unique(x)", lambda c: torch().unique(c.probe)),
    Idiom("bool-index", "data-dependent shape", "x[x > 0]", lambda c: c.probe[c.probe > 0]),
    Idiom("bool-index-assign", "data-dependent shape", "x[x > 0] = 0", _index_assign),
    Idiom("where-one-arg", "data-dependent shape", "torch.where(m)", lambda c: torch().where(c.probe > 0)),
    Idiom("bincount", "data-dependent shape", "torch.bincount(i)", lambda c: torch().bincount(c.probe.long())),
    # host copies, either way
    Idiom("cpu", "host copy", "x.cpu()", lambda c: c.probe.cpu()),
    Idiom("to-cpu", "host copy", "x.to('cpu')", lambda c: c.probe.to("cpu")),
    Idiom("numpy", "host copy", "x.cpu().numpy()", lambda c: c.probe.cpu().numpy()),
    Idiom("copy-to-host", "host copy", "host_buf.copy_(x)", _copy_to_host),
    Idiom("save", "host copy", "torch.save({'w': x}, f)", _save),
    Idiom(
        "d2h-non-blocking",
        "host copy",
        "x.to('cpu', non_blocking=True)",
        lambda c: c.probe.to("cpu", non_blocking=True),
        expected=False,  # into pinned memory, queued: no wait
    ),
    Idiom(
        "h2d-pageable",
        "host copy",
        "pageable_batch.to('cuda')",
        _h2d_pageable,
        contract="a copy from pageable memory is staged by the host behind the stream's work",
    ),
    # training-loop utilities that read a device value
    Idiom("clip-grad-nonfinite", "scalar read", "clip_grad_norm_(..., error_if_nonfinite=True)", _clip),
    Idiom("grad-scaler-step", "scalar read", "GradScaler.step(opt)", _scaler_step),
    # waits on streams, events and the device
    Idiom(
        "cuda-sync",
        "explicit wait",
        "torch.cuda.synchronize()",
        lambda c: torch().cuda.synchronize(c.device),
        contract="a device synchronize waits for all its work",
    ),
    Idiom(
        "stream-sync",
        "explicit wait",
        "stream.synchronize()",
        lambda c: torch().cuda.current_stream(c.device).synchronize(),
        contract="a stream synchronize waits for the stream's work",
    ),
    Idiom(
        "event-sync", "explicit wait", "event.synchronize()", _event_sync, contract="an event synchronize waits for it"
    ),
    Idiom(
        "empty-cache",
        "explicit wait",
        "torch.cuda.empty_cache()",
        lambda c: torch().cuda.empty_cache(),
        contract="freeing cached blocks waits for the work that may still use them",
    ),
    # launches behind a full queue
    Idiom(
        "launch-queue-full",
        "full launch queue",
        "a loop of small kernels",
        _launch_loop,
        contract="a kernel launch into a full queue waits for a slot",
    ),
    Idiom(
        "cublas-queue-full",
        "full launch queue",
        "a loop of matmuls (cuBLAS)",
        _matmul_loop,
        contract="a cuBLAS launch into a full queue waits for a slot",
    ),
    Idiom(
        "cudnn-queue-full",
        "full launch queue",
        "a loop of convolutions (cuDNN)",
        _conv_loop,
        contract="a cuDNN launch into a full queue waits for a slot",
    ),
    # NCCL, waited for on the host (one GPU allows the rank's own one-member group)
    Idiom(
        "nccl-wait",
        "NCCL host wait",
        "work = dist.all_reduce(x, async_op=True); work.wait()",
        _nccl_wait,
        contract="TORCH_NCCL_BLOCKING_WAIT=1 makes Work.wait() wait on the host",
        needs="nccl",
    ),
)


def torch() -> Any:
    import torch as t

    return t


def _recorder(set_mode: Callable[[str], None]) -> Any:
    """A dispatch mode that names each aten operator that synchronizes.

    Run under ``set_sync_debug_mode("error")``: torch then raises inside the operator at the
    moment it would synchronize, so the operator that does is the one whose call raised here. A
    warning (the ``"warn"`` mode) is only turned into a Python warning when the outermost call
    from Python returns, after every operator it dispatched: it cannot name one (seen on an H100:
    every operator column empty). The raising operator is noted and run again with the check
    off (``set_mode``), so the idiom goes on as it would."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class SyncRecorder(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.ops: list[str] = []

        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            kwargs = kwargs or {}
            try:
                return func(*args, **kwargs)
            except RuntimeError as exc:
                if SYNC_WARNING not in str(exc):
                    raise
            name = str(func.overloadpacket.__name__) if hasattr(func, "overloadpacket") else str(func)
            if name not in self.ops:
                self.ops.append(name)
            set_mode("default")
            try:
                return func(*args, **kwargs)
            finally:
                set_mode("error")

    return SyncRecorder()


def try_idiom(idiom: Idiom, c: Context) -> dict[str, Any]:
    """Run ``idiom`` under the sync debug mode: whether torch warns that it synchronizes (once,
    ``"warn"``), and which operators do (again, ``"error"``; a synchronize outside any operator,
    as ``torch.cuda.synchronize``, is said as such)."""
    t = torch()
    t.cuda.synchronize(c.device)
    error = None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        t.cuda.set_sync_debug_mode("warn")
        try:
            idiom.run(c)
        except Exception as exc:  # a candidate this torch cannot run: said, not in the suite
            error = f"{type(exc).__name__}: {exc}"[:300]
        finally:
            t.cuda.set_sync_debug_mode("default")
    t.cuda.synchronize(c.device)
    reported = any(SYNC_WARNING in str(w.message) for w in caught)
    ops: list[str] = []
    if reported and error is None:
        record = _recorder(t.cuda.set_sync_debug_mode)
        t.cuda.set_sync_debug_mode("error")
        try:
            with record:
                idiom.run(c)
        except RuntimeError as exc:
            if SYNC_WARNING not in str(exc):
                raise
            record.ops.append("(outside any operator)")
        finally:
            t.cuda.set_sync_debug_mode("default")
        t.cuda.synchronize(c.device)
        ops = list(record.ops)
    return {"torch_reports": reported, "ops": ops, "error": error}


def _context() -> Context:
    t = torch()
    device = t.device("cuda", 0)
    model = t.nn.Sequential(t.nn.Linear(8, 8)).to(device)
    opt = t.optim.SGD(model.parameters(), lr=1e-3)
    return Context(device=device, probe=t.arange(4.0, device=device), model=model, opt=opt)


def _quick(idiom: Idiom) -> Idiom:
    """A full-queue loop shortened for the enumeration (nothing is ahead of it here)."""
    if idiom.family != "full launch queue":
        return idiom

    def few(c: Context) -> None:
        c.scratch["quick"] = True

    return Idiom(idiom.name, idiom.family, idiom.how, few, idiom.contract, idiom.needs, idiom.expected)


def enumerate_waits() -> dict[str, Any]:
    """Every candidate tried on this machine's GPU 0; the document the suite reads."""
    t = torch()
    c = _context()
    cases, left_out = [], []
    for idiom in IDIOMS:
        if idiom.needs == "nccl":  # needs a process group: its wait is the contract's, not tried here
            found: dict[str, Any] = {"torch_reports": False, "ops": [], "error": None}
        else:
            found = try_idiom(_quick(idiom), c)
        row = {**_row(idiom), **found}
        if found["error"] is None and (found["torch_reports"] or idiom.contract):
            cases.append(row)
        else:
            left_out.append(row)
    return {
        "torch": str(t.__version__),
        "cuda": str(t.version.cuda),
        "device": str(t.cuda.get_device_name(0)),
        "cases": cases,
        "left_out": left_out,
    }


def suite_cases(path: Path = SUITE_JSON) -> list[dict[str, Any]]:
    """The suite's cases: the enumeration written on a GPU machine when there is one (``path``),
    else every candidate expected to wait (run the script on the GPU machine first: the list is
    then what its torch says)."""
    if path.is_file():
        try:
            doc = json.loads(path.read_text()[:1_000_000])
            cases = [c for c in doc.get("cases") or [] if isinstance(c, dict) and isinstance(c.get("name"), str)]
            known = {i.name for i in IDIOMS}
            return [c for c in cases if c["name"] in known]
        except (OSError, ValueError):
            pass
    return [_row(i) for i in IDIOMS if i.expected]


def _row(i: Idiom) -> dict[str, Any]:
    return {"name": i.name, "family": i.family, "how": i.how, "contract": i.contract, "needs": i.needs}


def idiom(name: str) -> Idiom | None:
    return next((i for i in IDIOMS if i.name == name), None)


def _print(doc: dict[str, Any]) -> None:
    print(f"torch {doc['torch']} (CUDA {doc['cuda']}) on {doc['device']}")
    print(f"{'idiom':<22} {'family':<22} {'torch says':<12} synchronizing operators / contract")
    for row in doc["cases"]:
        says = "sync" if row["torch_reports"] else "-"
        why = ", ".join(row["ops"]) if row["ops"] else (row["contract"] or "")
        print(f"{row['name']:<22} {row['family']:<22} {says:<12} {why}")
    for row in doc["left_out"]:
        why = row["error"] or "torch reports no sync and no contract makes it a wait"
        print(f"{row['name']:<22} {row['family']:<22} {'left out':<12} {why}")
    print(f"{len(doc['cases'])} ways in the suite, {len(doc['left_out'])} left out")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="print only, do not write the suite's list")
    parser.add_argument("--out", default=str(SUITE_JSON), help="where the suite's list is written")
    args = parser.parse_args(argv)
    try:
        import torch as t
    except ImportError:
        print("no torch here: nothing to enumerate (pip install torch on a CUDA machine)")
        return 0
    if not t.cuda.is_available():
        print(
            f"no CUDA here (torch {t.__version__}): nothing enumerated, nothing written; "
            f"the suite takes all {len(IDIOMS)} candidates: " + ", ".join(i.name for i in IDIOMS)
        )
        return 0
    doc = enumerate_waits()
    _print(doc)
    if not args.check:
        Path(args.out).write_text(json.dumps(doc, indent=1) + "\n")
        print(f"written: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
