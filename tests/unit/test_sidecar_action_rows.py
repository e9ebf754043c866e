"""dynprof.sidecar.actions: an action that carries a kind's request takes its options from the
request's ``OPTIONS`` (one table, the kind's), and docs/api.md's action table is generated from
the rows (scripts/gen_cli_reference.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar

import pytest

from dynprof import errors
from dynprof.sidecar import actions
from tests.unit._scripts import load_script

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


def test_the_real_commands_read_every_option_of_their_row_and_only_those():
    from dynprof.cli.sidecar_actions import action_commands

    # GIVEN the table `dynprof serve` hands the sidecar
    for name, command in action_commands().items():
        action = actions.ACTIONS[name]
        if command.decode is None:
            assert action.request is None, f"{name} carries a request its command does not read"
            continue
        assert action.request is not None, f"{name}'s command reads a request its row does not carry"
        made = 0
        for key, opt in action.options.items():
            # WHEN each option of the row is decoded (with a target, where the request takes one)
            doc = {"job": "j", key: SAMPLES[opt.kind]} if "job" in action.options else {key: SAMPLES[opt.kind]}
            try:
                request = command.decode(doc)
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
            command.decode({"job": "j", "not_an_option": 1})


class GcRequest:
    """A request of a new kind, as its package would write it."""

    OPTIONS: ClassVar[dict[str, str]] = {"job": "str", "pid": "ints", "all": "bool", "duration": "float"}


def test_a_new_kinds_row_gets_its_options_from_its_request(monkeypatch):
    # GIVEN a new kind's action, whose row names only its request
    row = actions._request_action(
        "gc", GcRequest, timeout_option="duration", default_timeout_s=30.0, max_timeout_s=600.0, fans_out=True
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
    assert actions.check_options("gc", {"job": "j", "duration": 5}).options == {"job": "j", "duration": 5.0}
    with pytest.raises(actions.ActionError, match="unknown option 'generation'"):
        actions.check_options("gc", {"job": "j", "generation": 2})
    with pytest.raises(actions.ActionError, match="'duration' must be a number"):
        actions.check_options("gc", {"job": "j", "duration": "5"})
    # AND a text option (how the command prints) is taken after the request's, and is no part of it
    text = actions._request_action("gc", GcRequest, text_options={"full": "bool"})
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
    monkeypatch.setitem(actions.ACTIONS, "gc", actions._request_action("gc", GcRequest))
    # WHEN the table is generated THEN it differs from the committed one, by that row
    regenerated = gen.render_api(text)
    assert regenerated != text
    assert (
        "| `gc` | `dynprof gc` | `job`, `pid`, `all`, `duration` | `GcRequest` | no | no | 60 / 3600 |" in regenerated
    )
    # AND a page whose markers are gone is refused, not silently left as it is
    with pytest.raises(SystemExit, match="markers"):
        gen.render_api(text.replace(gen.ACTIONS_END, ""))
