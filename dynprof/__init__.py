"""dynprof: non-intrusive runtime profiler and diagnostics toolkit for PyTorch training jobs."""

__version__ = "0.1.0"

__all__ = ["__version__"]
