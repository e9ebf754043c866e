"""The memory plan: which blocks to recompute in backward to bring a step's peak under a budget.

The input is one measured step (:mod:`.plan_capture`, in the training process): each block's
freeable saved-tensor bytes and forward time, the step's peak and its parts. The plan is the
set of blocks whose checkpointing brings the peak under the budget (or saves the asked bytes)
at the least added recompute time, found exactly by dynamic programming over the blocks (a 0/1
knapsack: the Pareto front of (bytes freed, time added) over the blocks seen so far).

**The predicted peak.** Checkpointing a set S frees the blocks' freeable bytes at the start of
backward; in backward, each checkpointed block recomputes its forward and holds its saved
tensors again while its own backward runs, one block at a time. So

    predicted peak = peak - sum(freeable of S) + max(freeable of S)

which is what the plan is held to. Recompute time is the blocks' measured forward time.

**The floor.** Parameters, gradients, optimizer state, the activations no block can free, the
temporaries, and one block recomputed: no set of blocks goes lower. A budget under it gets that
answer with the options beyond recomputation and what each would save.

This module needs no torch: the CLI plans from the agent's answer, the benchmark in-process.
:func:`from_json` is the one decoder of a measurement, bounded (it comes from a process).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from dynprof.errors import ArtifactError

SCHEMA = 1
PLAN_SCHEMA = 1
MAX_BLOCKS = 4096
MAX_FRONT = 200_000  # Pareto states kept; beyond it the DP rounds bytes (and says so)
MAX_BYTES = 1 << 60
RUNNERS_UP = 3


@dataclass
class Block:
    name: str
    cls: str
    saved_bytes: int
    freeable_bytes: int
    forward_s: float
    calls: int = 1
    parameter_bytes: int = 0
    checkpointed: bool = False


@dataclass
class Measurement:
    device: str
    blocks: list[Block]
    peak_bytes: int
    peak_source: str
    activation_bytes: int
    unrecomputable_activation_bytes: int
    parameter_bytes: int
    gradient_bytes: int
    optimizer_state_bytes: int
    temporary_bytes: int
    step_s: float
    typical_step_s: float | None = None
    notes: list[str] = field(default_factory=list)
    error: str = ""

    def to_json(self) -> dict[str, Any]:
        return {
            "schema": SCHEMA,
            "device": self.device,
            "blocks": [
                {
                    "name": b.name,
                    "class": b.cls,
                    "saved_bytes": b.saved_bytes,
                    "freeable_bytes": b.freeable_bytes,
                    "forward_s": b.forward_s,
                    "calls": b.calls,
                    "parameter_bytes": b.parameter_bytes,
                    "checkpointed": b.checkpointed,
                }
                for b in self.blocks
            ],
            "peak_bytes": self.peak_bytes,
            "peak_source": self.peak_source,
            "activation_bytes": self.activation_bytes,
            "unrecomputable_activation_bytes": self.unrecomputable_activation_bytes,
            "parameter_bytes": self.parameter_bytes,
            "gradient_bytes": self.gradient_bytes,
            "optimizer_state_bytes": self.optimizer_state_bytes,
            "temporary_bytes": self.temporary_bytes,
            "step_s": self.step_s,
            "typical_step_s": self.typical_step_s,
            "notes": list(self.notes),
            "error": self.error,
        }


def _int(doc: dict[str, Any], key: str, default: int | None = None) -> int:
    v = doc.get(key, default)
    if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= MAX_BYTES:
        raise ArtifactError(f"memory plan measurement: {key} is not a byte count: {str(v)[:40]!r}")
    return v


def _float(doc: dict[str, Any], key: str, default: float | None = None) -> float:
    v = doc.get(key, default)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v <= 1e7:
        raise ArtifactError(f"memory plan measurement: {key} is not a number of seconds: {str(v)[:40]!r}")
    return float(v)


def _str(doc: dict[str, Any], key: str, limit: int = 500) -> str:
    v = doc.get(key, "")
    if not isinstance(v, str):
        raise ArtifactError(f"memory plan measurement: {key} is not text")
    return v[:limit]


def from_json(doc: Any) -> Measurement:
    """The measurement in ``doc`` (from an agent, a file, a sidecar), checked and bounded."""
    if not isinstance(doc, dict):
        raise ArtifactError("memory plan measurement: not a JSON object")
    if doc.get("schema") != SCHEMA:
        raise ArtifactError(
            f"memory plan measurement: schema {str(doc.get('schema'))[:20]!r}, this dynprof reads {SCHEMA}",
            help="Use the same dynprof version for the CLI and the job.",
        )
    raw_blocks = doc.get("blocks")
    if not isinstance(raw_blocks, list) or len(raw_blocks) > MAX_BLOCKS:
        raise ArtifactError(f"memory plan measurement: blocks is not a list of at most {MAX_BLOCKS}")
    blocks = []
    for b in raw_blocks:
        if not isinstance(b, dict):
            raise ArtifactError("memory plan measurement: a block is not an object")
        calls = b.get("calls", 1)
        if isinstance(calls, bool) or not isinstance(calls, int) or not 0 <= calls <= 1_000_000:
            raise ArtifactError("memory plan measurement: a block's calls is not a count")
        blocks.append(
            Block(
                name=_str(b, "name", 300),
                cls=_str(b, "class", 200),
                saved_bytes=_int(b, "saved_bytes"),
                freeable_bytes=_int(b, "freeable_bytes"),
                forward_s=_float(b, "forward_s"),
                calls=calls,
                parameter_bytes=_int(b, "parameter_bytes", 0),
                checkpointed=bool(b.get("checkpointed", False)),
            )
        )
    notes = doc.get("notes", [])
    if not isinstance(notes, list) or not all(isinstance(n, str) for n in notes):
        raise ArtifactError("memory plan measurement: notes is not a list of text")
    typical = doc.get("typical_step_s")
    return Measurement(
        device=_str(doc, "device", 40),
        blocks=blocks,
        peak_bytes=_int(doc, "peak_bytes"),
        peak_source=_str(doc, "peak_source"),
        activation_bytes=_int(doc, "activation_bytes"),
        unrecomputable_activation_bytes=_int(doc, "unrecomputable_activation_bytes"),
        parameter_bytes=_int(doc, "parameter_bytes"),
        gradient_bytes=_int(doc, "gradient_bytes"),
        optimizer_state_bytes=_int(doc, "optimizer_state_bytes"),
        temporary_bytes=_int(doc, "temporary_bytes", 0),
        step_s=_float(doc, "step_s", 0.0),
        typical_step_s=None if typical is None else _float(doc, "typical_step_s"),
        notes=[n[:500] for n in notes[:50]],
        error=_str(doc, "error"),
    )


# -- the solver --------------------------------------------------------------------------------
@dataclass(frozen=True)
class Choice:
    blocks: tuple[int, ...]  # indices into the items
    freed: int  # sum of the items' bytes
    cost: float  # sum of the items' seconds
    held: int  # the largest item's bytes (held again while it recomputes)

    @property
    def saved(self) -> int:
        """What the choice takes off the peak: freed bytes less one block recomputed."""
        return self.freed - self.held


def solve(items: Sequence[tuple[int, float]], need: int, keep: int = 1 + RUNNERS_UP) -> tuple[list[Choice], bool]:
    """The cheapest sets of ``items`` (bytes, seconds) with ``freed - held >= need``, cheapest
    first (at most ``keep``), and whether the answer is exact.

    Exact: for each item m taken as the largest of the set (ties by index), the other items
    are those no larger, and a 0/1 knapsack over them (the Pareto front of freed bytes against
    seconds) finds every cheapest way to free ``need`` more bytes than m holds again."""
    n = len(items)
    order = sorted(range(n), key=lambda i: (items[i][0], i))
    exact = True
    found: list[Choice] = []
    for pos, m in enumerate(order):
        m_bytes, m_cost = items[m]
        want = need  # the others must free `need` (m's own freed bytes and its hold cancel)
        # Pareto front over order[:pos]: freed -> (cost, set); capped at `want` (more is no better).
        front: dict[int, list[tuple[float, tuple[int, ...]]]] = {0: [(0.0, ())]}
        for j in order[:pos]:
            b, c = items[j]
            add: dict[int, list[tuple[float, tuple[int, ...]]]] = {}
            for freed, states in front.items():
                nf = min(want, freed + b) if want > 0 else 0
                for cost, chosen in states:
                    add.setdefault(nf, []).append((cost + c, (*chosen, j)))
            for k, states in add.items():
                front.setdefault(k, []).extend(states)
            for k in list(front):
                front[k] = sorted(front[k])[:keep]
            # drop states dominated by one that frees at least as much for no more time
            best_above = float("inf")
            for k in sorted(front, reverse=True):
                states = [s for s in front[k] if s[0] <= best_above or k == want]
                if states:
                    front[k] = states
                    best_above = min(best_above, states[-1][0] if len(states) >= keep else float("inf"))
                else:
                    del front[k]
            if len(front) > MAX_FRONT:
                exact = False
                keys = sorted(front)
                front = {k: front[k] for k in keys[:: max(1, len(keys) // MAX_FRONT + 1)]}
        for cost, chosen in front.get(max(want, 0), []) if want > 0 else front.get(0, []):
            blocks = tuple(sorted((*chosen, m)))
            freed = sum(items[i][0] for i in blocks)
            found.append(Choice(blocks, freed, cost + m_cost, m_bytes))
    if need <= 0:
        found.append(Choice((), 0, 0.0, 0))
    unique: dict[tuple[int, ...], Choice] = {}
    for ch in found:
        if ch.saved >= need and ch.blocks not in unique:
            unique[ch.blocks] = ch
    ranked = sorted(unique.values(), key=lambda c: (c.cost, -c.saved, len(c.blocks), c.blocks))
    return ranked[:keep], exact


# -- the plan ----------------------------------------------------------------------------------
def _block_items(m: Measurement) -> list[int]:
    return [i for i, b in enumerate(m.blocks) if not b.checkpointed and b.freeable_bytes > 0]


def floor_bytes(m: Measurement) -> int:
    """The lowest peak checkpointing can reach: every block checkpointed, one recomputed."""
    idx = _block_items(m)
    freed = sum(m.blocks[i].freeable_bytes for i in idx)
    held = max((m.blocks[i].freeable_bytes for i in idx), default=0)
    return max(0, m.peak_bytes - freed + held)


def make_plan(m: Measurement, budget: int | None = None, save: int | None = None) -> dict[str, Any]:
    """The plan's document (``--json``): the chosen blocks, the predicted peak and step-time
    increase, the runners-up, the floor, and how to apply it."""
    if (budget is None) == (save is None):
        raise ValueError("give exactly one of budget and save")
    need = (m.peak_bytes - budget) if budget is not None else int(save or 0)
    target = budget if budget is not None else m.peak_bytes - need
    idx = _block_items(m)
    items = [(m.blocks[i].freeable_bytes, m.blocks[i].forward_s) for i in idx]
    choices, exact = solve(items, need)
    step = m.typical_step_s or m.step_s

    def describe(ch: Choice) -> dict[str, Any]:
        names = [m.blocks[idx[i]].name for i in ch.blocks]
        return {
            "modules": names,
            "freed_bytes": ch.freed,
            "saved_bytes": ch.saved,
            "predicted_peak_bytes": m.peak_bytes - ch.saved,
            "added_step_s": round(ch.cost, 6),
            "added_step_fraction": round(ch.cost / step, 4) if step else None,
        }

    floor = floor_bytes(m)
    doc: dict[str, Any] = {
        "schema": PLAN_SCHEMA,
        "measurement": m.to_json(),
        "budget_bytes": target,
        "need_bytes": max(need, 0),
        "exact": exact,
        "floor_bytes": floor,
        "candidates": len(idx),
    }
    if choices:
        doc["status"] = "fits" if choices[0].blocks else "fits-already"
        doc["plan"] = describe(choices[0])
        doc["runners_up"] = [describe(c) for c in choices[1:]]
        doc["apply"] = how_to_apply(m, doc["plan"]["modules"])
    else:
        doc["status"] = "unreachable"
        doc["plan"] = None
        doc["runners_up"] = []
        doc["beyond"] = beyond_recompute(m, floor, target)
    return doc


def beyond_recompute(m: Measurement, floor: int, target: int) -> list[dict[str, Any]]:
    """What else would take memory off the floor, with the figure each saves."""
    opt_grad = m.optimizer_state_bytes + m.gradient_bytes
    half_act = m.activation_bytes // 2
    return [
        {
            "option": "shard the optimizer state and gradients across N data-parallel ranks "
            "(ZeRO-2 / FSDP SHARD_GRAD_OP; ZeRO-3 / FSDP FULL_SHARD shards the parameters too)",
            "saves_bytes_with_8_ranks": opt_grad * 7 // 8,
            "saves_bytes_with_8_ranks_full_shard": (opt_grad + m.parameter_bytes) * 7 // 8,
        },
        {
            "option": "offload the optimizer state to host memory (DeepSpeed offload_optimizer, FSDP CPUOffload)",
            "saves_bytes": m.optimizer_state_bytes,
        },
        {
            "option": "halve the micro-batch (and double gradient accumulation to keep the batch)",
            "saves_bytes": half_act,
        },
        {
            "option": "the floor with recomputation of every block",
            "floor_bytes": floor,
            "short_by_bytes": floor - target,
        },
    ]


def how_to_apply(m: Measurement, modules: list[str]) -> dict[str, str]:
    """How to checkpoint exactly ``modules`` in the usual frameworks."""
    names = ", ".join(repr(n) for n in modules[:64]) + (", ..." if len(modules) > 64 else "")
    classes = sorted({b.cls for b in m.blocks if b.name in set(modules)})
    return {
        "torch.utils.checkpoint": (
            "import torch.utils.checkpoint as cp\n"
            f"CHECKPOINT = {{{names}}}\n"
            "for name, mod in model.named_modules():\n"
            "    if name in CHECKPOINT:\n"
            "        fwd = mod.forward\n"
            "        mod.forward = lambda *a, _f=fwd, **k: cp.checkpoint(_f, *a, use_reentrant=False, **k)"
        ),
        "fsdp checkpoint_wrapper": (
            "from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (\n"
            "    apply_activation_checkpointing, checkpoint_wrapper)\n"
            f"CHECKPOINT = {{{names}}}\n"
            "ids = {id(m) for n, m in model.named_modules() if n in CHECKPOINT}\n"
            "apply_activation_checkpointing(model, checkpoint_wrapper_fn=checkpoint_wrapper,\n"
            "                               check_fn=lambda m: id(m) in ids)"
        ),
        "hugging face": (
            "model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={'use_reentrant': False})\n"
            "# it checkpoints every layer; to keep only the chosen ones, turn it off on the others:\n"
            f"CHECKPOINT = {{{names}}}\n"
            "for name, mod in model.named_modules():\n"
            "    if getattr(mod, 'gradient_checkpointing', False) and name not in CHECKPOINT:\n"
            "        mod.gradient_checkpointing = False"
        ),
        "deepspeed": (
            '"activation_checkpointing": {"partition_activations": false, "contiguous_memory_optimization": false}\n'
            f"# and call deepspeed.checkpointing.checkpoint(layer, x) in the forward of {', '.join(classes) or 'the chosen blocks'} "
            f"for the chosen modules only ({len(modules)} of them)"
        ),
    }


def plan_step(
    model: Any,
    optimizer: Any,
    step: Callable[[], Any],
    budget: int | None = None,
    save: int | None = None,
    reset_peak: bool = False,
) -> dict[str, Any]:
    """In-process: measure one ``step()`` and plan for ``budget`` (bytes) or ``save`` (bytes)."""
    from collectors.memory.plan_capture import measure_step

    return make_plan(from_json(measure_step(model, optimizer, step, reset_peak=reset_peak)), budget=budget, save=save)


def render_text(doc: dict[str, Any]) -> str:
    from dynprof.units import human_bytes as hb

    m = doc["measurement"]
    lines = [
        f"measured step on {m['device']}: peak {hb(m['peak_bytes'])} ({m['peak_source']})",
        f"  parameters {hb(m['parameter_bytes'])}, gradients {hb(m['gradient_bytes'])}, "
        f"optimizer state {hb(m['optimizer_state_bytes'])}, activations {hb(m['activation_bytes'])} "
        f"({hb(m['unrecomputable_activation_bytes'])} no block can free), temporaries {hb(m['temporary_bytes'])}",
        f"  {doc['candidates']} blocks can be checkpointed; measured step took {m['step_s']:.3f} s"
        + (f" (typical step {m['typical_step_s']:.3f} s)" if m.get("typical_step_s") else ""),
    ]
    for n in m.get("notes") or []:
        lines.append(f"  note: {n}")
    lines.append(f"budget {hb(doc['budget_bytes'])}: needs {hb(doc['need_bytes'])} off the peak")
    plan = doc.get("plan")
    if doc["status"] == "fits-already":
        lines.append("the step's peak is under the budget already: nothing to checkpoint")
    elif plan:
        frac = plan.get("added_step_fraction")
        lines.append(
            f"plan: checkpoint {len(plan['modules'])} module(s): {', '.join(plan['modules'][:12])}"
            + (" ..." if len(plan["modules"]) > 12 else "")
        )
        lines.append(
            f"  predicted peak {hb(plan['predicted_peak_bytes'])}, step time +{plan['added_step_s'] * 1000:.1f} ms"
            + (f" (+{frac * 100:.1f} %)" if frac is not None else "")
        )
        for r in doc.get("runners_up") or []:
            lines.append(
                f"  runner-up: {len(r['modules'])} module(s), peak {hb(r['predicted_peak_bytes'])}, "
                f"+{r['added_step_s'] * 1000:.1f} ms"
            )
        lines.append("how to apply (torch.utils.checkpoint):")
        lines.extend("  " + x for x in doc["apply"]["torch.utils.checkpoint"].splitlines())
        lines.append("  (--json has the same for FSDP's checkpoint_wrapper, Hugging Face and DeepSpeed)")
    else:
        lines.append(
            f"no set of blocks reaches the budget: the floor with every block recomputed is {hb(doc['floor_bytes'])}"
        )
        for o in doc.get("beyond") or []:
            figure = o.get("saves_bytes", o.get("saves_bytes_with_8_ranks"))
            if figure is not None:
                lines.append(
                    f"  {o['option']}: saves {hb(figure)}" + (" with 8 ranks" if "saves_bytes" not in o else "")
                )
    if not doc.get("exact", True):
        lines.append("  (the search rounded bytes: too many distinct block sizes for an exact answer)")
    return "\n".join(lines)
