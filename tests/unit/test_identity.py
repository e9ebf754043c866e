"""dynprof.identity.detect: rank, local rank, world size, job id and host from a launcher's environment."""

from __future__ import annotations

import pytest

from dynprof.identity import Identity, detect


@pytest.mark.parametrize(
    "env",
    [
        {"RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "8"},  # torchrun
        {"SLURM_PROCID": "3", "SLURM_LOCALID": "1", "SLURM_NTASKS": "8"},  # Slurm
        {"OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_LOCAL_RANK": "1", "OMPI_COMM_WORLD_SIZE": "8"},
    ],
)
def test_each_launchers_variables_give_the_same_identity(env):
    # GIVEN one launcher's environment
    # WHEN it is read
    found = detect({**env, "DYNPROF_HOST": "n1"})
    # THEN rank 3 of 8, local rank 1
    assert (found.rank, found.local_rank, found.world_size) == (3, 1, 8)


def test_dynprofs_own_overrides_win_over_the_launcher():
    # GIVEN torchrun's variables and dynprof's overrides
    env = {"RANK": "3", "DYNPROF_RANK": "5", "WORLD_SIZE": "8", "DYNPROF_WORLD_SIZE": "16", "DYNPROF_HOST": "h"}
    # WHEN / THEN the overrides are used
    found = detect(env)
    assert (found.rank, found.world_size) == (5, 16)


def test_a_value_that_is_not_a_number_is_skipped_for_the_next_source():
    # GIVEN an empty and a garbled rank ahead of a good one
    env = {"DYNPROF_RANK": "", "RANK": "x1", "SLURM_PROCID": "2", "DYNPROF_HOST": "h"}
    # WHEN / THEN the first one that parses is the rank
    assert detect(env).rank == 2


def test_nothing_set_is_none_everywhere_but_the_host():
    found = detect({"DYNPROF_HOST": "h"})
    assert found == Identity(host="h", rank=None, local_rank=None, world_size=None, job_id=None)


def test_without_a_host_override_the_host_is_this_machines_name():
    import socket

    assert detect({}).host == socket.gethostname()


def test_torchruns_default_run_id_none_is_not_a_job_id():
    # GIVEN torchrun without --rdzv-id (its run id is the literal "none") under Slurm
    env = {"TORCHELASTIC_RUN_ID": "none", "SLURM_JOB_ID": "777", "DYNPROF_HOST": "h"}
    # WHEN / THEN the Slurm job id is the job id
    assert detect(env).job_id == "777"
    # AND without Slurm there is no job id at all
    assert detect({"TORCHELASTIC_RUN_ID": "none", "DYNPROF_HOST": "h"}).job_id is None


def test_the_job_id_prefers_dynprofs_then_torchruns_then_slurms():
    env = {"DYNPROF_JOB_ID": "mine", "TORCHELASTIC_RUN_ID": "run", "SLURM_JOB_ID": "1", "DYNPROF_HOST": "h"}
    assert detect(env).job_id == "mine"
    del env["DYNPROF_JOB_ID"]
    assert detect(env).job_id == "run"


def test_a_job_id_that_is_not_utf8_is_read_as_text_with_its_bad_byte_escaped():
    # GIVEN an environment value with a surrogate escape, as os.environ holds a non-UTF-8 byte
    env = {"DYNPROF_JOB_ID": "bad\udcff", "DYNPROF_HOST": "h\udcfe"}
    # WHEN it is read
    found = detect(env)
    # THEN both read as valid text, and encode
    assert found.job_id is not None and found.job_id.startswith("bad") and "\\xff" in found.job_id
    found.job_id.encode("utf-8")
    found.host.encode("utf-8")


def test_to_dict_has_every_field():
    found = Identity(host="h", rank=1, local_rank=0, world_size=2, job_id="j")
    assert found.to_dict() == {"host": "h", "rank": 1, "local_rank": 0, "world_size": 2, "job_id": "j"}
