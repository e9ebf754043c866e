"""Stacks of running processes (and core files), and the merged view of many ranks.

``model`` (the data, the stacks document and its one bounded decoder), ``readers`` (capture:
py-spy, pystack, the agent in the process, faulthandler, core files), ``merge`` (the one merge
of many processes, nodes and files), ``render`` (text), ``artifact`` (the stacks artifact).
The names other packages use are here.
"""

from collectors.stacks.artifact import load_processes, render_artifact, write_request_artifact
from collectors.stacks.merge import Source, group_processes, merge
from collectors.stacks.model import (
    HANG_KIND,
    KIND,
    Budget,
    Frame,
    Group,
    ProcessStacks,
    Stacks,
    ThreadStack,
    from_json,
    headline,
    is_library_path,
    rank_runs,
    read_document,
    short_path,
)
from collectors.stacks.readers import (
    CaptureError,
    capture_core,
    capture_in_process,
    capture_py_spy,
    capture_pystack,
    looks_like_python,
    parse_faulthandler,
    ptrace_refusal,
)
from collectors.stacks.render import render_merged, render_process

__all__ = [
    "HANG_KIND",
    "KIND",
    "Budget",
    "CaptureError",
    "Frame",
    "Group",
    "ProcessStacks",
    "Source",
    "Stacks",
    "ThreadStack",
    "capture_core",
    "capture_in_process",
    "capture_py_spy",
    "capture_pystack",
    "from_json",
    "group_processes",
    "headline",
    "is_library_path",
    "load_processes",
    "looks_like_python",
    "merge",
    "parse_faulthandler",
    "ptrace_refusal",
    "rank_runs",
    "read_document",
    "render_artifact",
    "render_merged",
    "render_process",
    "short_path",
    "write_request_artifact",
]
