"""``dump_stacks`` with an output path writes only inside dynprof's own places.

The places are this user's dynprof run directory and the temporary directory of an artifact
being written in a dynprof store (what `dynprof stacks --method agent` and `dynprof nccl`
name); anything else is a structured ``INVALID_ARGUMENT``, and the file is created new,
private (0600), never through a link.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from types import SimpleNamespace

import pytest

from dynprof.agent import _ext_stacks
from dynprof.agent._server import CommandError
from dynprof.paths import run_dir
from dynprof.proto import pb
from dynprof.store import ArtifactStore


@pytest.fixture
def dump_stacks():
    agent = SimpleNamespace(handlers={}, identity=SimpleNamespace(rank=0, job_id="j", host="h"))
    _ext_stacks.install(agent)  # type: ignore[arg-type]
    return lambda path: agent.handlers["dump_stacks"](pb.DumpStacksRequest(all_threads=True, output_path=str(path)))


@pytest.mark.parametrize(
    "where",
    ["/etc/dynprof-stacks-test.json", "tmp_path/out.json", "/proc/self/dynprof.json", "run_dir_link/out.json"],
)
def test_output_paths_outside_dynprofs_places_are_refused(dump_stacks, tmp_path, where):
    # GIVEN a path outside the run directory and the store (a link into elsewhere, too)
    (run_dir() / "run_dir_link").symlink_to(tmp_path)
    path = Path(where.replace("tmp_path", str(tmp_path)).replace("run_dir_link", str(run_dir() / "run_dir_link")))

    # WHEN the agent is asked to dump its stacks there
    with pytest.raises(CommandError) as refused:
        dump_stacks(path)

    # THEN it refuses with a structured error, and writes nothing
    assert refused.value.code == pb.INVALID_ARGUMENT
    assert "refused" in refused.value.message and "DYNPROF_RUN_DIR" in refused.value.help
    assert not path.exists() and not any(tmp_path.glob("*.json"))


def test_an_output_path_in_the_run_directory_is_written_private_and_new(dump_stacks):
    # GIVEN a private directory under the run directory, as `dynprof stacks --method agent` makes
    out_dir = run_dir() / "out"
    out_dir.mkdir(mode=0o700)
    path = out_dir / "1.json"

    # WHEN the agent dumps its stacks there, then is asked again for the same file
    kind, written = dump_stacks(path)
    with pytest.raises(CommandError, match="exists"):
        dump_stacks(path)

    # THEN the file holds the stacks, mode 0600
    assert kind == "artifact" and written.path == str(path)
    assert os.stat(path).st_mode & 0o777 == 0o600
    assert json.loads(path.read_text())["threads"]


def test_an_output_path_in_an_artifact_being_written_is_accepted(dump_stacks):
    # GIVEN an artifact being written in the store (as `dynprof nccl` names a file in its own)
    writer = ArtifactStore().create("nccl", job="j")
    path = writer.file_path("rank0-pid1.json")

    # WHEN the agent writes there THEN the file is there, private
    dump_stacks(path)
    assert os.stat(path).st_mode & 0o777 == 0o600
    writer.finish()
