"""collectors.memory.plan.meter: a tensor's storage, the live-bytes meter op by op, and what
autocast's cache holds."""

from __future__ import annotations

import gc

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode

from collectors.memory.plan import meter as plan_meter
from collectors.memory.plan.meter import LiveTensorBytes

F32 = 4


# -- storages ------------------------------------------------------------------------------------------
def test_a_storage_is_its_address_and_size_else_the_object_s_identity():
    t = torch.zeros(10)
    assert plan_meter._storage(t) == (t.untyped_storage().data_ptr(), 40)
    assert plan_meter._storage(t[2:5]) == plan_meter._storage(t)  # a view is its base's storage

    class Sized:
        def numel(self) -> int:
            return 3

        def element_size(self) -> int:
            return 2

    odd = Sized()
    assert plan_meter._storage(odd) == (id(odd), 6)
    assert plan_meter._storage(object()) is None


def test_an_operator_s_schema_says_which_returns_are_new_storages():
    assert plan_meter._fresh_returns(torch.ops.aten.add.Tensor) == (True,)
    assert plan_meter._fresh_returns(torch.ops.aten.view.default) == (False,)
    assert plan_meter._fresh_returns(torch.ops.aten.add_.Tensor) == (False,)  # in place: its input
    assert plan_meter._fresh_returns(torch.ops.aten.var_mean.correction) == (True, True)
    assert plan_meter._fresh_returns(object()) == ()


# -- the live-bytes meter ------------------------------------------------------------------------------
def test_a_storage_is_counted_once_until_it_dies():
    meter = LiveTensorBytes()
    freed: list[tuple[int, int]] = []
    new: list[tuple[int, int]] = []
    meter.on_free = lambda address, size: freed.append((address, size))
    meter.on_new = lambda address, size: new.append((address, size))
    t = torch.zeros(100)
    address = t.untyped_storage().data_ptr()
    meter.add(t)
    meter.add(t[10:])  # a view: the same storage
    meter.add(torch.zeros(0))  # nothing to count
    meter.add("not a tensor")
    assert meter.current == meter.peak == 400 and meter.counts(t) and meter.counts(t[:1])
    assert new == [(address, 400)]
    meter.active = True  # deaths are told only while it is entered
    del t
    gc.collect()
    assert meter.current == 0 and meter.peak == 400
    assert freed == [(address, 400)]
    assert not meter.counts("not a tensor")


def test_known_tensors_are_counted_from_the_start_and_others_from_their_making():
    weight = torch.zeros(256)
    with LiveTensorBytes([weight]) as meter:
        assert meter.current == 1024 and meter.active
        a = torch.ones(64)  # 256 B, new
        b = a.view(8, 8)  # a view: nothing new
        c = torch.add(a, 1)  # 256 B more
        pair = torch.var_mean(torch.ones(4, 4), dim=0)  # two returns of 16 B; the 64 B input dies
        assert b is not None and c is not None and pair is not None
        assert meter.current == 1024 + 256 + 256 + 16 + 16
        assert meter.peak == 1024 + 256 + 256 + 64 + 16 + 16
        assert meter.ops >= 4
    assert not meter.active and _get_current_dispatch_mode() is None
    assert meter.peak >= meter.current


def test_with_on_op_the_caller_gets_each_level_and_keeps_its_own_peak():
    levels: list[int] = []
    with LiveTensorBytes(on_op=levels.append) as meter:
        x = torch.ones(10)
        y = x * 2
        del x
        assert y is not None
    assert levels == [40, 80]
    assert meter.peak == 80  # add() itself still raises it
    meter.close()


def test_a_cut_calls_the_caller_before_the_next_operator_and_its_failure_is_kept():
    calls: list[int] = []
    with LiveTensorBytes() as meter:
        meter.on_cut = lambda: calls.append(meter.current)
        meter.cut = True
        torch.ones(3)
        assert calls == [0] and not meter.cut
        torch.ones(3)
        assert calls == [0]  # once per cut

        def broken() -> None:
            raise ValueError("no")

        meter.on_cut = broken
        meter.cut = True
        torch.ones(3)  # the operator still runs
    assert meter.error == "live bytes: ValueError: no"


def test_only_the_device_s_storages_are_counted():
    meter = LiveTensorBytes(device=torch.device("meta"))
    meter.add(torch.zeros(10))
    assert meter.current == 0
    meter.add(torch.zeros(10, device="meta"))  # a meta storage has no bytes
    assert meter.current == 0


def test_closing_forgets_every_storage_and_no_death_is_told_after():
    freed: list[int] = []
    meter = LiveTensorBytes()
    meter.on_free = lambda address, size: freed.append(size)
    with meter:
        t = torch.ones(50)
    meter.close()
    del t
    gc.collect()
    assert freed == [] and not meter.counts(torch.ones(1))


def test_nested_outputs_are_walked():
    meter = LiveTensorBytes()
    held = [torch.zeros(2), (torch.zeros(3), None), "x"]
    meter._add_any(held)
    assert meter.current == 20


# -- autocast --------------------------------------------------------------------------------------------
def test_autocast_is_seen_nested_only_inside_its_context():
    assert not plan_meter._autocast_nested()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert plan_meter._autocast_nested()
    assert not plan_meter._autocast_nested()


def test_a_parameter_s_autocast_copy_is_told_from_other_tensors():
    linear = torch.nn.Linear(4, 4)
    seen: list[bool] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        seen.append(plan_meter._is_param_cast(t))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            linear(torch.randn(2, 4, requires_grad=True) * 1)
    # linear saves its input's cast (of a non-leaf) and the weight's cast (a parameter's)
    assert True in seen and False in seen
    assert not plan_meter._is_param_cast(torch.zeros(2))
    x = torch.randn(4, requires_grad=True)
    assert not plan_meter._is_param_cast((x * 2).to(torch.bfloat16))  # a copy of a non-leaf
