"""The memory plan for a person: :func:`render_text` of a plan's document, and
:func:`render_artifact` of a ``memory-plan`` artifact (``dynprof show``, the sidecar's page)."""

from __future__ import annotations

from typing import Any

from collectors.memory.plan import applied as plan_applied
from collectors.memory.plan.measurement import from_json
from collectors.memory.plan.solve import make_plan
from dynprof.errors import ArtifactError
from dynprof.safetext import one_line
from dynprof.units import human_bytes as hb


def render_text(doc: dict[str, Any]) -> str:
    """The plan for a person. Every string of the measurement (its device, the peak's source,
    its notes, the blocks' names: from a process, a file, another node) is shown as one
    printable line (:func:`dynprof.safetext.one_line`): none forges a line of the plan."""
    m = doc["measurement"]
    lines = [
        f"measured step on {one_line(m['device'], 40)}: peak {hb(m['peak_bytes'])} ({one_line(m['peak_source'], 200)})",
        f"  parameters {hb(m['parameter_bytes'])}, gradients {hb(m['gradient_bytes'])}, "
        f"optimizer state {hb(m['optimizer_state_bytes'])}, activations {hb(m['activation_bytes'])} "
        f"({hb(m['unrecomputable_activation_bytes'])} no block can free), temporaries {hb(m['temporary_bytes'])}",
        f"  {doc['candidates']} blocks can be checkpointed; measured step took {m['step_s']:.3f} s"
        + (f" (typical step {m['typical_step_s']:.3f} s)" if m.get("typical_step_s") else "")
        + (
            f"; recompute times from the blocks' forward in {m['timed_steps']} plain steps"
            if m.get("timed_steps")
            else "; recompute times from the measured step"
        ),
    ]
    for n in m.get("notes") or []:
        lines.append(f"  note: {one_line(n, 500)}")
    lines.append(f"budget {hb(doc['budget_bytes'])}: needs {hb(doc['need_bytes'])} off the peak")
    margin = doc.get("margin_bytes")
    if margin:
        drift = m.get("drift_bytes") or 0
        lines.append(
            f"  the plan aims {hb(margin)} under it: 1 % of the peak above parameters, gradients and optimizer state"
            + (f", and {hb(drift)} the measured levels fell short of the allocator's count" if drift else "")
        )
        over = m.get("drift_over_bytes") or 0
        if over:
            lines.append(
                f"  (the measured levels went up to {hb(over)} over the allocator's count: a storage died unseen; "
                "the predicted peak is that much on the safe side, not counted again in the margin)"
            )
    plan = doc.get("plan")
    if doc["status"] == "fits-already":
        lines.append("the step's peak is under the budget already: nothing to checkpoint")
    elif plan:
        frac = plan.get("added_step_fraction")
        lines.append(
            f"plan: checkpoint {len(plan['modules'])} module(s): "
            + ", ".join(one_line(name, 300) for name in plan["modules"][:12])
            + (" ..." if len(plan["modules"]) > 12 else "")
        )
        lines.append(
            f"  predicted peak {hb(plan['predicted_peak_bytes'])}, step time +{plan['added_step_s'] * 1000:.1f} ms"
            + (f" (+{frac * 100:.1f} %)" if frac is not None else "")
            + ": each block's forward again, up to its last saved tensor"
        )
        for r in doc.get("runners_up") or []:
            lines.append(
                f"  runner-up: {len(r['modules'])} module(s), peak {hb(r['predicted_peak_bytes'])}, "
                f"+{r['added_step_s'] * 1000:.1f} ms"
            )
        lines.append("how to apply (torch.utils.checkpoint):")
        lines.extend("  " + one_line(x, None) for x in doc["apply"]["torch.utils.checkpoint"].split("\n"))
        lines.append("  (--json has the same for FSDP's checkpoint_wrapper, Hugging Face and DeepSpeed)")
    else:
        lines.append(
            f"no set of blocks reaches the budget: the least any reaches (the floor) is {hb(doc['floor_bytes'])}"
        )
        for o in doc.get("beyond") or []:
            figure = o.get("saves_bytes", o.get("saves_bytes_with_8_ranks"))
            if figure is not None:
                lines.append(
                    f"  {o['option']}: saves {hb(figure)}" + (" with 8 ranks" if "saves_bytes" not in o else "")
                )
    if not doc.get("exact", True):
        slack = doc.get("slack_bytes") or 0
        lines.append(
            "  (not exact: the search reached its bound and merged alike states; the plan meets the rule, "
            + (f"no dearer than the cheapest for a budget {hb(slack)} lower)" if slack else "maybe not the cheapest)")
        )
    return "\n".join(lines)


KIND = "memory-plan"
PLAN_FILE = "plan.json"
MAX_PLAN_FILE_BYTES = 64 << 20


def render_artifact(artifact: Any) -> tuple[dict[str, Any], str]:
    """Summary and text of a ``memory-plan`` artifact (``dynprof show``, the sidecar's page): the
    plan as ``dynprof memory plan`` printed it, re-derived from the measurement it saved (read
    with :func:`from_json`'s checks) for the budget or saving it was asked for; for one of
    ``dynprof run --checkpoint``, first what it applied and verified
    (:mod:`collectors.memory.plan.applied`, also the summary's ``checkpoint``)."""
    doc = artifact.read_json(PLAN_FILE, MAX_PLAN_FILE_BYTES)
    if not isinstance(doc, dict) or not isinstance(doc.get("measurement"), dict):
        raise ArtifactError(f"{PLAN_FILE} holds no measurement")
    m = from_json(doc["measurement"])
    plan_applied.clean_measurement(m)  # the file's strings, one printable line each
    raw = doc.get("asked")
    asked: dict[str, Any] = raw if isinstance(raw, dict) else {}
    budget, save = asked.get("budget_bytes"), asked.get("save_bytes")
    if isinstance(budget, int) and not isinstance(budget, bool) and budget >= 0:
        plan = make_plan(m, budget=budget, measurement=False)
    elif isinstance(save, int) and not isinstance(save, bool) and 0 <= save <= m.peak_bytes:
        plan = make_plan(m, save=save, measurement=False)
    elif isinstance(save, int) and not isinstance(save, bool) and save > m.peak_bytes:
        raise ArtifactError(f"{PLAN_FILE} asks to save {save} bytes, more than its measured peak ({m.peak_bytes})")
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
    text = render_text(plan)
    applied = plan_applied.read(doc.get("applied"))  # `dynprof run --checkpoint`: what it applied, verified
    if applied is not None:
        summary["checkpoint"] = applied
        text = "\n".join(plan_applied.lines(applied)) + "\n\nthe plan of the measured step, for this budget:\n" + text
    return summary, text
