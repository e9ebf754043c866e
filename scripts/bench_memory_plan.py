#!/usr/bin/env python3
"""Check the memory plan's predictions against real runs: three models, one plan each.

For each model (a decoder-only transformer, a ViT-B/16, a ResNet-50 with torchvision's layout;
synthetic data; bf16 autocast and AdamW with foreach, as on CUDA by default):

1. train two steps, take the real peak of a third, then measure one with
   :func:`collectors.memory.plan.capture.measure_step` (``reset_peak``: this is the
   benchmark's own process);
2. plan for a budget of --budget-fraction (0.6) of the measured peak;
3. run again with the chosen modules wrapped in ``torch.utils.checkpoint`` (non-reentrant, the
   plan's recipe), and again with every block wrapped: the real peaks;
4. time the three configurations in turn, --steps rounds (medians);
5. print the acceptance table: peak before, budget, predicted and real peak after, the error,
   under the budget or not, predicted and real added step time, the error, and the memory saved
   per added millisecond (real) for the plan and for checkpointing every block; then every
   block's predicted and real peak and time.

The real peak is ``torch.cuda.max_memory_allocated`` after ``reset_peak_memory_stats`` on CUDA;
on the CPU it is the live tensor bytes after every operator (:class:`LiveTensorBytes`, run
alone), and step times are this process's CPU time with one torch thread (a shared machine's
other load does not count; the CPU's times are still noisy, its memory is not). Needs only
torch (and dynprof from this checkout).

    python3 scripts/bench_memory_plan.py --out /tmp/plan.json               # CUDA, sized for an H200
    python3 scripts/bench_memory_plan.py --device cpu --out /tmp/plan.json  # small models, ~30 s
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
import torch.nn.functional as F
import torch.utils.checkpoint as cp

from collectors.memory.plan.blocks import find_blocks, live_tensors
from collectors.memory.plan.capture import measure_step
from collectors.memory.plan.measurement import from_json
from collectors.memory.plan.meter import LiveTensorBytes
from collectors.memory.plan.predict import candidates, peak_with, predict
from collectors.memory.plan.scale import predicted_peak
from collectors.memory.plan.solve import make_plan
from collectors.memory.plan.timing import TIMED_STEPS

GIB = 1024**3


# -- models ------------------------------------------------------------------------------------
class DecoderBlock(torch.nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = torch.nn.LayerNorm(d)
        self.qkv = torch.nn.Linear(d, 3 * d, bias=False)
        self.proj = torch.nn.Linear(d, d, bias=False)
        self.ln2 = torch.nn.LayerNorm(d)
        self.up = torch.nn.Linear(d, 4 * d, bias=False)
        self.down = torch.nn.Linear(4 * d, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, s, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, s, d))
        return x + self.down(F.gelu(self.up(self.ln2(x))))


class Decoder(torch.nn.Module):
    def __init__(self, vocab: int, d: int, heads: int, layers: int) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, d)
        self.layers = torch.nn.ModuleList([DecoderBlock(d, heads) for _ in range(layers)])
        self.ln = torch.nn.LayerNorm(d)
        self.head = torch.nn.Linear(d, vocab, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for layer in self.layers:
            x = layer(x)
        return self.head(self.ln(x))


class ViT(torch.nn.Module):
    def __init__(self, image: int, patch: int, d: int, heads: int, layers: int, classes: int) -> None:
        super().__init__()
        self.patch = torch.nn.Conv2d(3, d, patch, patch)
        tokens = (image // patch) ** 2 + 1
        self.cls = torch.nn.Parameter(torch.zeros(1, 1, d))
        self.pos = torch.nn.Parameter(torch.zeros(1, tokens, d))
        self.layers = torch.nn.ModuleList(
            [
                torch.nn.TransformerEncoderLayer(d, heads, 4 * d, dropout=0.0, batch_first=True, norm_first=True)
                for _ in range(layers)
            ]
        )
        self.ln = torch.nn.LayerNorm(d)
        self.head = torch.nn.Linear(d, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.patch(x).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls.expand(x.shape[0], -1, -1), x], dim=1) + self.pos
        for layer in self.layers:
            x = layer(x)
        return self.head(self.ln(x[:, 0]))


class Bottleneck(torch.nn.Module):
    def __init__(self, cin: int, width: int, stride: int) -> None:
        super().__init__()
        cout = width * 4
        self.conv1 = torch.nn.Conv2d(cin, width, 1, bias=False)
        self.bn1 = torch.nn.BatchNorm2d(width)
        self.conv2 = torch.nn.Conv2d(width, width, 3, stride, 1, bias=False)
        self.bn2 = torch.nn.BatchNorm2d(width)
        self.conv3 = torch.nn.Conv2d(width, cout, 1, bias=False)
        self.bn3 = torch.nn.BatchNorm2d(cout)
        self.relu = torch.nn.ReLU(inplace=True)
        self.downsample = (
            torch.nn.Sequential(torch.nn.Conv2d(cin, cout, 1, stride, bias=False), torch.nn.BatchNorm2d(cout))
            if stride != 1 or cin != cout
            else None
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.relu(self.bn1(self.conv1(x)))
        y = self.relu(self.bn2(self.conv2(y)))
        y = self.bn3(self.conv3(y))
        return self.relu(y + (self.downsample(x) if self.downsample is not None else x))


class ResNet(torch.nn.Module):
    """torchvision's ResNet layout and names (conv1, bn1, layer1..layer4 of bottlenecks, fc)."""

    def __init__(self, depths: tuple[int, ...], classes: int, base: int = 64) -> None:
        super().__init__()
        self.conv1 = torch.nn.Conv2d(3, base, 7, 2, 3, bias=False)
        self.bn1 = torch.nn.BatchNorm2d(base)
        self.relu = torch.nn.ReLU(inplace=True)
        self.maxpool = torch.nn.MaxPool2d(3, 2, 1)
        cin = base
        for i, n in enumerate(depths):
            width = base * 2**i
            blocks = []
            for j in range(n):
                blocks.append(Bottleneck(cin, width, 2 if (j == 0 and i > 0) else 1))
                cin = width * 4
            self.add_module(f"layer{i + 1}", torch.nn.Sequential(*blocks))
        self.fc = torch.nn.Linear(cin, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        for i in range(1, 5):
            x = getattr(self, f"layer{i}")(x)
        return self.fc(x.mean((2, 3)))


def build(name: str, device: torch.device, small: bool, times: int = 1) -> tuple[torch.nn.Module, Any, Any]:
    """(model, a batch maker, the loss of a batch's output); ``times``: the micro-batch that many
    times the usual (the same model is built: seeded)."""
    classes = 10 if small else 1000
    model: torch.nn.Module
    if name == "decoder":
        vocab, d, heads, layers, batch, seq = (512, 128, 4, 8, 4, 256) if small else (32000, 2048, 16, 24, 4, 4096)
        model = Decoder(vocab, d, heads, layers)
        ids = torch.randint(0, vocab, (batch * times, seq + 1), device=device)
        return model, lambda: ids[:, :-1], lambda out: F.cross_entropy(out.flatten(0, 1).float(), ids[:, 1:].flatten())
    if name == "vit":
        image, patch, d, heads, layers, batch = (64, 8, 96, 4, 6, 16) if small else (224, 16, 768, 12, 12, 256)
        model = ViT(image, patch, d, heads, layers, classes)
        x = torch.randn(batch * times, 3, image, image, device=device)
        y = torch.randint(0, classes, (batch * times,), device=device)
        return model, lambda: x, lambda out: F.cross_entropy(out.float(), y)
    depths, image, batch, base = ((3, 4, 6, 3), 128, 8, 8) if small else ((3, 4, 6, 3), 224, 256, 64)
    model = ResNet(depths, classes, base)
    x = torch.randn(batch * times, 3, image, image, device=device)
    y = torch.randint(0, classes, (batch * times,), device=device)
    return model, lambda: x, lambda out: F.cross_entropy(out.float(), y)


# -- runs --------------------------------------------------------------------------------------
def checkpointed(model: torch.nn.Module, names: set[str]) -> list[tuple[torch.nn.Module, Any]]:
    """Wrap the forward of the modules named ``names`` in a non-reentrant checkpoint; returns
    what to restore."""
    restore = []
    for name, mod in model.named_modules():
        if name in names:
            fwd = mod.forward
            restore.append((mod, fwd))
            mod.forward = lambda *a, _f=fwd, **k: cp.checkpoint(_f, *a, use_reentrant=False, **k)  # type: ignore[method-assign]
    return restore


def unwrap(restore: list[tuple[torch.nn.Module, Any]]) -> None:
    for mod, fwd in restore:
        mod.forward = fwd  # type: ignore[method-assign]


def known_tensors(model: torch.nn.Module, opt: Any) -> list[torch.Tensor]:
    """What lives before a step: parameters, gradients, optimizer state."""
    out = [p for p in model.parameters()] + [p.grad for p in model.parameters() if p.grad is not None]
    for per in opt.state.values():
        out += [v for v in per.values() if isinstance(v, torch.Tensor)]
    return out


def real_peak(step: Any, device: torch.device, model: torch.nn.Module, opt: Any) -> int:
    """One step's real peak: the CUDA allocator's (reset before it), or on the CPU the live
    tensor bytes after each operator (:class:`LiveTensorBytes`, run alone: no plan hooks)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        step()
        torch.cuda.synchronize(device)
        return int(torch.cuda.max_memory_allocated(device))
    gc.collect()
    # every tensor alive (the batch, the last step's outputs), as an allocator and the measurement count
    with LiveTensorBytes(known_tensors(model, opt) + live_tensors()) as live:
        step()
    live.close()
    return live.peak


def clock(device: torch.device) -> Any:
    """The step timer: wall time on CUDA (synchronised); on the CPU, this process's CPU time
    (one torch thread: a shared machine's other load does not count)."""
    return time.perf_counter if device.type == "cuda" else time.process_time


def timed(step: Any, device: torch.device) -> float:
    now = clock(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t0 = now()
    step()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return now() - t0


def bench(name: str, device: torch.device, args: argparse.Namespace) -> dict[str, Any]:
    torch.manual_seed(0)
    small = device.type != "cuda"
    model, batch, loss_of = build(name, device, small)
    model.to(device)
    # the step's data, swapped whole for the micro-batch twice the size (the first freed)
    data = {"batch": batch, "loss": loss_of}
    del batch, loss_of
    # foreach: what AdamW uses on CUDA by default (its temporaries are part of the peak)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
    amp_on = device.type == "cuda" or args.cpu_amp

    def step() -> None:
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=amp_on):
            loss = data["loss"](model(data["batch"]()))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(2):  # warm up: the optimizer state exists, kernels are chosen
        step()
    base_peak = real_peak(step, device, model, opt)
    t0 = time.perf_counter()
    gc.collect()
    # --as-agent: measured as the agent measures a job (its peak statistic never reset)
    doc = measure_step(
        model, opt, step, reset_peak=not args.as_agent, clock=clock(device), timed_steps=args.timed_steps
    )
    measure_s = time.perf_counter() - t0
    m = from_json(doc)
    budget = int(m.peak_bytes * args.budget_fraction)
    plan = make_plan(m, budget=budget)
    # the same job measured and planned again, for the same budget: how stable the plan is
    gc.collect()
    again = make_plan(
        from_json(
            measure_step(
                model, opt, step, reset_peak=not args.as_agent, clock=clock(device), timed_steps=args.timed_steps
            )
        ),
        budget=budget,
    )
    chosen = set(plan["plan"]["modules"]) if plan["plan"] else set()
    every = {n for n, _ in find_blocks([model])}
    pred_plan = predict(m, chosen)
    pred_every = predict(m, every)

    def peak_of(names: set[str]) -> int:
        restore = checkpointed(model, names)
        try:
            step()
            return real_peak(step, device, model, opt)
        finally:
            unwrap(restore)

    plan_peak = peak_of(chosen) if chosen else base_peak
    every_peak = peak_of(every)
    # step times: the three configurations in turn, round after round (a load that drifts
    # weighs on all three alike); the medians
    runs: dict[str, list[float]] = {"base": [], "plan": [], "every": []}
    for _ in range(args.steps):
        for key, names in (("base", set()), ("plan", chosen), ("every", every)):
            restore = checkpointed(model, names)
            try:
                runs[key].append(timed(step, device))
            finally:
                unwrap(restore)
    base_s, plan_s, every_s = (statistics.median(runs[k]) for k in ("base", "plan", "every"))
    fewer = fewer_fit(m, plan)
    # fewer blocks for real: an even spread of one block fewer than the plan's, run
    spread = even_spread([n for n, _ in find_blocks([model])], len(chosen) - 1) if len(chosen) > 1 else None
    fewer["real_even_spread_peak_bytes"] = peak_of(set(spread)) if spread else None
    fewer["real_even_spread_under_budget"] = fewer["real_even_spread_peak_bytes"] <= budget if spread else None
    # the micro-batch at twice the measured one: the scaled prediction against a real run of it
    double = twice_the_batch(name, device, small, data, step, model, opt)
    predicted_double = predicted_peak(m, 2.0)

    def per_ms(saved: float, added_s: float) -> float | None:
        return round(saved / GIB / (added_s * 1000), 6) if added_s > 0 else None

    def err(real: float, predicted: float | None) -> float | None:
        return round((real - predicted) / predicted, 4) if predicted else None

    p = plan["plan"] or {}
    predicted = pred_plan["predicted_peak_bytes"] if chosen else None
    out = {
        "model": name,
        "device": str(device),
        "blocks": len(m.blocks),
        "block_names": [b.name for b in m.blocks],
        "measured_peak_bytes": m.peak_bytes,
        "peak_before_bytes": base_peak,
        "budget_bytes": budget,
        "margin_bytes": plan["margin_bytes"],
        "status": plan["status"],
        "chosen": sorted(chosen),
        "predicted_peak_bytes": predicted,
        "real_peak_after_bytes": plan_peak if chosen else None,
        "under_budget": plan_peak <= budget if chosen else None,
        "peak_error": err(plan_peak, predicted) if chosen else None,
        "step_s_before": round(base_s, 6),
        "measured_step_s": m.step_s,
        "measure_s": round(measure_s, 3),
        "predicted_added_step_s": p.get("added_step_s") if chosen else None,
        "real_added_step_s": round(plan_s - base_s, 6) if chosen else None,
        "step_error": err(plan_s - base_s, p.get("added_step_s")) if chosen else None,
        "plan_gib_saved_per_added_ms_real": per_ms(base_peak - plan_peak, plan_s - base_s) if chosen else None,
        "every_block_predicted_peak_bytes": pred_every["predicted_peak_bytes"],
        "every_block_real_peak_bytes": every_peak,
        "every_block_peak_error": err(every_peak, pred_every["predicted_peak_bytes"]),
        "every_block_predicted_added_step_s": round(pred_every["added_step_s"], 6),
        "every_block_real_added_step_s": round(every_s - base_s, 6),
        "every_block_step_error": err(every_s - base_s, pred_every["added_step_s"]),
        "every_block_gib_saved_per_added_ms_real": per_ms(base_peak - every_peak, every_s - base_s),
        "floor_bytes": plan["floor_bytes"],
        "exact": plan.get("exact"),
        "fewer": fewer,
        "double_predicted_peak_bytes": predicted_double,
        "double_real_peak_bytes": double,
        "double_peak_error": err(double, predicted_double) if double else None,
        # a second measurement and plan of the same job for the same budget
        "again_blocks": len((again["plan"] or {}).get("modules") or []),
        "again_predicted_added_step_s": (again["plan"] or {}).get("added_step_s"),
        "again_vs_first": err((again["plan"] or {}).get("added_step_s") or 0.0, p.get("added_step_s"))
        if chosen
        else None,
    }
    return out


def even_spread(names: list[str], k: int) -> list[str]:
    """``k`` of ``names`` spread evenly (every other block, for half of them)."""
    if k <= 0:
        return []
    n = len(names)
    return [names[(i * n) // k] for i in range(k)]


BRUTE_MAX = 1 << 17  # subsets of one size tried one by one at the most


def fewer_fit(m: Any, plan: dict[str, Any]) -> dict[str, Any]:
    """Whether a set of fewer blocks than the plan's meets the plan's own rule (predicted peak
    at most the budget less the margin), by the measured figures: every set of one block fewer
    where there are at most :data:`BRUTE_MAX` of them, else the plan's set less each of its
    blocks and an even spread (checked, not searched)."""
    chosen = (plan.get("plan") or {}).get("modules") or []
    k = len(chosen)
    out: dict[str, Any] = {"plan_blocks": k, "tried": 0, "fits": None, "how": None}
    if k <= 1:
        return out
    c = candidates(m)
    limit = plan["budget_bytes"] - plan["margin_bytes"]
    n = len(c.index)
    name_of = [m.blocks[i].name for i in c.index]
    total = 1
    for i in range(k - 1):  # C(n, k-1), stopped once over the bound
        total = total * (n - i) // (i + 1)
        if total > BRUTE_MAX:
            break
    if total <= BRUTE_MAX:
        sets: Any = itertools.combinations(range(n), k - 1)
        out["how"] = f"every set of {k - 1} of {n} blocks"
    else:
        pos = {nm: j for j, nm in enumerate(name_of)}
        idx = [pos[nm] for nm in chosen if nm in pos]
        sets = [tuple(x for x in idx if x != drop) for drop in idx]
        sets.append(tuple(pos[nm] for nm in even_spread(name_of, k - 1)))
        out["how"] = f"the plan's set less each block, and an even spread ({total:,}+ sets of {k - 1}: not all tried)"
    best = None
    cheapest = None  # the least added time of a fewer-block set that fits
    for chosen_set in sets:
        out["tried"] += 1
        peak = peak_with(c, chosen_set)
        best = peak if best is None else min(best, peak)
        if peak <= limit:
            cost = sum(c.seconds[j] for j in chosen_set)
            cheapest = cost if cheapest is None else min(cheapest, cost)
    out["fits"] = best is not None and best <= limit
    out["best_predicted_peak_bytes"] = best
    out["fewer_fitting_added_s"] = cheapest
    out["exhaustive"] = exhaustive(c, limit)
    return out


EXHAUSTIVE_MAX = 16  # blocks up to which every set of them is tried


def exhaustive(c: Any, limit: int) -> dict[str, Any] | None:
    """The solver checked against every set of the candidates (at most :data:`EXHAUSTIVE_MAX`):
    the least added time of a set whose predicted peak is at most ``limit``, and its size."""
    n = len(c.index)
    if n > EXHAUSTIVE_MAX:
        return None
    best: tuple[float, int] | None = None
    for mask in range(1 << n):
        chosen_set = tuple(j for j in range(n) if mask >> j & 1)
        cost = sum(c.seconds[j] for j in chosen_set)
        if best is not None and cost >= best[0]:
            continue
        if peak_with(c, chosen_set) <= limit:
            best = (cost, len(chosen_set))
    return {"sets": 1 << n, "added_s": best[0], "blocks": best[1]} if best else {"sets": 1 << n, "added_s": None}


def twice_the_batch(
    name: str, device: torch.device, small: bool, data: dict[str, Any], step: Any, model: Any, opt: Any
) -> int | None:
    """The real peak of the same model's step on a micro-batch twice the usual (the usual one's
    tensors freed first, as in a job run with the larger size); None where it does not fit the
    device."""
    other, data["batch"], data["loss"] = build(name, device, small, times=2)
    del other  # the model build() made beside the data: not part of the step
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    try:
        step()  # warm up: kernels for the new shapes
        return real_peak(step, device, model, opt)
    except torch.OutOfMemoryError:
        return None
    finally:
        data.clear()
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()


def size(b: int | None, unit: int) -> str:
    return "-" if b is None else f"{b / unit:.2f}"


def ms(s: float | None) -> str:
    return "-" if s is None else f"{s * 1000:+.1f}"


def pct(x: float | None) -> str:
    return "-" if x is None else f"{x * 100:+.1f} %"


def table(results: list[dict[str, Any]], device: torch.device) -> str:
    """The acceptance table: one row per model; then checkpointing every block beside it."""
    unit, uname = (GIB, "GiB") if device.type == "cuda" else (1024**2, "MiB")
    rows = [
        f"| model | peak before ({uname}) | budget | predicted | real after | peak error | under budget "
        f"| added step predicted / real (ms) | step error | {uname} saved per added ms: plan / every block (real) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]

    def rate(x: float | None) -> str:
        return "-" if x is None else f"{x * GIB / unit:.4g}"

    for r in results:
        label = f"{r['model']}, {r['blocks']} blocks ({len(r['chosen'])} chosen)"
        if r["status"] == "unreachable":
            label += f"; unreachable, floor {size(r['floor_bytes'], unit)}"
        under = "-" if r["under_budget"] is None else ("yes" if r["under_budget"] else "NO")
        rows.append(
            f"| {label} | {size(r['peak_before_bytes'], unit)} | {size(r['budget_bytes'], unit)} "
            f"| {size(r['predicted_peak_bytes'], unit)} | {size(r['real_peak_after_bytes'], unit)} "
            f"| {pct(r['peak_error'])} | {under} "
            f"| {ms(r['predicted_added_step_s'])} / {ms(r['real_added_step_s'])} | {pct(r['step_error'])} "
            f"| {rate(r['plan_gib_saved_per_added_ms_real'])} / {rate(r['every_block_gib_saved_per_added_ms_real'])} |"
        )
    rows += [
        "",
        f"| every block checkpointed | predicted peak ({uname}) | real peak | peak error "
        "| added step predicted / real (ms) | step error |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for r in results:
        rows.append(
            f"| {r['model']} | {size(r['every_block_predicted_peak_bytes'], unit)} "
            f"| {size(r['every_block_real_peak_bytes'], unit)} | {pct(r['every_block_peak_error'])} "
            f"| {ms(r['every_block_predicted_added_step_s'])} / {ms(r['every_block_real_added_step_s'])} "
            f"| {pct(r['every_block_step_error'])} |"
        )
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda", help="cuda (default; sized for an H200) or cpu (small models)")
    parser.add_argument("--out", default="", help="also write the JSON summary there")
    parser.add_argument("--budget-fraction", type=float, default=0.6, help="the budget, as a fraction of the peak")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per configuration (median)")
    parser.add_argument("--models", default="decoder,vit,resnet")
    parser.add_argument(
        "--timed-steps",
        type=int,
        default=TIMED_STEPS,
        help=f"plain steps whose blocks' forward is timed before the measured one, as the agent does "
        f"(default {TIMED_STEPS}; 0: the measured step's own times)",
    )
    parser.add_argument("--cpu-amp", action="store_true", help="on the CPU, bf16 autocast as on CUDA (slow)")
    parser.add_argument(
        "--as-agent",
        action="store_true",
        help="measure as the agent does in a job: the allocator's peak statistic is never reset",
    )
    args = parser.parse_args(argv)
    if not 0 < args.budget_fraction < 1:
        parser.error("--budget-fraction must be between 0 and 1")
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("CUDA is not available here; use --device cpu")
    if device.type == "cpu":
        torch.set_num_threads(1)
    results = []
    t0 = time.perf_counter()
    for name in args.models.split(","):
        r = bench(name.strip(), device, args)
        results.append(r)
        gc.collect()  # the model and its optimizer are gone with bench()'s frame
        if device.type == "cuda":
            torch.cuda.empty_cache()
        print(
            f"{r['model']}: {r['blocks']} blocks ({', '.join(r['block_names'][:3])}, ...), {r['status']}, "
            f"chosen {', '.join(r['chosen']) or 'none'}; measured in {r['measure_s']} s; measured and planned "
            f"again: {r['again_blocks']} block(s), added time {ms(r['again_predicted_added_step_s'])} ms against "
            f"{ms(r['predicted_added_step_s'])} ms ({(r['again_vs_first'] or 0) * 100:+.1f} %)",
            flush=True,
        )
        f = r["fewer"]
        unit, uname = (GIB, "GiB") if device.type == "cuda" else (1024**2, "MiB")
        if f["how"]:
            real = f.get("real_even_spread_peak_bytes")
            print(
                f"  fewest: the plan's {f['plan_blocks']} block(s); {f['how']}: {f['tried']} tried, "
                f"{'one FITS' if f['fits'] else 'none fits'} by the measured figures"
                + (
                    f"; real peak of an even spread of {f['plan_blocks'] - 1}: {real / unit:.2f} {uname} "
                    f"({'under' if f['real_even_spread_under_budget'] else 'over'} the budget "
                    f"{r['budget_bytes'] / unit:.2f} {uname})"
                    if real
                    else ""
                )
                + f"; search exact: {r['exact']}",
                flush=True,
            )
            plan_ms = (r["predicted_added_step_s"] or 0.0) * 1000
            if f["fits"] and f.get("fewer_fitting_added_s") is not None:
                print(
                    f"  the fewer-block set that fits costs +{f['fewer_fitting_added_s'] * 1000:.1f} ms predicted, "
                    f"the plan's +{plan_ms:.1f} ms",
                    flush=True,
                )
            ex = f.get("exhaustive")
            if ex:
                cheapest = ex["added_s"]
                print(
                    f"  exhaustive: of all {ex['sets']:,} sets, the cheapest that fits the plan's limit: "
                    + (
                        f"{ex['blocks']} block(s), +{cheapest * 1000:.1f} ms predicted (the plan's "
                        f"{f['plan_blocks']}, +{plan_ms:.1f} ms)"
                        if cheapest is not None
                        else "none"
                    ),
                    flush=True,
                )
        if r["double_real_peak_bytes"]:
            print(
                f"  micro-batch x2: predicted {r['double_predicted_peak_bytes'] / unit:.2f} {uname}, real "
                f"{r['double_real_peak_bytes'] / unit:.2f} {uname} ({pct(r['double_peak_error'])})",
                flush=True,
            )
        else:
            print("  micro-batch x2: does not fit the device", flush=True)
    summary: dict[str, Any] = {
        "schema": 2,
        "device": str(device),
        "torch": torch.__version__,
        "seconds": round(time.perf_counter() - t0, 1),
        "models": results,
    }
    if device.type == "cuda":
        summary["gpu"] = torch.cuda.get_device_name(device)
    print()
    print(table(results, device))
    if args.out:
        Path(args.out).write_text(json.dumps(summary, indent=2) + "\n")
        print(f"summary written to {args.out}")
    print(f"({summary['seconds']} s in all)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
