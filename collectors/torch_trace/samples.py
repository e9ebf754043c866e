"""A watch's straggler samples among a store's traces: their trace group begins with
:data:`SAMPLE_GROUP_PREFIX` (``dynprof start --sample-keep``), and a node prunes those samples,
and only those."""

from __future__ import annotations

import logging

from dynprof import store
from dynprof.errors import DynprofError

log = logging.getLogger("dynprof")


SAMPLE_GROUP_PREFIX = "sample-"
"""The trace group of a watch's straggler sample taken through the sidecars begins with this
(``dynprof start --sample-keep``): the node prunes those samples, and only those."""


def prune_sample_traces(
    job: str, keep_newest: int, keep_groups: set[str], in_store: store.ArtifactStore | None = None
) -> list[str]:
    """Delete this store's straggler-sample traces of ``job`` (trace artifacts whose group
    begins with :data:`SAMPLE_GROUP_PREFIX`) but those of the newest ``keep_newest`` sample
    groups and of ``keep_groups``; the paths deleted. What cannot be deleted stays (logged)."""
    where = in_store or store.ArtifactStore()
    by_group: dict[str, list[store.Artifact]] = {}
    for art in where.list(job=job, kind="trace"):
        options = art.manifest.get("options")
        group = options.get("group_id") if isinstance(options, dict) else None
        if isinstance(group, str) and group.startswith(SAMPLE_GROUP_PREFIX) and art.root is not None:
            by_group.setdefault(group, []).append(art)
    newest = sorted(by_group, key=lambda g: max(a.created_at for a in by_group[g]), reverse=True)
    removed: list[str] = []
    for group in newest[max(0, keep_newest) :]:
        if group in keep_groups:
            continue
        for art in by_group[group]:
            try:
                if where.remove(art.path):
                    removed.append(str(art.path))
            except (DynprofError, OSError) as exc:
                log.warning("dynprof: a straggler-sample trace could not be deleted: %s", exc)
    return removed
