"""The artifact store's package (dynprof/store/__init__.py): the names it re-exports, and the
order of its parts (manifest at the bottom, the store itself at the top, no circle)."""

from __future__ import annotations

import ast
from pathlib import Path

import dynprof.store
from dynprof.store import artifact, manifest, owner, store, writer

PACKAGE = Path(dynprof.store.__file__).parent

# The public names of dynprof.store: what its importers use (`from dynprof.store import X`,
# `dynprof.store.X`), wherever in the package each is defined.
PUBLIC = {
    manifest: {
        "MANIFEST",
        "MAX_MANIFEST_FILES",
        "SCHEMA",
        "SCHEMA_VERSION",
        "STATUSES",
        "utcnow_iso",
        "validate_manifest",
    },
    artifact: {"Artifact", "BadArtifact"},
    owner: {"owner_tag"},
    writer: {
        "DEFAULT_DIR_MODE",
        "TEMP_MARKER",
        "ArtifactWriter",
        "TempDir",
        "artifact_modes",
        "sha256_file",
        "write_file_atomically",
    },
    store: {
        "DEAD_OWNER_GRACE_S",
        "DEFAULT_MAX_BYTES",
        "LOCK",
        "MAX_LEGACY_ENTRIES",
        "NOT_A_STORE_HELP",
        "STALE_TMP_AFTER_S",
        "STORE_FORMAT_VERSION",
        "STORE_MARKER",
        "STORE_SCHEMA",
        "ArtifactStore",
        "StoreRefused",
        "open_temporary_dir",
        "safe_segment",
    },
}
# Each part, and the parts it may import: each only those below it.
BELOW = {
    "manifest": set(),
    "artifact": {"manifest"},
    "owner": set(),
    "writer": {"manifest", "artifact", "owner"},
    "store": {"manifest", "artifact", "owner", "writer"},
}


def test_the_package_re_exports_each_public_name_of_its_parts_and_no_other():
    # GIVEN the public names of the package's parts
    every = {name for names in PUBLIC.values() for name in names}

    # THEN the package exports exactly them, each the very object of the part that defines it
    assert set(dynprof.store.__all__) == every
    for part, names in PUBLIC.items():
        for name in names:
            assert getattr(dynprof.store, name) is getattr(part, name), name
    star: dict[str, object] = {}
    exec("from dynprof.store import *", star)
    assert set(star) - {"__builtins__"} == every


def test_the_package_names_none_of_its_parts_private_names():
    # The parts' private names stay in their parts: none is reachable through the package.
    assert not [name for name in vars(dynprof.store) if name.startswith("_") and not name.startswith("__")]


def parts_imported(part: str) -> set[str]:
    tree = ast.parse((PACKAGE / f"{part}.py").read_text(encoding="utf-8"))
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("dynprof.store"):
            found.add(node.module.removeprefix("dynprof.store").lstrip(".") or "__init__")
        elif isinstance(node, ast.Import):
            found |= {a.name.removeprefix("dynprof.store.") for a in node.names if a.name.startswith("dynprof.store")}
    return found


def test_each_part_imports_only_the_parts_below_it():
    # GIVEN the package's modules on disk
    on_disk = {p.stem for p in PACKAGE.glob("*.py")} - {"__init__"}

    # THEN each is placed, and imports only parts below it (never the package, never one above)
    assert on_disk == set(BELOW)
    for part, below in BELOW.items():
        assert parts_imported(part) <= below, part
