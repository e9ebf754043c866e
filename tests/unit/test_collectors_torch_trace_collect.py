"""The trace kind's request: read from the ``start`` action's JSON without trusting it, and the
same request whichever way it comes (the CLI's options, or the sidecar's ``start`` action)."""

from __future__ import annotations

import argparse

import pytest

from collectors.torch_trace.collect import TraceRequest
from dynprof import errors
from dynprof.cli.start import StartCommand, request_from_args
from dynprof.sidecar.actions import check_options
from tests.unit._action_flags import flags


def _flags(name: str, options: dict) -> list[str]:
    """The command's arguments for the action's options, as the CLI maps them (each one flag)."""
    return flags(name, check_options(name, options).options, None, None)


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(add_help=False)
    StartCommand().prepare_parser(parser)
    return parser.parse_args(argv)


@pytest.mark.parametrize(
    "options",
    [
        {"job": "j1", "timeout": 60.0},
        {"pid": [5, 6], "steps": 3, "at_step": 100, "record_shapes": True, "activities": ["cpu", "cuda"]},
        {"all": True, "duration": 2.5, "max_duration": 30.0, "no_wait": True, "with_stack": True},
        {"job": "j", "steps": 1, "sample_keep": 4, "keep_groups": ["sample-0123456789ab"], "with_flops": True},
        {"job": "j", "activities": ["CPU,cuda"], "profile_memory": True, "with_modules": True},
    ],
)
def test_the_start_action_s_options_are_the_request_both_ways(options):
    # WHEN a node's sidecar turns the action's options into the command's arguments, or reads them as JSON
    from_cli = request_from_args(_parse(_flags("start", options)))
    from_json = TraceRequest.from_json(options)
    # THEN the kind is asked the same, and the request writes itself back as options of that request
    assert from_json == from_cli
    assert TraceRequest.from_json(from_json.to_json()) == from_json


@pytest.mark.parametrize(
    ("doc", "said"),
    [
        ({"job": "j", "steps": 0}, "'steps' must be more than 0"),
        ({"job": "j", "duration": -1}, "'duration' must be more than 0"),
        ({"job": "j", "sample_keep": 0}, "'sample_keep' must be more than 0"),
        ({"job": "j", "steps": 10**12}, "--steps is 1.."),
        ({"job": "j", "steps": 2, "duration": 1.0}, "not both"),
        ({"job": "j", "activities": ["gpu"]}, "unknown activity 'gpu'"),
        ({"job": "j", "keep_groups": ["../../etc"]}, "--keep-groups"),
        ({"job": "j", "keep_groups": ["sample-0123456789ab"] * 65}, "--keep-groups"),
        ({"job": "j", "output_path": "/tmp/t"}, "unknown option 'output_path'"),
        ({"job": "j", "group_id": "g"}, "unknown option 'group_id'"),
        ({"job": "j", "timeout": 0}, "a timeout of 0 s"),
        ({"job": "j", "steps": "5"}, "an integer"),
        ({"pid": [1], "job": "j"}, "exactly one of --pid, --job or --all"),
        ("start", "must be a JSON object"),
    ],
)
def test_a_hostile_document_is_a_usage_error(doc, said):
    with pytest.raises(errors.UsageError) as refused:
        TraceRequest.from_json(doc)
    assert said in refused.value.message
