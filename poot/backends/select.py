"""Which backend runs the model: `--backend NAME|auto`, decided once, never retried elsewhere.

The rules (docs/backends.md): `auto` takes the first backend whose device is present, in the
order ptx, rocm, wgpu, and never vulkan or reference; a named backend that cannot open stops
startup with its reason. This version builds the `ptx`, `rocm`, `vulkan` and `wgpu` device
backends and the numpy `reference`.
"""
from ..errors import BackendUnavailable, UsageError

BACKENDS = ("auto", "ptx", "rocm", "vulkan", "wgpu", "reference")
AUTO_ORDER = ("ptx", "rocm", "wgpu")


def open_device(name, ordinal=0):
    """The Device of backend `name` (None for reference), or the error that stops startup."""
    if name not in BACKENDS:
        raise UsageError(f"--backend {name!r}: choose one of {', '.join(BACKENDS)}")
    if name == "reference":
        return None
    if name == "auto":
        reasons = []
        for candidate in AUTO_ORDER:
            try:
                return open_device(candidate, ordinal)
            except BackendUnavailable as e:
                reasons.append(str(e))
        raise BackendUnavailable("--backend auto found no device: " + "; ".join(reasons)
                                 + " (--backend reference runs the numpy interpreter)")
    if name == "rocm":
        from .rocm import RocmDevice
        return RocmDevice(ordinal)
    if name == "vulkan":
        from .vulkan import VulkanDevice
        return VulkanDevice(ordinal)
    if name == "wgpu":
        from .wgpu import WgpuDevice
        return WgpuDevice(ordinal)
    from .ptx import PtxDevice
    return PtxDevice(ordinal)
