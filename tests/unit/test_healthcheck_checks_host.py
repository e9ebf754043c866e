"""healthcheck.checks.host: each host check's judgement at its boundaries, and the readers over
what they are given (a tmp_path disk, a fake sysfs tree)."""

from __future__ import annotations

import pytest

from healthcheck.checks.host import (
    GIB,
    SHM_FAIL_BYTES,
    SHM_WARN_BYTES,
    ZOMBIE_WARN,
    IbPort,
    ProcState,
    check_disk,
    check_ib_ports,
    check_memory,
    check_process_states,
    check_shm,
    read_disk,
    read_ib_ports,
    read_memory,
    read_process_states,
)
from healthcheck.result import Status


# -- disk ---------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("free", "min_gib", "status"),
    [
        (10 * GIB, 10, Status.PASS),  # exactly the minimum
        (10 * GIB - 1, 10, Status.WARN),
        (int(2.5 * GIB), 10, Status.WARN),  # a quarter of the minimum is still a warning
        (int(2.5 * GIB) - 1, 10, Status.FAIL),
        (GIB // 2, 0, Status.PASS),  # with no minimum, half a GiB is enough
        (GIB // 2 - 1, 0, Status.FAIL),  # and less is almost full whatever the minimum
    ],
)
def test_disk_free_warns_below_the_minimum_and_fails_below_a_quarter_of_it(free, min_gib, status):
    result = check_disk("/scratch", 100 * GIB, free, min_gib)
    assert result.status is status
    assert result.action == ("drain" if status is Status.FAIL else None)
    assert result.details["path"] == "/scratch" and result.unit == "GiB"


def test_read_disk_measures_a_real_directory(tmp_path):
    result = read_disk(str(tmp_path), 0)
    assert result.name == "disk_free" and result.status in (Status.PASS, Status.FAIL)
    assert result.details["total_bytes"] >= result.details["free_bytes"] > 0


def test_read_disk_of_a_missing_path_is_unknown_naming_it(tmp_path):
    missing = str(tmp_path / "absent")
    result = read_disk(missing, 10)
    assert result.status is Status.UNKNOWN
    assert result.reason.startswith(missing) and "No such file" in result.reason


# -- /dev/shm ---------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("total", "status"),
    [
        (None, Status.FAIL),
        (64 * 1024**2, Status.FAIL),
        (SHM_FAIL_BYTES, Status.WARN),
        (SHM_WARN_BYTES - 1, Status.WARN),
        (SHM_WARN_BYTES, Status.PASS),
    ],
)
def test_shm_size_boundaries(total, status):
    assert check_shm(total).status is status


def test_tiny_shm_says_how_to_give_a_container_more():
    result = check_shm(64 * 1024**2)
    assert "--shm-size" in result.reason and result.action == "drain"


# -- memory -----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("total", "available", "status"),
    [
        (100 * GIB, 10 * GIB, Status.PASS),  # 10 %
        (100 * GIB, 9 * GIB, Status.WARN),
        (100 * GIB, 5 * GIB, Status.WARN),  # 5 %, above 2 GiB
        (100 * GIB, 4 * GIB, Status.FAIL),
        (10 * GIB, 2 * GIB - 1, Status.FAIL),  # 20 %, but under 2 GiB
        (0, 0, Status.FAIL),  # nothing known is not "available"
    ],
)
def test_host_memory_warns_under_ten_percent_and_fails_under_five_or_two_gib(total, available, status):
    assert check_memory(total, available).status is status


def test_read_memory_reports_this_machine():
    result = read_memory()
    assert result.name == "host_memory"
    assert result.details["total_bytes"] >= result.details["available_bytes"] > 0


# -- processes --------------------------------------------------------------------------------
def test_a_process_named_nvidia_in_d_state_is_stuck_in_the_driver():
    stuck = [ProcState(7, "nvidia-smi", "D", 1, "")]
    result = check_process_states([], stuck)
    assert (result.status, result.action) == (Status.FAIL, "drain")
    assert "7 nvidia-smi in ?" in result.reason


def test_zombies_warn_from_the_threshold_naming_their_parents():
    zombies = [ProcState(100 + i, "z", "Z", ppid=5 if i % 2 else 9) for i in range(ZOMBIE_WARN)]
    result = check_process_states(zombies, [])
    assert result.status is Status.WARN
    assert "parents [5, 9]" in result.reason
    assert check_process_states(zombies[:-1], []).status is Status.PASS


def test_the_details_list_at_most_twenty_stuck_processes():
    stuck = [ProcState(i, "rsync", "D", 1, "io_schedule") for i in range(50)]
    result = check_process_states([], stuck)
    assert result.value == 50 and len(result.details["stuck_in_d_state"]) == 20


def test_a_wchan_that_merely_contains_nv_is_not_the_gpu_driver():
    stuck = [ProcState(8, "rsync", "D", 1, "invalidate_inode_pages2_range")]
    assert check_process_states([], stuck).status is Status.WARN


def test_read_process_states_reads_this_machine():
    # This machine's own /proc: whatever it finds, it is judged (never an exception).
    result = read_process_states(recheck_after_s=0.01)
    assert result.name == "host_processes" and result.status in (Status.PASS, Status.WARN, Status.FAIL)
    assert isinstance(result.details["zombies"], int)


# -- InfiniBand / RoCE ports ------------------------------------------------------------------
def ib(device: str, state: str = "4: ACTIVE", rate: str = "400 Gb/sec (4X NDR)", layer: str = "InfiniBand"):
    return IbPort(device, "1", state, "5: LinkUp", rate, layer)


def test_the_rate_is_read_from_the_first_word():
    assert ib("a").rate_gbps == 400.0
    assert ib("a", rate="?").rate_gbps is None
    assert ib("a", rate="").rate_gbps is None


def test_a_port_is_compared_only_with_its_own_link_layer():
    results = check_ib_ports([ib("a"), ib("b", rate="100 Gb/sec", layer="Ethernet")])
    assert [r.status for r in results] == [Status.PASS, Status.PASS]


def test_a_down_port_does_not_set_the_speed_its_peers_are_held_to():
    # GIVEN a fast port that is down and a slower one that is up
    results = check_ib_ports([ib("a", state="1: DOWN", rate="800 Gb/sec"), ib("b", rate="400 Gb/sec")])
    # THEN only the down port warns
    assert [r.status for r in results] == [Status.WARN, Status.PASS]
    assert results[0].reason.endswith("is DOWN (LinkUp)")


def read_tree(tmp_path, ports: dict[str, dict[str, str]]):
    for device, attrs in ports.items():
        d = tmp_path / device / "ports" / "1"
        d.mkdir(parents=True)
        for key, text in attrs.items():
            (d / key).write_text(text + "\n")
    return read_ib_ports(tmp_path)


def test_read_ib_ports_reads_each_ports_attributes(tmp_path):
    results = read_tree(
        tmp_path,
        {
            "mlx5_0": {
                "state": "4: ACTIVE",
                "phys_state": "5: LinkUp",
                "rate": "400 Gb/sec",
                "link_layer": "InfiniBand",
            },
            "mlx5_1": {
                "state": "4: ACTIVE",
                "phys_state": "5: LinkUp",
                "rate": "200 Gb/sec",
                "link_layer": "InfiniBand",
            },
        },
    )
    assert [r.status for r in results] == [Status.PASS, Status.WARN]
    assert results[1].expected == "400 Gb/s"


def test_an_unreadable_port_state_is_not_active(tmp_path):
    # GIVEN a port whose attribute files are missing
    [result] = read_tree(tmp_path, {"mlx5_0": {}})
    # THEN it is not taken for an active port
    assert result.status is Status.WARN and result.value == "?"


def test_no_infiniband_directory_is_skipped(tmp_path):
    [result] = read_ib_ports(tmp_path / "absent")
    assert result.status is Status.SKIPPED
