"""dynprof.phase: a phase in progress counts as progress, nests, and never raises."""

from __future__ import annotations

import pytest

from dynprof import _phase
from dynprof._phase import MAX_NAME, busy_until, current, phase


@pytest.fixture(autouse=True)
def no_phase_in_progress(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_phase, "_active", [])
    monkeypatch.setattr(_phase, "_last_end", 0.0)


def test_no_phase_in_progress_is_none_and_busy_until_the_last_end():
    # GIVEN no phase ever entered
    # WHEN / THEN there is no current phase, and progress is the last end (never)
    assert current() is None
    assert busy_until(1000.0) == 0.0


def test_a_phase_in_progress_is_current_and_counts_as_progress_now():
    # GIVEN a phase entered
    with phase("eval"):
        # WHEN the watchdog asks
        found = current()
        # THEN the phase is named and busy_until is "now", whatever now is
        assert found is not None and found[0] == "eval"
        assert busy_until(12345.0) == 12345.0
    # AND once it ends, it is no longer current and progress is the end time
    assert current() is None
    assert busy_until(1e12) == _phase._last_end > 0


def test_nested_phases_name_the_innermost_and_unwind_in_order():
    # GIVEN a checkpoint inside an eval
    with phase("eval"):
        with phase("checkpoint"):
            # THEN the innermost is current
            assert current()[0] == "checkpoint"  # type: ignore[index]
        # WHEN the inner one ends THEN the outer one is current again
        assert current()[0] == "eval"  # type: ignore[index]
    assert current() is None


def test_one_phase_object_reentered_keeps_its_own_entries():
    # GIVEN one phase object used as a decorator on a recursive function
    p = phase("walk")
    depths: list[int] = []

    @p
    def walk(n: int) -> None:
        depths.append(len(_phase._active))
        if n:
            walk(n - 1)

    # WHEN it recurses
    walk(2)
    # THEN each level added one entry and all were removed at the end
    assert depths == [1, 2, 3]
    assert _phase._active == []


def test_an_exception_in_the_phase_ends_the_phase_and_propagates():
    # GIVEN a phase whose body raises
    # WHEN it runs THEN the job's exception reaches the job unchanged
    with pytest.raises(ZeroDivisionError), phase("eval"):
        1 / 0  # noqa: B018
    # AND the phase is no longer in progress
    assert current() is None


def test_a_long_name_is_cut_and_an_empty_one_is_busy():
    assert phase("x" * (MAX_NAME + 10)).name == "x" * MAX_NAME
    assert phase("").name == "busy"
    assert phase().name == "busy"


def test_a_name_whose_str_raises_does_not_reach_the_job():
    # GIVEN a name object whose __str__ fails
    class Bad:
        def __str__(self) -> str:
            raise RuntimeError("no")

    # WHEN it names a phase THEN the phase is "busy", nothing raised
    with phase(Bad()) as p:  # type: ignore[arg-type]
        assert p.name == "busy"
        assert current()[0] == "busy"  # type: ignore[index]


def test_an_exit_without_an_enter_never_raises():
    # GIVEN a phase that was never entered
    p = phase("odd")
    # WHEN it is exited THEN nothing raises and nothing is in progress
    p.__exit__(None, None, None)
    assert current() is None
