"""What ``dynprof run --checkpoint`` applied and verified, as ``dynprof show`` renders a
``memory-plan`` artifact of it.

The agent (dynprof/agent/_mem_apply.py) keeps, beside the measurement and the budget, its
final state under ``applied`` in the artifact's ``plan.json``: the state (``applied``,
``unreachable``, ``refused``, ...), the wrapped modules, the budget, the measured, predicted and
verified peak, the step time before, predicted and verified, the rounds of planning again, what
was refused and why. :func:`read` takes those fields from the file, checked and bounded (it is
untrusted input: a field of the wrong type is left out, never guessed); :func:`lines` is the
text, every string from the file made one printable line (:func:`dynprof.safetext.one_line`),
so that nothing in the file can forge a line of what ``dynprof show`` prints.
:func:`clean_measurement` does the same for the measurement's own strings (block names and
classes, the device, the notes), which the re-derived plan prints.
"""

from __future__ import annotations

from typing import Any

from collectors.memory.plan.measurement import MAX_BYTES, Measurement
from dynprof.safetext import one_line
from dynprof.units import human_bytes

MAX_MODULES = 4096
MAX_TEXTS = 32  # refusals and notes kept
MAX_TEXT = 500  # characters of one string from the file
SHOWN_MODULES = 16
BYTES = ("budget_bytes", "measured_peak_bytes", "predicted_peak_bytes", "verified_peak_bytes", "floor_bytes")
SECONDS = ("baseline_step_s", "predicted_step_s", "verified_step_s")
TEXTS = ("asked", "state", "detail", "budget_source", "verified_peak_source", "artifact")


def _text(value: Any, limit: int = MAX_TEXT) -> str:
    return one_line(value, limit)


def read(raw: Any) -> dict[str, Any] | None:
    """The ``applied`` object of a ``plan.json``, its known fields checked: byte counts are
    ints in range, seconds non-negative numbers, texts one printable line each, modules,
    refusals and notes bounded lists of them; None when it is not an object."""
    if not isinstance(raw, dict):
        return None
    out: dict[str, Any] = {}
    for key in TEXTS:
        v = raw.get(key)
        if isinstance(v, str):
            out[key] = _text(v)
    for key in BYTES:
        v = raw.get(key)
        if isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= MAX_BYTES:
            out[key] = v
    for key in SECONDS:
        v = raw.get(key)
        if isinstance(v, (int, float)) and not isinstance(v, bool) and 0 <= v <= 1e7:
            out[key] = float(v)
    for key, most in (("rounds", 1000), ("wrapped_from_step", 10**12)):
        v = raw.get(key)
        if isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= most:
            out[key] = v
    for key, limit in (("modules", MAX_MODULES), ("refused", MAX_TEXTS), ("notes", MAX_TEXTS)):
        v = raw.get(key)
        if isinstance(v, list):
            out[key] = [_text(x, 300 if key == "modules" else MAX_TEXT) for x in v[:limit] if isinstance(x, str)]
    return out


def _hb(n: Any) -> str:
    return str(human_bytes(n)) if isinstance(n, int) else "?"


def _ms(s: Any) -> str:
    return f"{s * 1000:.1f} ms" if isinstance(s, float) else "?"


def _pct(value: Any, against: Any) -> str:
    if isinstance(value, (int, float)) and isinstance(against, (int, float)) and against:
        return f" ({(value - against) / against * 100:+.1f} % against the prediction)"
    return ""


def lines(a: dict[str, Any]) -> list[str]:
    """The text of :func:`read`'s result: the state, the modules, the peaks, the step times."""
    out = [f"dynprof run --checkpoint {a.get('asked', '?')}: {a.get('state', '?')}"]
    modules = a.get("modules") or []
    if modules:
        more = f" (and {len(modules) - SHOWN_MODULES} more)" if len(modules) > SHOWN_MODULES else ""
        out.append(f"  {len(modules)} block(s) recomputed in backward: {', '.join(modules[:SHOWN_MODULES])}{more}")
    else:
        out.append("  no block recomputed: the job ran as it was")
    source = f" ({a['budget_source']})" if a.get("budget_source") else ""
    out.append(f"  budget {_hb(a.get('budget_bytes'))}{source}; measured peak {_hb(a.get('measured_peak_bytes'))}")
    if "predicted_peak_bytes" in a or "verified_peak_bytes" in a:
        verified, budget = a.get("verified_peak_bytes"), a.get("budget_bytes")
        where = ""
        if isinstance(verified, int) and isinstance(budget, int):
            where = ", under the budget" if verified <= budget else ", OVER the budget"
        how = f" ({a['verified_peak_source']})" if a.get("verified_peak_source") else ""
        out.append(
            f"  peak: predicted {_hb(a.get('predicted_peak_bytes'))}, verified {_hb(verified)}{how}"
            f"{_pct(verified, a.get('predicted_peak_bytes'))}{where}"
        )
    if any(k in a for k in SECONDS):
        out.append(
            f"  step: before {_ms(a.get('baseline_step_s'))}, predicted {_ms(a.get('predicted_step_s'))}, "
            f"verified {_ms(a.get('verified_step_s'))}{_pct(a.get('verified_step_s'), a.get('predicted_step_s'))}"
        )
    if "floor_bytes" in a:
        out.append(f"  the least recomputation reaches (the floor): {_hb(a['floor_bytes'])}")
    if "wrapped_from_step" in a:
        out.append(
            f"  wrapped from step {a['wrapped_from_step']} of the job (counted from 0); the steps before ran as they were"
        )
    if a.get("rounds"):
        out.append(f"  planned again {a['rounds']} time(s) after a verified peak over the budget")
    out.extend(f"  refused: {r}" for r in a.get("refused") or [])
    out.extend(f"  note: {n}" for n in a.get("notes") or [])
    if a.get("detail"):
        out.append(f"  {a['detail']}")
    return out


def clean_measurement(m: Measurement) -> None:
    """``m``'s strings (block names and classes, device, peak source, notes, error) as one
    printable line each, in place: for text only (the names no longer match the model's)."""
    for b in m.blocks:
        b.name, b.cls = _text(b.name, 300), _text(b.cls, 200)
    m.device, m.peak_source, m.error = _text(m.device, 40), _text(m.peak_source), _text(m.error)
    m.notes = [_text(n) for n in m.notes]
