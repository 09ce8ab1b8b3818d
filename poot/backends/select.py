"""Which backend runs the model: `--backend NAME|auto`, decided once, never retried elsewhere.

The rules (../../docs/backends.md): `auto` takes the first backend whose device is present, in
the order ptx, rocm, wgpu, and never vulkan or reference; a named backend that cannot open stops
startup with its reason. This version builds the numpy `reference` backend only, so every other
name is unavailable, and says so.
"""
from ..errors import BackendUnavailable, UsageError

BACKENDS = ("auto", "ptx", "rocm", "vulkan", "wgpu", "reference")
AUTO_ORDER = ("ptx", "rocm", "wgpu")


def check_backend(name):
    """Returns the backend that will run, or raises the error that stops startup."""
    if name not in BACKENDS:
        raise UsageError(f"--backend {name!r}: choose one of {', '.join(BACKENDS)}")
    if name == "reference":
        return name
    if name == "auto":
        raise BackendUnavailable(
            f"--backend auto: no device backend ({', '.join(AUTO_ORDER)}) is built in this "
            "version of poot; run the numpy interpreter with --backend reference")
    raise BackendUnavailable(f"--backend {name}: this backend is not built in this version of "
                             "poot; --backend reference runs the numpy interpreter")
