"""The options `poot plan` and `poot-serve` share, and the rules they check before anything
opens; which backend opens, on which devices, is backends/select.py's."""
import argparse
import re

from .backends.select import check_placement
from .errors import CapacityError, UsageError

# Device memory the plan leaves to the driver's own objects made after it (recorded step graphs,
# measured at 6 MiB for a 1B's 14 on the H200; loaded modules): the plan fills the rest with
# the KV cache, and nothing may run out once serving.
DRIVER_RESERVE = 256 << 20
_SIZE_UNITS = {"": 1, "b": 1, "kb": 10 ** 3, "mb": 10 ** 6, "gb": 10 ** 9, "tb": 10 ** 12,
               "kib": 2 ** 10, "mib": 2 ** 20, "gib": 2 ** 30, "tib": 2 ** 40}


class Parser(argparse.ArgumentParser):
    """argparse that raises UsageError (exit status 2, one line) instead of exiting itself."""

    def error(self, message):
        raise UsageError(f"{self.prog}: {message}")


def parse_size(text):
    """'8GiB', '512MB', '1.5GiB', '1000000' -> bytes."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]i?b|b)?\s*", text, re.IGNORECASE)
    if not m:
        raise UsageError(f"--memory-limit {text!r}: expected a size such as 8GiB or 512MB")
    size = int(float(m.group(1)) * _SIZE_UNITS[(m.group(2) or "").lower()])
    if size <= 0:
        raise UsageError(f"--memory-limit {text!r}: the size must be positive")
    return size


def check_flags(args):
    """Flag rules that hold before anything opens (the placement's among them); returns the
    memory limit, None without one."""
    memory_limit = parse_size(args.memory_limit) if args.memory_limit else None
    for flag, value in (("--max-seqs", args.max_seqs), ("--ctx", args.ctx),
                        ("--prefill-chunk", args.prefill_chunk)):
        if value is not None and value < 1:
            raise UsageError(f"{flag} {value}: must be at least 1")
    if not 0 <= args.port < 65536:
        raise UsageError(f"--port {args.port}: not a port number")
    check_placement(args.backend, args.placement, args.device_timing)
    if args.device_timing and args.backend == "reference":
        raise UsageError("--device-timing: backend reference has no device to time")
    return memory_limit


def check_context(args, model):
    if args.ctx is not None and args.ctx > model.context_length:
        raise UsageError(f"--ctx {args.ctx} exceeds the model's context length "
                         f"{model.context_length}")


def device_memory(device, memory_limit):
    """(free, total, source) of the memory startup plans within: the driver's own free figure
    less DRIVER_RESERVE, capped by --memory-limit; a driver that reports none (a Vulkan driver
    without VK_EXT_memory_budget) needs the limit, else its CapacityError stops startup."""
    try:
        free, total = device.memory()
    except CapacityError:
        if memory_limit is None:
            raise
        return memory_limit, memory_limit, "--memory-limit (the driver reports no budget)"
    free = max(free - DRIVER_RESERVE, 0)
    if memory_limit is not None and memory_limit < free:
        return memory_limit, total, "--memory-limit"
    return free, total, f"{device.memory_source}, less {DRIVER_RESERVE >> 20} MiB for the driver"
