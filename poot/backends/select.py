"""Which backend runs the model: `--backend NAME|auto`, decided once, never retried elsewhere;
and on which devices: `--placement pipeline:ORD,...|tensor:ORD,...`.

The rules (docs/backends.md): `auto` takes the first backend whose device is present, in the
order ptx, rocm, wgpu, and never vulkan or reference; a named backend that cannot open stops
startup with its reason. Only ptx runs a group of devices (the others cannot copy between
theirs), never with per-kernel timing. This version builds the `ptx`, `rocm`, `vulkan` and
`wgpu` device backends and the numpy `reference`.
"""
import re

from ..errors import BackendUnavailable, NoSuchDevice, PlacementRefused, UsageError

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


def parse_placement(text):
    """'pipeline:0,1' or 'tensor:0,1' -> (kind, [ordinals])."""
    kind, _, ordinals = text.partition(":")
    if kind not in ("pipeline", "tensor") or not re.fullmatch(r"\d+(,\d+)*", ordinals):
        raise UsageError(f"--placement {text!r}: expected pipeline:ORD,ORD,... or "
                         "tensor:ORD,ORD,...")
    devices = [int(o) for o in ordinals.split(",")]
    if len(set(devices)) != len(devices):
        raise UsageError(f"--placement {text!r}: a device ordinal is listed twice")
    return kind, devices


def check_placement(backend, placement, device_timing=False):
    """The placement rules that need no device: the reference backend places nothing, and a
    group runs on ptx only (auto may find it), untimed."""
    if not placement:
        return
    _, ordinals = parse_placement(placement)
    if backend == "reference":
        raise PlacementRefused(f"--placement {placement}: backend reference runs on the host "
                               "and places nothing on devices")
    if len(ordinals) > 1:
        if device_timing:
            raise PlacementRefused("--device-timing is refused over a device group")
        if backend not in ("ptx", "auto"):
            raise PlacementRefused(f"--placement {placement}: backend {backend} cannot copy "
                                   "between devices, so it runs no groups (only ptx does)")


def open_placed(backend, placement=None):
    """The Device of `backend` at the ordinal `placement` names (0 without one), or the ptx
    DeviceGroup of the ordinals it lists: an ordinal the driver does not list is a usage error
    once the driver has said how many it lists."""
    ordinals = parse_placement(placement)[1] if placement else [0]
    try:
        if len(ordinals) == 1:
            return open_device(backend, ordinals[0])
        from .ptx import PtxGroup
        try:
            return PtxGroup(ordinals)
        except BackendUnavailable as e:
            if backend == "auto":      # auto would pick a backend that runs no groups
                raise PlacementRefused(f"--placement {placement}: only ptx runs device groups, "
                                       f"and it cannot open here: {e}") from None
            raise
    except NoSuchDevice as e:
        if placement:
            raise NoSuchDevice(f"--placement {placement}: {e}") from None
        raise
