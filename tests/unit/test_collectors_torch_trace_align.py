"""collectors.torch_trace.align: one start step that every process still reaches, from untrusted step times."""

from __future__ import annotations

import math
from types import SimpleNamespace as S

import pytest

from collectors.torch_trace.align import (
    MAX_MARGIN_STEPS,
    MAX_STEP_NUMBER,
    MIN_STEP_TIME_S,
    UNKNOWN_PACE_MARGIN,
    aligned_steps,
    alignment_step,
    boundary_offsets,
    margin_steps,
    replace_step,
    step_time,
    step_time_of_ms,
)
from dynprof.proto import pb


@pytest.mark.parametrize("value", [0, 0.0, -1.0, math.nan, math.inf, -math.inf, 1e-320, MIN_STEP_TIME_S / 2])
def test_a_value_that_is_no_measurement_is_no_step_time(value):
    assert step_time(value) is None


@pytest.mark.parametrize("value", [True, "0.1", None, [0.1], 10**400])
def test_what_is_not_a_number_is_no_step_time(value):
    assert step_time(value) is None


def test_a_finite_step_time_of_at_least_the_minimum_is_kept():
    assert step_time(MIN_STEP_TIME_S) == MIN_STEP_TIME_S
    assert step_time(2) == 2.0


def test_step_time_of_ms_converts_to_seconds_and_checks_the_same_way():
    assert step_time_of_ms(250) == 0.25
    assert step_time_of_ms(0) is None
    assert step_time_of_ms(math.nan) is None
    assert step_time_of_ms(10**400) is None
    assert step_time_of_ms(False) is None
    assert step_time_of_ms("250") is None


def test_margin_covers_the_lead_at_the_fastest_pace_plus_one():
    # GIVEN a 1 s lead, the fastest process at 0.1 s a step: 10 steps, and one more
    assert margin_steps(1.0, [0.5, 0.1]) == 11
    # an unknown pace: the fixed margin
    assert margin_steps(1.0, []) == UNKNOWN_PACE_MARGIN
    # a lead shorter than a step still leaves the fixed margin
    assert margin_steps(0.01, [10.0]) == UNKNOWN_PACE_MARGIN


def test_margin_is_capped_for_tiny_steps():
    assert margin_steps(1.0, [MIN_STEP_TIME_S]) == MAX_MARGIN_STEPS
    assert margin_steps(math.inf, [1.0]) == MAX_MARGIN_STEPS


def test_alignment_step_is_past_the_furthest_process():
    # GIVEN two ranks at steps 40 and 41, 0.1 s a step, and a 1 s lead
    statuses = [S(step=40, step_time_s=0.1), S(step=41, step_time_s=0.1)]
    # WHEN / THEN the furthest (41) plus 11 steps
    assert alignment_step(statuses, lead_s=1.0) == 41 + 11


def test_alignment_step_with_only_garbage_step_times_uses_the_unknown_margin():
    statuses = [S(step=40, step_time_s=1e-323), S(step=7, step_time_s=math.nan)]
    assert alignment_step(statuses) == 40 + UNKNOWN_PACE_MARGIN


def test_alignment_step_never_passes_the_largest_step_number():
    assert alignment_step([S(step=MAX_STEP_NUMBER, step_time_s=0.1)]) == MAX_STEP_NUMBER


def _status(step: int, last_step_at: float, step_time_s: float = 0.1) -> pb.Status:
    return pb.Status(step=step, last_step_at=last_step_at, step_time_s=step_time_s)


def test_boundary_offsets_of_ranks_read_at_the_same_boundary_are_their_counter_differences():
    # GIVEN three ranks whose latest boundaries are the same moment, counters 10, 30, 5
    statuses = [_status(10, 500.0), _status(30, 500.0), _status(5, 500.0)]
    # WHEN / THEN each offset is its counter minus the first one's
    assert boundary_offsets(statuses) == [0, 20, -5]


def test_boundary_offsets_count_the_boundaries_between_the_reads():
    # GIVEN rank 1 read 3 steps (0.3 s at 0.1 s a step) after rank 0 with the same counter
    statuses = [_status(50, 100.0), _status(53, 100.3)]
    # WHEN / THEN they count the same steps: offset 0
    assert boundary_offsets(statuses) == [0, 0]


@pytest.mark.parametrize(
    "statuses",
    [
        [_status(1, 100.0, 0.0), _status(2, 100.0, 0.0)],  # no step time
        [_status(1, 100.0), _status(2, 0.0)],  # one boundary time unknown
        [_status(1, 100.0), _status(2, math.inf)],
        [_status(1, 1e300, 1e-6), _status(2, -1e300, 1e-6)],
    ],
)
def test_boundary_offsets_are_none_when_they_cannot_be_known(statuses):
    assert boundary_offsets(statuses) is None


def test_aligned_steps_start_every_process_after_the_same_boundary():
    # GIVEN rank 1's counter 40 behind rank 0's
    statuses = [_status(100, 10.0), _status(60, 10.0)]
    # WHEN aligned
    steps = aligned_steps(statuses, [0, -40], lead_s=1.0)
    # THEN they are 40 apart, and rank 0's is its own alignment step
    assert steps == [100 + 11, 60 + 11]


def test_replace_step_copies_and_never_goes_below_zero():
    original = _status(10, 1.0)
    copy = replace_step(original, -5)
    assert copy.step == 0 and copy.last_step_at == 1.0
    assert original.step == 10, "the original status is left as it was"
