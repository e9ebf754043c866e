"""healthcheck.backends.smi over a fake nvidia-smi-style tool (subprocess.run answered in-process
from a table): only the fields the tool knows are queried, odd cells are "not available" or
"not supported", never guessed, and a tool that fails or hangs is a NoAccelerator."""

from __future__ import annotations

import subprocess
import threading

import pytest

from healthcheck.backends import smi
from healthcheck.backends.base import NoAccelerator
from healthcheck.backends.smi import NOT_EXPOSED, SmiBackend, parse_csv, parse_help_fields

HELP = """\
List of valid properties to query for the switch "--query-gpu=":

"index"
Zero based index of the GPU.

"name" or "gpu_name"
The official product name of the GPU.

"clocks_event_reasons.active" or "clocks_throttle_reasons.active"
Bitmask of active clock event reasons.
"""


class FakeTool:
    """Answers ``TOOL --help-query-gpu`` and ``--query-*`` from ``rows`` (one dict per device)."""

    def __init__(self, rows: list[dict[str, str]], known: set[str] | None = None, **behaviour) -> None:
        self.rows = rows
        self.known = known if known is not None else set().union(*rows) if rows else {"index"}
        self.calls: list[list[str]] = []
        self.help_fails = behaviour.get("help_fails", False)
        self.reject_lists = behaviour.get("reject_lists", False)  # no field list at once (old tools)
        self.remapped = behaviour.get("remapped")  # rows of --query-remapped-rows, or None
        self.apps = behaviour.get("apps", "")
        self.hang_on = behaviour.get("hang_on")
        self.during: list = []

    def __call__(self, argv, capture_output=True, text=True, timeout=None):
        assert capture_output and text and timeout == smi.TOOL_TIMEOUT_S
        self.calls.append(argv)
        for hook in self.during:
            hook()
        args = argv[1:]
        if self.hang_on and any(a.startswith(self.hang_on) for a in args):
            raise subprocess.TimeoutExpired(argv, timeout)
        if args == ["--help-query-gpu"]:
            if self.help_fails:
                return self.done(2, "", "Invalid combination of input arguments")
            return self.done(0, HELP if self.known == "help" else "".join(f'"{f}"\n' for f in sorted(self.known)))
        query = next((a for a in args if a.startswith("--query-")), "")
        what, _, fields_text = query.partition("=")
        fields = fields_text.split(",")
        if what == "--query-gpu":
            if self.reject_lists and len(fields) > 1:
                return self.done(2, "", 'Field "x" is not a valid field to query.')
            unknown = [f for f in fields if f not in self.known]
            if unknown:
                return self.done(2, "", f'Field "{unknown[0]}" is not a valid field to query.')
            rows = self.rows
            if any(a.startswith("--id=") for a in args):
                wanted = next(a for a in args if a.startswith("--id=")).split("=")[1]
                rows = [r for r in rows if r["index"] == wanted]
            return self.done(0, "".join(", ".join(r.get(f, "") for f in fields) + "\n" for r in rows))
        if what == "--query-remapped-rows":
            if self.remapped is None:
                return self.done(2, "", "Invalid combination of input arguments")
            return self.done(0, self.remapped)
        if what == "--query-compute-apps":
            return self.done(0, self.apps)
        return self.done(2, "", "Invalid combination of input arguments")

    @staticmethod
    def done(code: int, out: str, err: str = "") -> subprocess.CompletedProcess:
        return subprocess.CompletedProcess([], code, out, err)


def device(index: int, **values: str) -> dict[str, str]:
    return {
        "index": str(index),
        "name": "NVIDIA H200",
        "uuid": f"GPU-{index:04d}",
        "pci.bus_id": f"00000000:{index + 0x18:02X}:00.0",
        "memory.total": "143771",
        "driver_version": "570.86",
        **values,
    }


@pytest.fixture
def tool(monkeypatch):
    def install(fake: FakeTool) -> FakeTool:
        monkeypatch.setattr(smi.subprocess, "run", fake)
        return fake

    return install


def queried_fields(fake: FakeTool) -> list[str]:
    [query] = [a for argv in fake.calls for a in argv if a.startswith("--query-gpu=") and "index," in a][:1]
    return query.split("=", 1)[1].split(",")


# -- parsing ----------------------------------------------------------------------------------
def test_help_fields_are_the_quoted_names_and_their_aliases():
    assert parse_help_fields(HELP) == {
        "index",
        "name",
        "gpu_name",
        "clocks_event_reasons.active",
        "clocks_throttle_reasons.active",
    }


def test_help_text_without_quoted_names_gives_none():
    assert parse_help_fields("Invalid combination of input arguments\n") == set()


def test_csv_cells_are_stripped_quotes_respected_and_blank_lines_dropped():
    assert parse_csv('0, NVIDIA H200 ,"a, b"\n\n1, x, y\n') == [["0", "NVIDIA H200", "a, b"], ["1", "x", "y"]]


# -- opening and reading ----------------------------------------------------------------------
def test_values_are_parsed_into_readings(tool):
    fake = tool(
        FakeTool(
            [
                device(
                    0,
                    **{
                        "persistence_mode": "Enabled",
                        "ecc.mode.current": "Enabled",
                        "ecc.errors.uncorrected.volatile.total": "0",
                        "clocks_event_reasons.active": "0x0000000000000004",
                        "temperature.gpu": "41",
                        "pcie.link.gen.max": "5",
                    },
                )
            ]
        )
    )
    backend = SmiBackend.open("nvidia-smi")
    r = backend.read(0)
    assert (r.name, r.uuid, r.memory_total_bytes) == ("NVIDIA H200", "GPU-0000", 143771 * 1024**2)
    assert (r.persistence_mode, r.ecc_enabled, r.ecc_uncorrected_volatile) == (True, True, 0)
    assert (r.clock_event_reasons, r.temperature_c, r.pcie_gen_max) == (4, 41, 5)
    assert (backend.name, backend.device_count(), backend.driver_version()) == ("smi:nvidia-smi", 1, "570.86")
    assert fake.calls[0] == ["nvidia-smi", "--help-query-gpu"]


def test_only_fields_the_tool_knows_are_queried_and_the_rest_stay_not_read(tool):
    fake = tool(FakeTool([device(0)]))
    r = SmiBackend.open("ppu-smi").read(0)
    fields = queried_fields(fake)
    assert fields[0] == "index" and "temperature.gpu" not in fields
    assert r.temperature_c is None and "temperature_c" not in r.errors, "not known: no error, just not read"


def test_the_first_alias_the_tool_knows_is_used(tool):
    fake = tool(FakeTool([device(0, **{"retired_pages.sbe": "2", "pcie.link.gen.current": "4"})]))
    r = SmiBackend.open("ppu-smi").read(0)
    assert (r.retired_pages_sbe, r.pcie_gen_current) == (2, 4)
    assert "retired_pages.single_bit_ecc.count" not in queried_fields(fake)


@pytest.mark.parametrize(
    ("cell", "where"),
    [
        ("[Not Supported]", "not_supported"),
        ("[N/A]", "errors"),
        ("[Insufficient Permissions]", "errors"),
        ("", "errors"),
        ("lots", "errors"),
        ("maybe", "errors"),
    ],
)
def test_odd_cells_are_not_supported_or_an_error_never_a_value(tool, cell, where):
    tool(FakeTool([device(0, **{"temperature.gpu": cell, "ecc.mode.current": cell})]))
    r = SmiBackend.open("nvidia-smi").read(0)
    assert r.temperature_c is None and r.ecc_enabled is None
    if where == "not_supported":
        assert {"temperature_c", "ecc_enabled"} <= r.not_supported
    else:
        assert "temperature.gpu" in r.errors["temperature_c"] and "ecc.mode.current" in r.errors["ecc_enabled"]


def test_the_deeper_readings_are_not_exposed_by_any_smi_tool(tool):
    tool(FakeTool([device(0)]))
    r = SmiBackend.open("ppu-smi").read(0)
    assert set(NOT_EXPOSED) <= r.not_exposed
    # the reset status fields the tool does not know are not exposed either
    assert {"reset_required", "drain_and_reset_recommended"} <= r.not_exposed


def test_a_tool_that_lists_no_devices_is_no_accelerator(tool):
    tool(FakeTool([], known={"index", "name"}))
    with pytest.raises(NoAccelerator, match="lists no devices"):
        SmiBackend.open("ppu-smi")


def test_a_tool_that_cannot_run_is_no_accelerator(tool, monkeypatch):
    def missing(argv, **kwargs):
        raise FileNotFoundError(2, "No such file or directory")

    monkeypatch.setattr(smi.subprocess, "run", missing)
    with pytest.raises(NoAccelerator, match="cannot run ppu-smi"):
        SmiBackend.open("ppu-smi")


def test_a_failing_query_names_the_tools_last_line(tool):
    fake = FakeTool([device(0)])
    fake.known = {"index", "name"}
    tool(fake)
    backend = SmiBackend("nvidia-smi", {"index", "name", "temperature.gpu"})  # believes in a field it lacks
    with pytest.raises(NoAccelerator, match=r"failed: Field \"temperature\.gpu\" is not a valid field to query\."):
        backend._load()


def test_a_tool_that_hangs_is_no_accelerator_within_the_limit(tool):
    tool(FakeTool([device(0)], hang_on="--query-gpu"))
    with pytest.raises(NoAccelerator, match=r"did not answer within 10 s"):
        SmiBackend.open("nvidia-smi")


def test_without_a_field_list_each_field_is_asked_alone_and_a_rejected_one_is_not_available(tool):
    # GIVEN an old tool: no --help-query-gpu, no lists of fields, and no temperature field
    fake = FakeTool([device(0), device(1)], help_fails=True, reject_lists=True)
    tool(fake)
    # WHEN opened
    backend = SmiBackend.open("old-smi")
    # THEN both devices are read field by field, and the missing field is an error, not a guess
    assert backend.device_count() == 2
    assert backend.read(1).uuid == "GPU-0001"
    assert backend.read(1).temperature_c is None and "temperature_c" in backend.read(1).errors


def test_remapped_rows_come_from_their_own_query_matched_by_bus_id(tool):
    remapped = "00000000:19:00.0, 0, 1, Yes, No\n00000000:99:00.0, 9, 9, Yes, Yes\n"
    tool(FakeTool([device(0), device(1)], remapped=remapped))
    backend = SmiBackend.open("nvidia-smi")
    one = backend.read(1)
    assert (one.remapped_rows_correctable, one.remapped_rows_uncorrectable, one.remap_pending) == (0, 1, True)
    assert backend.read(0).remap_pending is None, "a row of another bus id is not this device's"


def test_compute_processes_are_given_to_their_device_by_uuid(tool):
    apps = "GPU-0001, 4242, 1024\nGPU-0001, 4343, [N/A]\nGPU-9999, 1, 1\nbad row\n"
    tool(FakeTool([device(0), device(1)], apps=apps))
    backend = SmiBackend.open("nvidia-smi")
    assert backend.read(0).processes == []
    procs = backend.read(1).processes
    assert [(p.pid, p.used_memory_bytes) for p in procs] == [(4242, 1024 * 1024**2), (4343, None)]


def test_read_pcie_asks_for_one_device_and_gives_none_when_it_cannot(tool):
    fake = tool(FakeTool([device(0, **{"pcie.link.gen.current": "5", "pcie.link.width.current": "16"})]))
    backend = SmiBackend.open("nvidia-smi")
    assert backend.read_pcie(0) == (5, 16)
    assert "--id=0" in fake.calls[-1]
    assert backend.read_pcie(7) == (None, None)


def test_read_pcie_of_a_tool_without_the_fields_reads_nothing(tool):
    fake = tool(FakeTool([device(0)]))
    backend = SmiBackend.open("ppu-smi")
    calls = len(fake.calls)
    assert backend.read_pcie(0) == (None, None)
    assert len(fake.calls) == calls, "no field to ask for: the tool is not run"


def test_counters_are_read_again_in_one_query_for_every_device(tool):
    fields = {"reset_status.reset_required": "No", "reset_status.drain_and_reset_recommended": "No"}
    fake = tool(FakeTool([device(0, **fields), device(1, **fields)]))
    backend = SmiBackend.open("nvidia-smi")
    fake.rows[1]["reset_status.reset_required"] = "Yes"  # changed during the check
    calls = len(fake.calls)
    end0, end1 = backend.read_counters(0), backend.read_counters(1)
    assert len(fake.calls) == calls + 1
    assert (end0.reset_required, end1.reset_required) == (False, True)
    assert set(NOT_EXPOSED) <= end1.not_exposed


def test_a_device_the_backend_never_listed_has_counter_errors_not_values(tool):
    tool(FakeTool([device(0)]))
    end = SmiBackend.open("nvidia-smi").read_counters(5)
    assert end.reset_required is None
    assert end.errors["reset_required"] == "nvidia-smi did not list device 5 again"


def test_a_device_missing_from_the_counter_query_has_errors_not_values(tool):
    fields = {"reset_status.reset_required": "No", "reset_status.drain_and_reset_recommended": "No"}
    fake = tool(FakeTool([device(0, **fields), device(1, **fields)]))
    backend = SmiBackend.open("nvidia-smi")
    fake.rows.pop(1)
    end = backend.read_counters(1)
    assert end.reset_required is None
    assert end.errors["reset_required"] == "nvidia-smi did not list device 1 again"


def test_a_failed_counter_query_is_an_error_on_every_device(tool):
    fields = {"reset_status.reset_required": "No", "reset_status.drain_and_reset_recommended": "No"}
    fake = tool(FakeTool([device(0, **fields)]))
    backend = SmiBackend.open("nvidia-smi")
    fake.hang_on = "--query-gpu"
    end = backend.read_counters(0)
    assert "did not answer" in end.errors["reset_required"]


def test_the_tool_run_in_flight_is_named_while_it_runs(tool):
    fake = tool(FakeTool([device(0, **{"reset_status.reset_required": "No"})]))
    backend = SmiBackend.open("nvidia-smi")
    seen: list[str | None] = []
    fake.during.append(lambda: seen.append(backend.call_in_flight(threading.get_ident())))
    backend.read_counters(0)
    assert seen and seen[0].startswith("nvidia-smi --query-gpu=index")
    assert backend.call_in_flight(threading.get_ident()) is None, "forgotten once it returned"


def test_an_smi_backend_cannot_listen_for_xids(tool):
    tool(FakeTool([device(0)]))
    backend = SmiBackend.open("nvidia-smi")
    assert backend.watch_xid() is False and backend.xid_events() == []
    backend.close()
