#!/usr/bin/env python3
"""Check the memory plan's predictions against real runs: three models, one plan each.

For each model (a decoder-only transformer, a ViT, a ResNet; synthetic data), on CUDA (or the
CPU with --device cpu, small sizes):

1. train a few steps, then measure one with :func:`collectors.memory.plan_capture.measure_step`;
2. plan for a budget of --budget-fraction (0.6) of the measured peak;
3. run again with the chosen modules wrapped in ``torch.utils.checkpoint`` (non-reentrant),
   and again with every block wrapped;
4. print the measured peak before, the predicted peak, the real peak after, the budget, the
   predicted and real step-time increase, and, for the plan and for checkpointing every
   block, the memory saved per added millisecond.

Needs only torch (and dynprof from this checkout). Peaks are ``torch.cuda.max_memory_allocated``
after ``reset_peak_memory_stats`` (this is the benchmark's own process); step times are the
median of --steps steps, synchronised. On the CPU the peak is the measurement's own sum
(parameters, gradients, optimizer state, saved tensors) and the "real" peak after is measured
the same way with checkpointing on, which the saved-tensor hooks see through
``torch.utils.checkpoint``'s own.

    python scripts/bench_memory_plan.py --out /tmp/plan.json            # H200: < 3 minutes
    python scripts/bench_memory_plan.py --device cpu --out /tmp/plan.json
"""

from __future__ import annotations

import argparse
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

from collectors.memory.plan import from_json, make_plan, predict
from collectors.memory.plan_capture import find_blocks, measure_step

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
        self.down = (
            torch.nn.Sequential(torch.nn.Conv2d(cin, cout, 1, stride, bias=False), torch.nn.BatchNorm2d(cout))
            if stride != 1 or cin != cout
            else None
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.relu(self.bn1(self.conv1(x)))
        y = F.relu(self.bn2(self.conv2(y)))
        y = self.bn3(self.conv3(y))
        return F.relu(y + (self.down(x) if self.down is not None else x))


class ResNet(torch.nn.Module):
    def __init__(self, depths: tuple[int, ...], classes: int, base: int = 64) -> None:
        super().__init__()
        self.stem = torch.nn.Sequential(
            torch.nn.Conv2d(3, base, 7, 2, 3, bias=False),
            torch.nn.BatchNorm2d(base),
            torch.nn.ReLU(),
            torch.nn.MaxPool2d(3, 2, 1),
        )
        stages, cin = [], base
        for i, n in enumerate(depths):
            width = base * 2**i
            blocks = []
            for j in range(n):
                blocks.append(Bottleneck(cin, width, 2 if (j == 0 and i > 0) else 1))
                cin = width * 4
            stages.append(torch.nn.Sequential(*blocks))
        self.stages = torch.nn.Sequential(*stages)
        self.head = torch.nn.Linear(cin, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.stages(self.stem(x)).mean((2, 3)))


def build(name: str, device: torch.device, small: bool) -> tuple[torch.nn.Module, Any, Any]:
    """(model, a batch maker, the loss of a batch's output)."""
    classes = 10 if small else 1000
    model: torch.nn.Module
    if name == "decoder":
        vocab, d, heads, layers, batch, seq = (256, 64, 4, 4, 4, 128) if small else (32000, 2048, 16, 24, 4, 4096)
        model = Decoder(vocab, d, heads, layers)
        ids = torch.randint(0, vocab, (batch, seq + 1), device=device)
        return model, lambda: ids[:, :-1], lambda out: F.cross_entropy(out.flatten(0, 1).float(), ids[:, 1:].flatten())
    if name == "vit":
        image, patch, d, heads, layers, batch = (32, 8, 32, 4, 4, 16) if small else (224, 16, 768, 12, 12, 256)
        model = ViT(image, patch, d, heads, layers, classes)
        x = torch.randn(batch, 3, image, image, device=device)
        y = torch.randint(0, classes, (batch,), device=device)
        return model, lambda: x, lambda out: F.cross_entropy(out.float(), y)
    depths, image, batch, base = ((1, 1, 1, 1), 32, 4, 8) if small else ((3, 4, 6, 3), 224, 256, 64)
    model = ResNet(depths, classes, base)
    x = torch.randn(batch, 3, image, image, device=device)
    y = torch.randint(0, classes, (batch,), device=device)
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


def run_steps(step: Any, device: torch.device, steps: int) -> tuple[int, float]:
    """(peak bytes over the steps, median step seconds)."""
    times = []
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    for _ in range(steps):
        t0 = time.perf_counter()
        step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t0)
    peak = int(torch.cuda.max_memory_allocated(device)) if device.type == "cuda" else 0
    return peak, statistics.median(times)


def bench(name: str, device: torch.device, args: argparse.Namespace) -> dict[str, Any]:
    torch.manual_seed(0)
    small = device.type != "cuda"
    model, batch, loss_of = build(name, device, small)
    model.to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    amp = torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")

    def step() -> None:
        with amp:
            loss = loss_of(model(batch()))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(2):  # warm up: the optimizer state exists, kernels are chosen
        step()
    base_peak, base_s = run_steps(step, device, args.steps)
    doc = measure_step(model, opt, step, reset_peak=True, overhead_of=base_s)
    m = from_json(doc)
    budget = int(m.peak_bytes * args.budget_fraction)
    plan = make_plan(m, budget=budget)
    chosen = set(plan["plan"]["modules"]) if plan["plan"] else set()
    every = {n for n, _ in find_blocks([model])}
    pred_every = predict(m, every)

    def real(names: set[str]) -> tuple[int, float]:
        restore = checkpointed(model, names)
        try:
            step()
            if device.type == "cuda":
                return run_steps(step, device, args.steps)
            after = from_json(measure_step(model, opt, step))
            _, seconds = run_steps(step, device, args.steps)
            return after.peak_bytes, seconds
        finally:
            unwrap(restore)

    measured_peak = m.peak_bytes if device.type != "cuda" else base_peak
    plan_peak, plan_s = real(chosen) if chosen else (measured_peak, base_s)
    every_peak, every_s = real(every)

    def per_ms(saved: float, added_s: float) -> float | None:
        return round(saved / GIB / (added_s * 1000), 6) if added_s > 0 else None

    p = plan["plan"] or {}
    out = {
        "model": name,
        "device": str(device),
        "blocks": len(m.blocks),
        "measured_peak_bytes": m.peak_bytes,
        "peak_over_steps_bytes": base_peak if device.type == "cuda" else None,
        "budget_bytes": budget,
        "status": plan["status"],
        "chosen": sorted(chosen),
        "predicted_peak_bytes": p.get("predicted_peak_bytes"),
        "real_peak_after_bytes": plan_peak,
        "under_budget": plan_peak <= budget,
        "prediction_error": round((plan_peak - p["predicted_peak_bytes"]) / plan_peak, 4) if p else None,
        "step_s_before": round(base_s, 6),
        "measured_step_s": m.step_s,
        "predicted_added_step_s": p.get("added_step_s"),
        "real_added_step_s": round(plan_s - base_s, 6),
        "plan_gib_saved_per_added_ms_predicted": per_ms(m.peak_bytes - p["predicted_peak_bytes"], p["added_step_s"])
        if p
        else None,
        "plan_gib_saved_per_added_ms_real": per_ms(measured_peak - plan_peak, plan_s - base_s),
        "every_block_predicted_peak_bytes": pred_every["predicted_peak_bytes"],
        "every_block_real_peak_bytes": every_peak,
        "every_block_predicted_added_step_s": round(pred_every["added_step_s"], 6),
        "every_block_real_added_step_s": round(every_s - base_s, 6),
        "every_block_gib_saved_per_added_ms_predicted": per_ms(
            m.peak_bytes - pred_every["predicted_peak_bytes"], pred_every["added_step_s"]
        ),
        "every_block_gib_saved_per_added_ms_real": per_ms(measured_peak - every_peak, every_s - base_s),
        "floor_bytes": plan["floor_bytes"],
    }
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return out


def g(b: int | None) -> str:
    if b is None:
        return "-"
    return f"{b / GIB:.2f} GiB" if b >= GIB else f"{b / 1024**2:.2f} MiB"


def ms(s: float | None) -> str:
    return f"{s * 1000:+.1f} ms" if s is not None else "-"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda", help="cuda (default) or cpu (small models)")
    parser.add_argument("--out", required=True, help="where to write the JSON summary")
    parser.add_argument("--budget-fraction", type=float, default=0.6, help="the budget, as a fraction of the peak")
    parser.add_argument("--steps", type=int, default=3, help="steps timed per run (median)")
    parser.add_argument("--models", default="decoder,vit,resnet")
    args = parser.parse_args(argv)
    if not 0 < args.budget_fraction < 1:
        parser.error("--budget-fraction must be between 0 and 1")
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("CUDA is not available here; use --device cpu")
    results = []
    t0 = time.perf_counter()
    for name in args.models.split(","):
        r = bench(name.strip(), device, args)
        results.append(r)
        print(f"{r['model']} ({r['blocks']} blocks, {len(r['chosen'])} chosen, {r['status']}):")
        print(
            f"  peak before {g(r['measured_peak_bytes'])}, budget {g(r['budget_bytes'])}, predicted "
            f"{g(r['predicted_peak_bytes'])}, real after {g(r['real_peak_after_bytes'])} "
            f"({'under' if r['under_budget'] else 'OVER'} budget; error {r['prediction_error']})"
        )
        print(
            f"  step {r['step_s_before'] * 1000:.1f} ms; added: predicted {ms(r['predicted_added_step_s'])}, "
            f"real {ms(r['real_added_step_s'])}"
        )
        print(
            f"  GiB saved per added ms: plan {r['plan_gib_saved_per_added_ms_predicted']} predicted / "
            f"{r['plan_gib_saved_per_added_ms_real']} real; every block "
            f"{r['every_block_gib_saved_per_added_ms_predicted']} predicted / "
            f"{r['every_block_gib_saved_per_added_ms_real']} real (peak {g(r['every_block_real_peak_bytes'])})"
        )
        sys.stdout.flush()
    summary = {"schema": 1, "device": str(device), "seconds": round(time.perf_counter() - t0, 1), "models": results}
    if device.type == "cuda":
        summary["gpu"] = torch.cuda.get_device_name(device)
    Path(args.out).write_text(json.dumps(summary, indent=2) + "\n")
    print(f"summary written to {args.out} ({summary['seconds']} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
