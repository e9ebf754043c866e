"""dynprof.sidecar.table: each action's row names its request (its options are the request's
``OPTIONS``, one table, the kind's), the kind's collect and its job-wide function; the rows hold
to the commands' own parsers (tests/unit/_action_flags.py: refusals as usage errors, never an
exit or a print); docs/api.md's action table is generated from the rows
(scripts/gen_cli_reference.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar

import pytest

from collectors.flight_recorder.collect import collect as nccl_collect
from collectors.memory.collect import DEFAULT_TIMEOUT_S, MemoryPlanRequest
from collectors.stacks.collect import collect as stacks_collect
from dynprof import errors, kinds
from dynprof.action_spec import ActionSpec
from dynprof.job import links, ls, memory, nccl, ps, start, stop
from dynprof.job import stacks as stacks_job
from dynprof.job.memory import MemoryResults
from dynprof.job.merge import PerRankJob
from dynprof.node_requests import STOP_TIMEOUT_S, LsRequest
from dynprof.result import Result
from dynprof.sidecar import actions, table
from healthcheck.collect import HealthcheckRequest
from healthcheck.links.side import LinkTestRequest
from tests.support.scripts import load_script
from tests.unit import _action_flags as af

ROOT = Path(__file__).resolve().parents[2]
SAMPLES: dict[str, Any] = {"int": 1, "float": 1.5, "str": "60%", "bool": True, "ints": [1], "strs": ["x"]}


def test_every_action_with_a_request_takes_exactly_the_requests_options_as_flags_of_their_names():
    # GIVEN the rows that carry a kind's request
    rows = {name: a for name, a in actions.ACTIONS.items() if a.request is not None}
    assert rows, "no action carries a request"
    for name, action in rows.items():
        assert action.request is not None
        # THEN its options are the request's, in the request's order, then its text options
        assert list(action.options) == [*action.request.OPTIONS, *action.text_options], name
        for key, opt in action.options.items():
            kind = action.request.OPTIONS.get(key)
            if key in action.text_options:
                assert kind is None, f"{name}.{key} is the request's and a text option"
            else:
                assert opt.kind == kind, f"{name}.{key}"
            assert opt.flag == "--" + key.replace("_", "-"), f"{name}.{key}"


def test_the_real_rows_read_every_option_of_their_row_and_only_those():
    # GIVEN the sidecar's rows
    for name, action in actions.ACTIONS.items():
        assert action.request is not None, f"{name} carries no request"
        made = 0
        for key, opt in action.options.items():
            # WHEN each option of the row is decoded (with a target, where the request takes one)
            doc = {"job": "j", key: SAMPLES[opt.kind]} if "job" in action.options else {key: SAMPLES[opt.kind]}
            try:
                request = action.decode(doc)
            except errors.UsageError as exc:
                # THEN it is known to the request: a value it refuses is said, never "unknown option"
                assert "unknown option" not in exc.message, (name, key, exc.message)
            else:
                assert isinstance(request, action.request), (name, key)
                made += 1
        # AND some document of its options is a request of the row's class
        assert made, f"{name}: no option made a {action.request.__name__}"
        # AND an option outside the row is refused by the request itself
        with pytest.raises(errors.UsageError, match="unknown option"):
            action.decode({"job": "j", "not_an_option": 1})


# -- commands and their parsers ---------------------------------------------------------------------
def test_a_command_is_loaded_by_its_subcommand_name():
    assert type(af.load_command("ls")).__name__ == "LsCommand"
    assert type(af.load_command("gpu-coredump")).__name__ == "GpuCoredumpCommand"
    with pytest.raises(KeyError):
        af.load_command("gpu_coredump")  # the module's name is not the subcommand's
    with pytest.raises(KeyError):
        af.load_command("../ls")


def test_the_parser_is_the_commands_own():
    parser = af.command_parser("ls", af.load_command("ls"))
    assert parser.prog == "dynprof ls"
    assert parser.parse_args(["--job", "j"]).job == "j"


def test_options_are_parsed_without_a_print(capsys):
    args = af.parse_options("ls", af.load_command("ls"), {"job": "j"}, None, None)
    assert args.job == "j" and args.json is True
    assert capsys.readouterr() == ("", "")


def test_each_option_is_one_flag_of_the_command():
    assert af.flags("start", {"job": "j", "steps": 3, "record_shapes": True, "with_stack": False}, None, None) == [
        "--job=j",
        "--steps=3",
        "--record-shapes",
        "--json",
    ]
    assert af.flags("stacks", {"pid": [1, 2], "timeout": 5.0}, None, None) == ["--pid=1,2", "--timeout=5.0", "--json"]
    # an action of a command's own subcommand: its words first
    assert af.flags("memory-plan", {"pid": [7], "budget": "60%"}, None, None) == [
        "plan",
        "--pid=7",
        "--budget=60%",
        "--json",
    ]
    # job-wide: the nodes and the CA file first; a value that looks like a flag stays a value
    assert af.flags("ps", {"job": "--all"}, ("node-1", "[::1]:8787"), "/etc/ca.pem") == [
        "--hosts=node-1,[::1]:8787",
        "--cacert=/etc/ca.pem",
        "--job=--all",
        "--json",
    ]
    args = af.parse_options("ps", af.load_command("ps"), {"job": "--all"}, ("node-1",), None)
    assert args.job == "--all" and args.hosts == "node-1"


@pytest.mark.parametrize(
    ("options", "said"),
    [
        ({"limit": -3}, "ls: argument --limit"),
        ({"limit": "x"}, "ls: argument --limit"),
        ({"bogus": 1}, "ls: unrecognized arguments: --bogus=1"),
    ],
)
def test_a_refused_value_is_a_usage_error_with_nothing_printed(options, said, capsys):
    with pytest.raises(errors.UsageError) as info:
        af.parse_options("ls", af.load_command("ls"), options, None, None)
    assert info.value.message.startswith(said)
    assert "error:" not in info.value.message and "usage:" not in info.value.message
    assert info.value.help == "See `dynprof ls --help`."
    assert info.value.exit_code == 2
    assert capsys.readouterr() == ("", "")


def test_healthchecks_refusal_keeps_its_own_usage_code():
    # healthcheck's 2 means "unhealthy": its usage error is 3, "could not run"
    with pytest.raises(errors.UsageError) as info:
        af.parse_options("healthcheck", af.load_command("healthcheck"), {"level": "thorough"}, None, None)
    assert info.value.exit_code == 3 and info.value.message.startswith("healthcheck: argument --level")


# -- the rows' entry points ---------------------------------------------------------------------------
def test_each_row_names_its_kinds_collect_and_its_job_wide_function():
    rows = table.ACTIONS
    # a job-level action: this node's answer and the job-wide one, of the job layer
    assert rows["ls"].decode == LsRequest.from_json
    assert rows["ls"].collect is ls.collect and rows["ls"].job is ls.collect_job
    assert rows["ps"].collect is ps.collect and rows["ps"].job is ps.collect_job
    assert rows["start"].collect is start.collect and rows["start"].job is start.collect_job
    # a kind whose job-wide answer is its nodes' per-rank rows: the per-rank merge, read by its decoder
    assert rows["stop"].collect is stop.collect
    assert rows["stop"].job == PerRankJob("stop", STOP_TIMEOUT_S, stop.Stopped.from_json)
    assert rows["memory"].collect is memory.collect
    assert rows["memory"].job == PerRankJob("memory", DEFAULT_TIMEOUT_S, MemoryResults.from_json)
    assert rows["nccl"].collect is nccl_collect and rows["nccl"].job is nccl.collect_job
    # the stacks kind's own collect answers a node's stacks
    assert rows["stacks"].collect is stacks_collect and rows["stacks"].job is stacks_job.collect_job
    assert rows["stacks"].decode is stacks_job.request_of
    # every action carries its kind's request: the healthcheck's and the link test's too
    assert rows["link-test"].decode == LinkTestRequest.from_json and rows["link-test"].collect is links.collect
    assert rows["healthcheck"].decode({"level": "quick"}) == HealthcheckRequest(level="quick")
    # an action of this node only
    assert rows["healthcheck"].job is None and rows["link-test"].job is None and rows["memory-plan"].job is None


def test_the_kinds_rows_that_name_an_action_add_it_after_the_rows_written_here_in_their_order():
    # GIVEN the actions the kinds' table names, each the spec in the kind's own code
    named = kinds.actions()
    # THEN each is a row of the table, made from its spec, and they come last, in the kinds' order
    assert list(table.ACTIONS)[-len(named) :] == list(named) == ["nccl", "healthcheck", "link-test"]
    assert table.ACTIONS["nccl"] == table._spec_action("nccl", nccl.ACTION)
    assert table.ACTIONS["link-test"] == table._spec_action("link-test", links.ACTION)
    assert table.ACTIONS["healthcheck"].failed_exit == 3 and table.ACTIONS["healthcheck"].in_subprocess


def test_a_spec_with_per_rank_rows_has_their_merge_as_its_job_wide_answer():
    # GIVEN a new kind's spec: its request, its collect, the decoder of a node's per-rank rows
    spec = ActionSpec(GcRequest, collect_gc, per_rank=MemoryResults.from_json, limits={"default_timeout_s": 60.0})
    # WHEN the sidecar makes its row
    row = table._spec_action("gc", spec)
    # THEN it fans out, each node waiting the row's default, read by the kind's decoder
    assert row.fans_out and row.job == PerRankJob("gc", 60.0, MemoryResults.from_json)
    assert row.command == "gc" and row.request is GcRequest and list(row.options) == list(GcRequest.OPTIONS)
    # AND a spec cannot give both, nor a subcommand's action per-rank rows
    with pytest.raises(ValueError, match="per_rank"):
        table._spec_action("gc", ActionSpec(GcRequest, collect_gc, collect_gc, per_rank=MemoryResults.from_json))
    with pytest.raises(ValueError, match="per_rank"):
        table._request_action("memory", GcRequest, collect_gc, per_rank=MemoryResults.from_json, leading=("plan",))


def test_an_action_of_a_subcommand_reads_that_subcommands_request():
    row = table.ACTIONS["memory-plan"]
    assert row.decode == MemoryPlanRequest.from_json and row.collect is memory.collect_plan
    with pytest.raises(errors.UsageError) as info:
        row.decode({"bogus": 1})
    assert "bogus" in info.value.message


def test_a_refused_healthcheck_request_is_its_could_not_run():
    with pytest.raises(errors.UsageError) as info:
        table.ACTIONS["healthcheck"].decode({"level": "thorough"})
    assert info.value.exit_code == 3 and info.value.message.startswith("healthcheck: --level 'thorough'")


def test_the_stacks_row_reads_its_text_option_apart_from_the_request():
    decode = table.ACTIONS["stacks"].decode
    assert decode({"job": "j", "full": True}) == decode({"job": "j"})
    with pytest.raises(errors.UsageError, match="'full' must be true or false"):
        decode({"job": "j", "full": "yes"})


class GcRequest:
    """A request of a new kind, as its package would write it."""

    OPTIONS: ClassVar[dict[str, str]] = {"job": "str", "pid": "ints", "all": "bool", "duration": "float"}

    @classmethod
    def from_json(cls, doc: Any) -> GcRequest:
        return cls()


def collect_gc(request: GcRequest) -> Result:
    return Result({"results": []})


def collect_gc_job(options: dict[str, Any], nodes: Any, reach: Any) -> Result:
    return Result({"nodes": [], "results": []})


def test_a_new_kinds_row_gets_its_options_from_its_request(monkeypatch):
    # GIVEN a new kind's action, whose row names only its request
    row = table._request_action(
        "gc",
        GcRequest,
        collect_gc,
        collect_gc_job,
        timeout_option="duration",
        default_timeout_s=30.0,
        max_timeout_s=600.0,
    )
    monkeypatch.setitem(actions.ACTIONS, "gc", row)
    # THEN the action takes the request's options as flags, and nothing else
    assert {k: (o.flag, o.kind) for k, o in row.options.items()} == {
        "job": ("--job", "str"),
        "pid": ("--pid", "ints"),
        "all": ("--all", "bool"),
        "duration": ("--duration", "float"),
    }
    assert row.request is GcRequest and row.text_options == () and row.fans_out
    assert row.collect is collect_gc and row.job is collect_gc_job and row.decode == GcRequest.from_json
    assert actions.check_options("gc", {"job": "j", "duration": 5}).options == {"job": "j", "duration": 5.0}
    with pytest.raises(actions.ActionError, match="unknown option 'generation'"):
        actions.check_options("gc", {"job": "j", "generation": 2})
    with pytest.raises(actions.ActionError, match="'duration' must be a number"):
        actions.check_options("gc", {"job": "j", "duration": "5"})
    # AND a text option (how the command prints) is taken after the request's, and is no part of it
    text = table._request_action("gc", GcRequest, collect_gc, text_options={"full": "bool"})
    assert not text.fans_out  # no job-wide function: on this node only
    assert list(text.options) == ["job", "pid", "all", "duration", "full"] and text.text_options == ("full",)


def _generator() -> Any:
    return load_script("gen_cli_reference")


def test_the_api_docs_action_table_is_the_rows():
    # GIVEN docs/api.md as committed, and the table its generator writes from the rows
    gen = _generator()
    text = (ROOT / "docs" / "api.md").read_text()
    # THEN the committed table is the generated one
    assert gen.render_api(text) == text, "docs/api.md's action table is stale: run python scripts/gen_cli_reference.py"
    table = text.split(gen.ACTIONS_BEGIN)[1].split(gen.ACTIONS_END)[0]
    # AND it has one row per action, naming every option of the row and its request
    rows = {line.split("|")[1].strip().strip("`"): line for line in table.splitlines() if line.startswith("| `")}
    assert set(rows) == set(actions.ACTIONS)
    for name, action in actions.ACTIONS.items():
        cells = [c.strip() for c in rows[name].split("|")[1:-1]]
        assert cells[2] == ", ".join(f"`{k}`" for k in action.options), name
        assert cells[3] == (f"`{action.request.__name__}`" if action.request else "-"), name
        assert cells[4:6] == ["yes" if action.changes_jobs else "no", "yes" if action.fans_out else "no"], name


def test_a_row_the_docs_lack_is_caught(monkeypatch):
    # GIVEN a new action in the rows that docs/api.md does not list yet
    gen = _generator()
    text = (ROOT / "docs" / "api.md").read_text()
    monkeypatch.setitem(actions.ACTIONS, "gc", table._request_action("gc", GcRequest, collect_gc))
    # WHEN the table is generated THEN it differs from the committed one, by that row
    regenerated = gen.render_api(text)
    assert regenerated != text
    assert (
        "| `gc` | `dynprof gc` | `job`, `pid`, `all`, `duration` | `GcRequest` | no | no | 60 / 3600 |" in regenerated
    )
    # AND a page whose markers are gone is refused, not silently left as it is
    with pytest.raises(SystemExit, match="markers"):
        gen.render_api(text.replace(gen.ACTIONS_END, ""))
