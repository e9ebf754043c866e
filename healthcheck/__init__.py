"""Node healthcheck: passive device and host checks, functional micro-benchmarks, per-SKU baselines.

Run it as ``dynprof healthcheck`` or ``python -m healthcheck``; see docs/healthcheck.md.
"""

from healthcheck.options import Options
from healthcheck.report import SCHEMA, SCHEMA_VERSION, Report
from healthcheck.result import CheckResult, Status, exit_code
from healthcheck.runner import run

__all__ = ["SCHEMA", "SCHEMA_VERSION", "CheckResult", "Options", "Report", "Status", "exit_code", "run"]
