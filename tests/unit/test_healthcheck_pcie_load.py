"""healthcheck.pcie_load: backend devices matched to torch's CUDA ordinals by UUID, and PCIe
links read while copies load them, over a fake torch (no GPU is touched)."""

from __future__ import annotations

import sys
import types
from itertools import count
from unittest import mock

import pytest

from healthcheck.pcie_load import loaded_links, torch_ordinals
from healthcheck.readings import DeviceReadings


class _Tensor:
    def pin_memory(self) -> _Tensor:
        return self

    def copy_(self, other, non_blocking: bool = False) -> _Tensor:
        return self


def fake_torch(uuids: list[str], available: bool = True) -> types.ModuleType:
    """A torch whose CUDA sees devices with ``uuids``, in ordinal order."""
    torch = types.ModuleType("torch")
    cuda = types.SimpleNamespace(
        is_available=lambda: available,
        device_count=lambda: len(uuids),
        get_device_properties=lambda ordinal: types.SimpleNamespace(uuid=uuids[ordinal]),
        synchronize=lambda device=None: None,
    )
    torch.cuda = cuda
    torch.float32 = "float32"
    torch.device = lambda kind, ordinal: (kind, ordinal)
    torch.empty = lambda *a, **k: _Tensor()
    torch.empty_like = lambda t, device=None: _Tensor()
    return torch


@pytest.fixture
def use_torch():
    # Not monkeypatch: the suite's hygiene fixture looks at sys.modules["torch"] after the test,
    # and must find the real one (or none) there, so this fixture undoes its change first.
    with mock.patch.dict(sys.modules):

        def install(torch: types.ModuleType | None) -> None:
            sys.modules["torch"] = torch  # type: ignore[assignment]

        yield install


def dev(index: int, uuid: str | None) -> DeviceReadings:
    return DeviceReadings(index=index, uuid=uuid)


def test_ordinals_follow_the_uuids_when_cuda_visible_devices_reorders(use_torch):
    # GIVEN backend devices 0..2 and CUDA showing them as 2, 0 (device 1 hidden)
    use_torch(fake_torch(["GPU-ccc", "GPU-aaa"]))
    readings = [dev(0, "GPU-aaa"), dev(1, "GPU-bbb"), dev(2, "GPU-ccc")]
    # WHEN mapped
    # THEN each backend index gets the ordinal CUDA gives its UUID
    assert torch_ordinals(readings) == {2: 0, 0: 1}


def test_a_torch_uuid_without_the_gpu_prefix_still_matches(use_torch):
    # torch prints UUIDs without NVML's "GPU-" prefix.
    use_torch(fake_torch(["aaa-111"]))
    assert torch_ordinals([dev(5, "GPU-aaa-111")]) == {5: 0}


def test_without_any_uuid_match_the_devices_are_taken_in_order_when_the_counts_agree(use_torch):
    use_torch(fake_torch(["x", "y"]))
    assert torch_ordinals([dev(3, None), dev(7, None)]) == {3: 0, 7: 1}


def test_without_uuids_and_with_other_counts_nothing_is_guessed(use_torch):
    # GIVEN three backend devices and two CUDA devices, none matched by UUID
    use_torch(fake_torch(["x", "y"]))
    # THEN no device is mapped (a guess could load the wrong link)
    assert torch_ordinals([dev(0, None), dev(1, None), dev(2, None)]) == {}


def test_loaded_links_without_torch_says_so(use_torch):
    use_torch(None)  # `import torch` raises ImportError
    assert loaded_links(object(), [dev(0, "GPU-a")]) == ({}, "torch is not importable here")


def test_loaded_links_without_cuda_says_so(use_torch):
    use_torch(fake_torch([], available=False))
    assert loaded_links(object(), [dev(0, "GPU-a")]) == ({}, "torch sees no CUDA device")


class Backend:
    """Reads that rise as the link trains up under load, and a device whose link never reads."""

    def __init__(self) -> None:
        self.reads = count()
        self.asked: set[int] = set()

    def read_pcie(self, index: int) -> tuple[int | None, int | None]:
        self.asked.add(index)
        if index == 1:
            return (None, 16)
        n = next(self.reads)
        return (1, 16) if n == 0 else (5, 8)


def test_loaded_links_keep_the_best_generation_and_width_seen_under_load(use_torch):
    # GIVEN two visible devices whose links read Gen1 x16 first, then Gen5 x8, and one whose
    # generation never reads
    use_torch(fake_torch(["GPU-a", "GPU-b"]))
    backend = Backend()
    readings = [dev(0, "GPU-a"), dev(1, "GPU-b")]
    # WHEN loaded for a short time
    found, why = loaded_links(backend, readings, seconds=0.12)
    # THEN the highest of each is kept, a device without a full reading is left out, and all are visible
    assert found == {0: (5, 16)}
    assert why is None
    assert backend.asked == {0, 1}


def test_loaded_links_name_the_devices_cuda_cannot_see(use_torch):
    # GIVEN device 1 hidden from CUDA
    use_torch(fake_torch(["GPU-a"]))
    found, why = loaded_links(Backend(), [dev(0, "GPU-a"), dev(1, "GPU-b")], seconds=0.06)
    # THEN device 0 is read and device 1 is named
    assert set(found) == {0}
    assert why == "devices [1] are not visible to CUDA"
