"""The Device contract (poot/backends/__init__.py), checked on every backend's classes without
opening a device: the surface every device has, and each optional part present exactly where
the device's `features` name it."""
import pytest

from poot.backends import FEATURES, Device, DeviceGroup
from poot.backends.ptx import PtxDevice, PtxGroup
from poot.backends.rocm import RocmDevice
from poot.backends.vulkan import VulkanDevice
from poot.backends.wgpu import WgpuDevice

SURFACE = ("memory", "held", "allocation_bytes", "alloc", "free", "write", "read", "copy",
           "program", "build", "launch", "synchronize", "require")
GROUP_SURFACE = ("signal", "wait", "barrier", "copy", "synchronize")


@pytest.mark.parametrize("cls, kind, surface", [
    (PtxDevice, Device, SURFACE), (RocmDevice, Device, SURFACE), (VulkanDevice, Device, SURFACE),
    (WgpuDevice, Device, SURFACE), (PtxGroup, DeviceGroup, GROUP_SURFACE)])
def test_every_backend_keeps_the_contract(cls, kind, surface):
    assert issubclass(cls, kind) and cls.features <= set(FEATURES)
    assert [name for name in surface if not callable(getattr(cls, name, None))] == []
    for feature, methods in FEATURES.items():
        has = [hasattr(cls, m) for m in methods]
        assert has == [feature in cls.features] * len(methods), (cls.__name__, feature)
