"""The memory plan: which blocks to recompute in backward to bring a step's peak under a budget.

The input is one measured step (:mod:`.plan_capture`, in the training process): each block's
freeable saved-tensor bytes and forward time, the step's peak and its parts. The plan is the
set of blocks whose checkpointing brings the peak under the budget (or saves the asked bytes)
at the least added recompute time, found exactly by dynamic programming over the blocks in
forward order (a 0/1 knapsack whose state is the bytes freed so far).

**The predicted peak.** Checkpointing a set S frees the blocks' freeable bytes at the start of
backward; in backward, each checkpointed block k recomputes its forward and holds its saved
tensors again while its own backward runs, when the blocks after it are done with (their
bytes gone, their gradients there) and the chosen blocks before it still freed. So (see
:func:`saved_by`)

    predicted peak = peak - min(F(S), min over k in S of F(S before k) + relief(k))

which is what the plan is held to, and never under the parameters, gradients and optimizer
state. Recompute time is the blocks' measured forward time.

**The floor.** Every block checkpointed, by the same rule; and never under parameters,
gradients and optimizer state: no set of blocks goes lower. A budget under it gets that
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
MAX_FRONT = 200_000  # DP states kept; beyond it a spread of them is kept (and the plan says it is not exact)
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
    peak_includes_gradients: bool = False  # the peak counts every gradient (the CPU's sum)
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
            "peak_includes_gradients": self.peak_includes_gradients,
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
        peak_includes_gradients=doc.get("peak_includes_gradients") is True,
        notes=[n[:500] for n in notes[:50]],
        error=_str(doc, "error"),
    )


# -- the solver --------------------------------------------------------------------------------
@dataclass(frozen=True)
class Choice:
    blocks: tuple[int, ...]  # indices into the items, in forward order
    freed: int  # sum of the items' bytes
    cost: float  # sum of the items' seconds
    saved: int  # what the choice takes off the peak (see :func:`saved_by`)


def saved_by(items: Sequence[tuple[int, float]], relief: Sequence[int], chosen: Sequence[int]) -> int:
    """What checkpointing ``chosen`` takes off the peak.

    At the start of backward the chosen blocks' bytes are gone: ``F(S)``. Backward then runs
    the blocks last to first; when it reaches a chosen block k, k recomputes and holds its bytes
    again, while the chosen blocks before k are still freed (``F(S before k)``) and the blocks
    after k are done with (``relief[k]``: their bytes, less the gradients they left). So the
    peak comes down by ``min(F(S), min over k in S of F(S before k) + relief[k])``."""
    order = sorted(chosen)
    total = sum(items[i][0] for i in order)
    best = total
    before = 0
    for k in order:
        best = min(best, before + relief[k])
        before += items[k][0]
    return best


def solve(
    items: Sequence[tuple[int, float]],
    need: int,
    relief: Sequence[int] | None = None,
    keep: int = 1 + RUNNERS_UP,
) -> tuple[list[Choice], bool]:
    """The cheapest sets of ``items`` (bytes, seconds; in forward order) whose
    :func:`saved_by` is at least ``need``, cheapest first (at most ``keep``), and whether the
    answer is exact.

    A 0/1 knapsack by dynamic programming over the blocks in forward order: the state is the
    bytes freed so far (capped where no constraint asks for more), each keeping its ``keep``
    cheapest sets; block k may join a set only when the bytes freed before it reach
    ``need - relief[k]`` (so that its recompute does not lift the peak over the budget), and
    a set is a plan when it frees ``need`` in all. States that free less for more time than
    ``keep`` others are dropped."""
    n = len(items)
    relief = list(relief) if relief is not None else [0] * n
    if need <= 0:
        return [Choice((), 0, 0.0, 0)], True
    gates = [need - relief[k] for k in range(n)]
    cap = max([need, *gates])
    exact = True
    front: dict[int, list[tuple[float, tuple[int, ...]]]] = {0: [(0.0, ())]}
    for k, (b, c) in enumerate(items):
        if b <= 0:
            continue
        add: dict[int, list[tuple[float, tuple[int, ...]]]] = {}
        for freed, states in front.items():
            if freed < gates[k]:
                continue
            nf = min(cap, freed + b)
            for cost, chosen in states:
                add.setdefault(nf, []).append((cost + c, (*chosen, k)))
        for key, states in add.items():
            front[key] = sorted(front.get(key, []) + states)[:keep]
        # a state is dropped when `keep` states free at least as much for no more time
        better: list[float] = []  # the costs of the states above, cheapest `keep`
        pruned: dict[int, list[tuple[float, tuple[int, ...]]]] = {}
        for key in sorted(front, reverse=True):
            limit = better[keep - 1] if len(better) >= keep else float("inf")
            states = [st for st in front[key] if st[0] <= limit]
            if states:
                pruned[key] = states
                better = sorted(better + [st[0] for st in states])[:keep]
        front = pruned
        if len(front) > MAX_FRONT:
            exact = False
            keys = sorted(front)
            front = {key: front[key] for key in keys[:: len(keys) // MAX_FRONT + 1]}
    found = []
    for freed, states in front.items():
        if freed < need:
            continue
        for cost, chosen in states:
            saved = saved_by(items, relief, chosen)
            if saved >= need:
                found.append(Choice(chosen, sum(items[i][0] for i in chosen), cost, saved))
    found.sort(key=lambda ch: (ch.cost, -ch.saved, len(ch.blocks), ch.blocks))
    return found[:keep], exact


# -- the plan ----------------------------------------------------------------------------------
def _block_items(m: Measurement) -> list[int]:
    return [i for i, b in enumerate(m.blocks) if not b.checkpointed and b.freeable_bytes > 0]


def _relief(m: Measurement, idx: list[int]) -> list[int]:
    """For each candidate: the bytes of every block after it (done with when backward reaches
    it), less the gradients of their parameters (allocated by then, where the peak was
    measured before they were)."""
    out = []
    for i in idx:
        after = m.blocks[i + 1 :]
        grads = 0 if m.peak_includes_gradients else sum(b.parameter_bytes for b in after)
        out.append(sum(b.freeable_bytes for b in after) - grads)
    return out


def _static(m: Measurement) -> int:
    return m.parameter_bytes + m.gradient_bytes + m.optimizer_state_bytes


def floor_bytes(m: Measurement) -> int:
    """The lowest peak checkpointing can reach: every block checkpointed (each recomputed in
    its turn), and never under what the parameters, gradients and optimizer state hold."""
    idx = _block_items(m)
    items = [(m.blocks[i].freeable_bytes, 0.0) for i in idx]
    saved = saved_by(items, _relief(m, idx), range(len(idx))) if idx else 0
    return max(m.peak_bytes - saved, _static(m))


def predict(m: Measurement, modules: set[str]) -> dict[str, Any]:
    """The predicted peak and added step time of checkpointing exactly ``modules`` (blocks of
    ``m`` by name; others are ignored), by the rule the plan is held to."""
    idx = [i for i in _block_items(m) if m.blocks[i].name in modules]
    every = _block_items(m)
    relief = dict(zip(every, _relief(m, every)))
    items = {i: (m.blocks[i].freeable_bytes, m.blocks[i].forward_s) for i in every}
    chosen = list(range(len(idx)))
    saved = saved_by([items[i] for i in idx], [relief[i] for i in idx], chosen) if idx else 0
    return {
        "modules": [m.blocks[i].name for i in idx],
        "predicted_peak_bytes": max(m.peak_bytes - saved, _static(m)),
        "added_step_s": round(sum(m.blocks[i].forward_s for i in idx), 6),
    }


def make_plan(m: Measurement, budget: int | None = None, save: int | None = None) -> dict[str, Any]:
    """The plan's document (``--json``): the chosen blocks, the predicted peak and step-time
    increase, the runners-up, the floor, and how to apply it."""
    if (budget is None) == (save is None):
        raise ValueError("give exactly one of budget and save")
    need = (m.peak_bytes - budget) if budget is not None else int(save or 0)
    target = budget if budget is not None else m.peak_bytes - need
    idx = _block_items(m)
    items = [(m.blocks[i].freeable_bytes, m.blocks[i].forward_s) for i in idx]
    # the static part (parameters, gradients, optimizer state) is a floor no plan goes under
    reachable = need if m.peak_bytes - need >= _static(m) else m.peak_bytes + 1
    choices, exact = solve(items, reachable, _relief(m, idx))
    step = m.typical_step_s or m.step_s
    static = _static(m)

    def describe(ch: Choice) -> dict[str, Any]:
        names = [m.blocks[idx[i]].name for i in ch.blocks]
        return {
            "modules": names,
            "freed_bytes": ch.freed,
            "saved_bytes": ch.saved,
            # never under what the optimizer step holds whatever is recomputed
            "predicted_peak_bytes": max(m.peak_bytes - ch.saved, static),
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
            "# Enabling checkpointing checkpoints every layer. Where the layers are\n"
            "# GradientCheckpointingLayer (recent transformers), enable it, then turn it off\n"
            "# on the layers not chosen; elsewhere, leave it off and wrap the chosen layers as with\n"
            "# torch.utils.checkpoint above.\n"
            "if hasattr(model, 'activation_checkpointing_enable'):  # transformers 5.x\n"
            "    model.activation_checkpointing_enable({'use_reentrant': False})\n"
            "else:\n"
            "    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={'use_reentrant': False})\n"
            f"CHECKPOINT = {{{names}}}\n"
            "for name, mod in model.named_modules():\n"
            "    layer = any(c.__name__ == 'GradientCheckpointingLayer' for c in type(mod).__mro__)\n"
            "    if layer and name not in CHECKPOINT:\n"
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
        lines.append("  (not exact: too many distinct block sizes; the search kept a spread of its states)")
    return "\n".join(lines)


KIND = "memory-plan"
PLAN_FILE = "plan.json"
MAX_PLAN_FILE_BYTES = 64 << 20


def render_artifact(artifact: Any) -> tuple[dict[str, Any], str]:
    """Summary and text of a ``memory-plan`` artifact (``dynprof show``, the sidecar's page): the
    plan as ``dynprof memory plan`` printed it, re-derived from the measurement it saved (read
    with :func:`from_json`'s checks) for the budget or saving it was asked for."""
    doc = artifact.read_json(PLAN_FILE, MAX_PLAN_FILE_BYTES)
    if not isinstance(doc, dict) or not isinstance(doc.get("measurement"), dict):
        raise ArtifactError(f"{PLAN_FILE} holds no measurement")
    m = from_json(doc["measurement"])
    raw = doc.get("asked")
    asked: dict[str, Any] = raw if isinstance(raw, dict) else {}
    budget, save = asked.get("budget_bytes"), asked.get("save_bytes")
    if isinstance(budget, int) and not isinstance(budget, bool) and budget >= 0:
        plan = make_plan(m, budget=budget)
    elif isinstance(save, int) and not isinstance(save, bool) and save >= 0:
        plan = make_plan(m, save=save)
    else:
        raise ArtifactError(f"{PLAN_FILE} says neither the budget nor the saving that was asked for")
    chosen = plan.get("plan") or {}
    summary = {
        "status": plan["status"],
        "budget_bytes": plan["budget_bytes"],
        "modules": list(chosen.get("modules") or [])[:64],
        "predicted_peak_bytes": chosen.get("predicted_peak_bytes"),
        "measured_peak_bytes": m.peak_bytes,
    }
    return summary, render_text(plan)
