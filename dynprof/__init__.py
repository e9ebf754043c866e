"""dynprof: non-intrusive runtime profiler and diagnostics toolkit for PyTorch training jobs."""

__version__ = "0.1.0"

from dynprof._phase import phase

__all__ = ["__version__", "phase"]
