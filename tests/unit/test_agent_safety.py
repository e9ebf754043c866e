"""Where a profiler may start or stop (dynprof/agent/_safety.py): not inside autograd's
backward, a torch.compile frame, a tensor operator's Python dispatch, or while another profiler
is active; a frame that is returning does not count; and the watch of the job's own profilers
knows them (never dynprof's own) and always runs torch's original methods."""

from __future__ import annotations

import sys
import types
from typing import Any

import pytest

from dynprof.agent import _safety
from dynprof.agent._safety import ProfilerWatch, UnsafeReason, unsafe_reason


def _function_in(path: str, name: str = "run") -> Any:
    """A function whose code claims to live in ``path`` (as torch's own files do); it calls
    ``probe(frame)`` with its own frame and returns what that returns."""
    namespace: dict[str, Any] = {"sys": sys}
    exec(compile(f"def {name}(probe):\n    return probe(sys._getframe())\n", path, "exec"), namespace)
    return namespace[name]


@pytest.fixture
def watch(monkeypatch: pytest.MonkeyPatch) -> ProfilerWatch:
    fresh = ProfilerWatch()
    monkeypatch.setattr(_safety, "WATCH", fresh)
    return fresh


def test_plain_training_code_is_a_safe_point(watch):
    # GIVEN no backward, no compile frame, no dispatch and no profiler
    # THEN the moment is safe
    assert unsafe_reason() is None


def test_inside_backward_is_not_safe(watch):
    torch = pytest.importorskip("torch")

    # GIVEN a gradient hook, which autograd runs inside backward
    seen: list[Any] = []
    x = torch.ones(2, requires_grad=True)
    x.register_hook(lambda grad: seen.append(unsafe_reason()))

    # WHEN backward runs
    (x * 2).sum().backward()

    # THEN the hook saw an unsafe moment, named as backward; after it, all is safe again
    assert seen == [UnsafeReason.BACKWARD]
    assert unsafe_reason() is None


def test_a_compile_frame_on_the_stack_is_not_safe_unless_it_is_returning(watch):
    # GIVEN a frame of torch.compile's own code on the stack
    in_dynamo = _function_in("/site-packages/torch/_dynamo/eval_frame.py")

    # WHEN checked inside it, and inside it while it is returning
    inside = in_dynamo(lambda frame: unsafe_reason())

    def while_returning(frame: Any) -> Any:
        with _safety.returning(frame):
            return unsafe_reason()

    returning = in_dynamo(while_returning)

    # THEN the first is a compiled region; a returning wrapper no longer counts
    assert inside is UnsafeReason.COMPILED
    assert returning is None


def test_a_tensor_operators_python_dispatch_is_not_safe(watch):
    # GIVEN a subclass's __torch_dispatch__, and a frame of DTensor's code
    dispatch = _function_in("/home/me/my_tensor.py", name="__torch_dispatch__")
    dtensor = _function_in("/site-packages/torch/distributed/tensor/_dispatch.py")

    # THEN both are inside an operator's dispatch
    assert dispatch(lambda frame: unsafe_reason()) is UnsafeReason.DISPATCH
    assert dtensor(lambda frame: unsafe_reason()) is UnsafeReason.DISPATCH


def test_an_optimizer_step_on_the_stack_is_seen(watch):
    # GIVEN a frame of torch.optim
    in_optim = _function_in("/site-packages/torch/optim/adam.py")

    # THEN the step is seen from inside, and not from outside
    assert in_optim(lambda frame: _safety.in_optimizer_step(skip=1)) is True
    assert _safety.in_optimizer_step() is False


def test_the_jobs_prepared_profiler_is_unsafe_until_it_exits_and_dynprofs_own_never_is(watch):
    # GIVEN a callback for a profiler the job prepares
    prepared: list[bool] = []
    watch.on_foreign_prepare = lambda: prepared.append(True)
    job_prof, our_prof = object.__new__(type("P", (), {})), object.__new__(type("Q", (), {}))

    # WHEN dynprof prepares its own
    with watch.ours():
        watch._prepared(our_prof)

    # THEN nothing is foreign, no callback
    assert not watch.foreign_active() and prepared == [] and unsafe_reason() is None

    # WHEN the job prepares one
    watch._prepared(job_prof)

    # THEN it is foreign, the callback ran, and the moment is unsafe (unless that check is off)
    assert watch.foreign_active() and prepared == [True]
    assert unsafe_reason() is UnsafeReason.OTHER_PROFILER
    assert unsafe_reason(check_other_profiler=False) is None

    # WHEN it exits THEN all is safe again
    watch._exited(job_prof)
    assert not watch.foreign_active() and unsafe_reason() is None


def _fake_torch_profilers(monkeypatch: pytest.MonkeyPatch, calls: list[str]) -> tuple[type, type]:
    class AutogradProfile:
        def _prepare_trace(self) -> str:
            calls.append("prepare")
            return "prepared"

        def __exit__(self, *exc: Any) -> bool:
            calls.append("exit")
            return False

    class Profile:
        def start(self) -> None:
            calls.append("start")

        def stop(self) -> None:
            calls.append("stop")

    monkeypatch.setitem(sys.modules, "torch.autograd.profiler", types.SimpleNamespace(profile=AutogradProfile))
    monkeypatch.setitem(sys.modules, "torch.profiler.profiler", types.SimpleNamespace(profile=Profile))
    return AutogradProfile, Profile


def test_the_watch_wraps_torchs_methods_once_and_always_runs_the_originals(watch, monkeypatch):
    # GIVEN torch's profiler classes (stand-ins) and a callback that fails
    calls: list[str] = []
    autograd_profile, profile = _fake_torch_profilers(monkeypatch, calls)

    def broken() -> None:
        raise RuntimeError("callback bug")

    watch.on_foreign_prepare = broken

    # WHEN installed twice, and the job prepares, exits, starts and stops its profilers
    assert watch.install() and watch.install()
    prof = autograd_profile()
    result = prof._prepare_trace()
    assert watch.foreign_active()
    prof.__exit__(None, None, None)
    session = profile()
    session.start()
    active_during_session = watch.foreign_active()
    session.stop()

    # THEN torch's originals ran once each, their results came back, and the watch followed
    assert calls == ["prepare", "exit", "start", "stop"] and result == "prepared"
    assert active_during_session and not watch.foreign_active()
    assert getattr(autograd_profile._prepare_trace, "_dynprof_watch", False)
    assert getattr(profile.start, "_dynprof_watch", False)


def test_the_watch_is_not_in_place_without_torchs_profiler(watch, monkeypatch):
    # GIVEN no torch.autograd.profiler loaded
    monkeypatch.delitem(sys.modules, "torch.autograd.profiler", raising=False)
    monkeypatch.delitem(sys.modules, "torch.profiler.profiler", raising=False)

    # THEN install says it is not in place
    assert watch.install() is False and not watch.installed
