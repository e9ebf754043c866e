"""Decision logic: readings in, :class:`~healthcheck.result.CheckResult` out, no I/O."""
