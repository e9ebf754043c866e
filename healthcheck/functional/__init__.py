"""Functional checks: micro-benchmarks run on the devices, one worker process per device."""
