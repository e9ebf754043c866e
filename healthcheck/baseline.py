"""Per-SKU baselines: what a healthy device of a kind measures, and how to learn one.

A baseline file (JSON)::

    {"schema": "dynprof.healthcheck.baseline", "schema_version": 1,
     "baselines": [{"sku": {"name": "NVIDIA H200", "memory_gib": 140},
                    "source": "...", "created_at": "...",
                    "metrics": {"gemm_bf16_tflops": {"median": ..., "min": ..., "max": ...,
                                "p10": ..., "p90": ..., "samples": 2, "nodes": 1, "unit": "TFLOP/s"}}}]}

The shipped baselines live in ``healthcheck/baselines/``; ``--baseline FILE`` adds more and
wins over them. A SKU is a device name and its memory size in GiB (within 2 GiB, since
drivers reserve slightly different amounts).
"""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dynprof.errors import DynprofError
from dynprof.store import utcnow_iso

BASELINE_SCHEMA = "dynprof.healthcheck.baseline"
BASELINE_SCHEMA_VERSION = 1
SHIPPED_DIR = Path(__file__).parent / "baselines"
MEMORY_TOLERANCE_GIB = 2
# Baselines and results are small JSON files; anything bigger is not one of them.
MAX_JSON_BYTES = 64 * 1024 * 1024


class BaselineError(DynprofError):
    exit_code = 3


@dataclass
class MetricBaseline:
    median: float
    unit: str = ""
    samples: int = 0
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass
class Baseline:
    name: str
    memory_gib: int | None
    metrics: dict[str, MetricBaseline]
    source: str = ""
    path: str = ""

    def matches(self, name: str | None, memory_gib: int | None) -> bool:
        if name is None or name.strip().lower() != self.name.strip().lower():
            return False
        if self.memory_gib is None or memory_gib is None:
            return True
        return abs(self.memory_gib - memory_gib) <= MEMORY_TOLERANCE_GIB

    @property
    def sku(self) -> str:
        return f"{self.name} {self.memory_gib}GiB" if self.memory_gib is not None else self.name


def read_json_file(path: Path, what: str) -> Any:
    """The JSON in ``path``, a regular file of at most MAX_JSON_BYTES; a BaselineError otherwise
    (never a hang on a FIFO or a device, never a traceback on deep nesting)."""
    import os
    import stat

    try:
        st = os.stat(path)
        if not stat.S_ISREG(st.st_mode):
            raise BaselineError(f"cannot read {what} {path}: not a regular file")
        with open(path, "rb") as fh:
            raw = fh.read(MAX_JSON_BYTES + 1)
    except OSError as exc:
        raise BaselineError(f"cannot read {what} {path}: {exc.strerror or exc}") from None
    except ValueError:  # a NUL byte in the path: no file can have that name
        raise BaselineError(f"cannot read {what} {str(path)!a}: a path cannot hold a NUL byte") from None
    if len(raw) > MAX_JSON_BYTES:
        raise BaselineError(f"{what} {path} is larger than {MAX_JSON_BYTES >> 20} MiB")
    try:
        return json.loads(raw)
    except (ValueError, RecursionError) as exc:
        raise BaselineError(f"cannot read {what} {path}: not valid JSON ({type(exc).__name__})") from None


def parse_baselines(data: Any, path: str = "") -> list[Baseline]:
    try:
        return _parse_baselines(data, path)
    except BaselineError:
        raise
    except (AttributeError, KeyError, TypeError, ValueError) as exc:
        raise BaselineError(
            f"{path or 'input'} is not a valid dynprof healthcheck baseline ({type(exc).__name__}: {exc})",
            help="Build one with `dynprof healthcheck baseline learn RESULTS...`.",
        ) from None


def _parse_baselines(data: Any, path: str) -> list[Baseline]:
    if not isinstance(data, dict) or data.get("schema") != BASELINE_SCHEMA:
        got = data.get("schema") if isinstance(data, dict) else type(data).__name__
        raise BaselineError(
            f"{path or 'input'} is not a dynprof healthcheck baseline (schema {got!r})",
            help="Build one with `dynprof healthcheck baseline learn RESULTS...`.",
        )
    found = []
    for entry in data.get("baselines", []):
        metrics = {
            key: MetricBaseline(
                float(m["median"]),
                str(m.get("unit", "")),
                int(m.get("samples", 0)),
                {k: v for k, v in m.items() if k not in ("median", "unit", "samples")},
            )
            for key, m in entry.get("metrics", {}).items()
        }
        sku = entry.get("sku", {})
        found.append(
            Baseline(str(sku.get("name", "")), sku.get("memory_gib"), metrics, str(entry.get("source", "")), path)
        )
    return found


def load_baselines(paths: list[str] | None = None, shipped: bool = True) -> list[Baseline]:
    """The baselines of ``paths`` (first) and the shipped ones (after)."""
    files = [Path(p) for p in paths or []]
    if shipped:
        files += sorted(SHIPPED_DIR.glob("*.json"))
    found = []
    for path in files:
        found += parse_baselines(read_json_file(path, "baseline"), str(path))
    return found


def find_baseline(baselines: list[Baseline], name: str | None, memory_gib: int | None) -> Baseline | None:
    return next((b for b in baselines if b.matches(name, memory_gib)), None)


# -- learning ---------------------------------------------------------------------------------
def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    if len(ordered) == 1:
        return ordered[0]
    pos = q * (len(ordered) - 1)
    low = int(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


def learn(results: list[dict[str, Any]], source: str = "") -> dict[str, Any]:
    """A baseline file built from many healthcheck results (``--json`` output or artifacts).

    For every SKU and metric: the median, the spread (min, p10, p90, max, median absolute
    deviation) and how many devices and nodes it comes from. Measurements that failed their
    correctness check or could not run are left out; slow ones are kept (the median is robust
    to a few bad devices, and leaving them out would hide a fleet-wide slowdown).
    """
    values: dict[tuple[str, int | None], dict[str, list[tuple[float, str]]]] = {}
    units: dict[str, str] = {}
    hosts: set[str] = set()
    for result in results:
        if result.get("schema") != "dynprof.healthcheck":
            raise BaselineError(
                "input is not a dynprof healthcheck result",
                help="Give the files written by `dynprof healthcheck --json` or its artifacts.",
            )
        host = str(result.get("host", "?"))
        hosts.add(host)
        devices = {d.get("index"): d for d in result.get("devices", [])}
        node_sku: dict[str, Any] = next(iter(devices.values()), {}) if devices else {}
        for check in result.get("checks", []):
            metric, value = check.get("metric"), check.get("value")
            if not metric or not isinstance(value, (int, float)) or check.get("status") == "unknown":
                continue
            if check.get("details", {}).get("correct") is False:
                continue
            device = devices.get(check.get("device")) if check.get("device") is not None else node_sku
            if not device:
                continue
            key = (str(device.get("name")), device.get("memory_gib"))
            values.setdefault(key, {}).setdefault(metric, []).append((float(value), host))
            units[metric] = str(check.get("unit") or "")
    if not values:
        raise BaselineError(
            "no functional measurements in the results",
            help="Learn from `--level standard` (or full) results; quick runs measure nothing.",
        )
    baselines = []
    for (name, memory_gib), metrics in sorted(values.items(), key=lambda kv: str(kv[0])):
        out = {}
        for metric, samples in sorted(metrics.items()):
            numbers = [v for v, _ in samples]
            median = statistics.median(numbers)
            out[metric] = {
                "median": round(median, 3),
                "min": round(min(numbers), 3),
                "p10": round(_quantile(numbers, 0.10), 3),
                "p90": round(_quantile(numbers, 0.90), 3),
                "max": round(max(numbers), 3),
                "mad": round(statistics.median(abs(v - median) for v in numbers), 3),
                "samples": len(numbers),
                "nodes": len({h for _, h in samples}),
                "unit": units.get(metric, ""),
            }
        baselines.append(
            {
                "sku": {"name": name, "memory_gib": memory_gib},
                "created_at": utcnow_iso(),
                "source": source or f"learned from {len(results)} results on {len(hosts)} nodes",
                "metrics": out,
            }
        )
    return {"schema": BASELINE_SCHEMA, "schema_version": BASELINE_SCHEMA_VERSION, "baselines": baselines}


def read_results(paths: list[str]) -> list[dict[str, Any]]:
    """Healthcheck results from files, artifact directories, or directories holding either."""
    found: list[dict[str, Any]] = []
    for raw in paths:
        path = Path(raw)
        try:
            is_dir = path.is_dir()
        except (OSError, ValueError) as exc:  # a name too long, a NUL byte
            raise BaselineError(f"cannot read {raw!a}: {exc}") from None
        files = _result_files(path) if is_dir else [path]
        if not files:
            raise BaselineError(f"no results in {path}")
        for f in files:
            data = read_json_file(f, "results")
            if isinstance(data, dict) and data.get("schema") == "dynprof.healthcheck":
                found.append(data)
            elif not path.is_dir():
                raise BaselineError(f"{f} is not a dynprof healthcheck result")
    return found


def _result_files(directory: Path) -> list[Path]:
    """``results.json`` files under ``directory`` (else its ``*.json``), not following links and
    skipping what cannot be read (a directory that vanishes while walked, say)."""
    import os

    found = []
    top = []
    for root, _dirs, names in os.walk(directory, followlinks=False):
        for name in names:
            if name == "results.json":
                found.append(Path(root) / name)
            elif root == str(directory) and name.endswith(".json"):
                top.append(Path(root) / name)
    return sorted(found) or sorted(top)


def learn_files(paths: list[str], source: str = "", output: str | None = None) -> tuple[dict[str, Any], str | None]:
    """``healthcheck baseline learn``: the baseline of the results under ``paths``, written to
    ``output`` when given; with the line that says so (None when not written)."""
    results = read_results(paths)
    baseline = learn(results, source=source)
    if not output:
        return baseline, None
    try:
        Path(output).write_text(json.dumps(baseline, indent=2) + "\n")
    except OSError as exc:
        raise DynprofError(f"cannot write the baseline to {output}: {exc.strerror or exc}") from None
    skus = ", ".join(f"{b['sku']['name']} {b['sku']['memory_gib']}GiB" for b in baseline["baselines"])
    return baseline, f"baseline for {skus} from {len(results)} results written to {output}"
