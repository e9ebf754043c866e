"""Each artifact kind's renderers, looked up by kind: the text summary (with its JSON) that
`dynprof show` prints and the web page shows, and the HTML fragment the page shows above it.

A renderer is named as ``"module:function"`` and imported only when an artifact of its kind is
shown, so that reading one kind never loads the others' readers.
"""

from __future__ import annotations

import importlib
import logging
from typing import Any

from dynprof import errors
from dynprof.kinds import html_renderers, renderers
from dynprof.store import Artifact

log = logging.getLogger("dynprof.renderers")

# kind -> "module:function" rendering an artifact's contents (the rows of dynprof.kinds that have
# a renderer). The function takes the Artifact and returns (summary dict for --json, text for
# people). A kind without a renderer (healthcheck: its manifest's summary says the verdict) shows
# its manifest and files only.
RENDERERS: dict[str, str] = renderers()
# kind -> "module:function" returning an HTML fragment (self-contained, no script) that the web
# page shows above the text summary.
HTML_RENDERERS: dict[str, str] = html_renderers()


def render(artifact: Artifact) -> tuple[dict[str, Any] | None, str]:
    """The kind's summary of ``artifact``'s contents (for --json) and its text, or (None, "")
    when the kind has no renderer or the capture failed. A damaged artifact says what is wrong
    with it in both, and never hides its manifest."""
    target = RENDERERS.get(artifact.kind)
    if target is None or artifact.status == "failed":
        return None, ""
    module_name, func = target.split(":")
    try:
        fn = getattr(importlib.import_module(module_name), func)
    except (ImportError, AttributeError):
        return None, ""
    try:
        summary, text = fn(artifact)
    except Exception as exc:  # a damaged artifact must not hide its manifest
        message = _why_unreadable(artifact, exc)
        return {"error": message}, f"(cannot summarise the contents: {message})"
    return summary, text


def _why_unreadable(artifact: Artifact, exc: Exception) -> str:
    """What is wrong with the artifact's files, for a person: the readers' own errors say it;
    anything else (a value of the wrong type deep in a file) is named by the files, and
    Python's text of it goes to the debug log only."""
    if isinstance(exc, errors.DynprofError):
        return exc.message
    log.debug("rendering %s failed", artifact.path, exc_info=exc)
    names = ", ".join(str(f.get("name")) for f in artifact.files if isinstance(f, dict)) or "its files"
    return (
        f"{names} of this {artifact.kind} artifact hold(s) values of the wrong type or shape "
        f"(damaged, or not written by a dynprof {artifact.kind} capture); "
        "`dynprof show --verify` checks them against the manifest's checksums"
    )


def render_html(artifact: Artifact) -> str:
    """The kind's HTML fragment for the web page, or "" (no renderer, or it failed)."""
    target = HTML_RENDERERS.get(artifact.kind)
    if target is None or artifact.status == "failed":
        return ""
    module_name, func = target.split(":")
    try:
        return str(getattr(importlib.import_module(module_name), func)(artifact))
    except Exception:  # the text summary says what is wrong with the artifact
        return ""
