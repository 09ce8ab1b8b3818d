"""The toolchain check (`poot devices`): which driver libraries load, and what each backend opens.

For each native library, the file it was loaded from and its version, or the loader's reason.
For each backend, every device it opens, through the same Device classes and the same
open_device as poot-serve (so a device listed here is one the server can open): its name,
memory free/total and where that figure comes from, capabilities, subgroup size and codegen
target. It allocates nothing. Not here: choosing a backend (select.py) or any repair.
"""
import os
import platform

from drivers import DriverError
from drivers import comgr, cuda, hsa, vulkan, wgpu

from ..errors import BackendUnavailable, CapacityError, NoSuchDevice
from .select import AUTO_ORDER, open_device

DEVICE_BACKENDS = ("ptx", "rocm", "vulkan", "wgpu")
VENDOR_TOOLS = "nvidia-smi (ptx), rocminfo (rocm), vulkaninfo --summary (vulkan, wgpu)"


def loaded_file(name):
    """The file the dynamic loader mapped for `name` (a soname or a path), from this process's
    memory map; `name` itself where the map does not show it."""
    if os.path.isabs(name):
        return os.path.realpath(name)
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                path = line.split(maxsplit=5)[-1].strip()
                if os.path.basename(path).startswith(name):
                    return path
    except OSError:
        pass
    return name


def file_version(path):
    """The version a shared library's file name carries (libvulkan.so.1.3.239 -> 1.3.239)."""
    _, _, version = os.path.basename(path).partition(".so.")
    return version or "unknown"


def _cuda():
    driver = cuda.Driver()
    path = loaded_file(driver.path)
    number = driver.driver_get_version()
    return path, f"CUDA {number // 1000}.{number % 1000 // 10} (driver file {file_version(path)})"


def _hsa():
    runtime = hsa.Runtime()
    path = loaded_file(runtime.path)
    try:
        runtime.init()
    except DriverError as e:
        return path, f"file {file_version(path)}; the runtime does not start: {e}"
    try:
        major = runtime.system_get_info(hsa.HSA_SYSTEM_INFO_VERSION_MAJOR)
        minor = runtime.system_get_info(hsa.HSA_SYSTEM_INFO_VERSION_MINOR)
    finally:
        runtime.shut_down()
    return path, f"HSA {major}.{minor} (file {file_version(path)})"


def _comgr():
    library = comgr.Comgr()
    path = loaded_file(library.path)
    return path, f"interface {library.version[0]}.{library.version[1]} (file {file_version(path)})"


def _vulkan():
    lib, path = vulkan.load()
    number = vulkan.ffi.new("uint32_t *")
    vulkan.check(lib.vkEnumerateInstanceVersion(number), "vkEnumerateInstanceVersion")
    return loaded_file(path), f"Vulkan {vulkan.version_string(number[0])} (loader)"


def _wgpu():
    lib, path = wgpu.load()
    return loaded_file(path), f"wgpu-native {wgpu.version_string(lib.wgpuGetVersion())}"


LIBRARIES = (("libcuda", "ptx", _cuda), ("libhsa-runtime64", "rocm", _hsa),
             ("libamd_comgr", "rocm", _comgr), ("libvulkan", "vulkan, wgpu", _vulkan),
             ("wgpu-native", "wgpu", _wgpu))


def libraries():
    """[(library, backends using it, path or None, version or the reason it did not load)]."""
    out = []
    for name, users, probe in LIBRARIES:
        try:
            path, version = probe()
        except DriverError as e:
            out.append((name, users, None, str(e)))
        except AttributeError as e:     # cffi: a symbol the library does not export
            out.append((name, users, None, f"the library loaded is not {name}: {e}"))
        else:
            out.append((name, users, path, version))
    return out


def devices(backend):
    """(every Device the backend opens, by ordinal; the reason it opens no more, or None)."""
    out = []
    while True:
        try:
            out.append(open_device(backend, len(out)))
        except NoSuchDevice:
            return out, None
        except BackendUnavailable as e:
            return out, str(e)


def memory_line(device):
    try:
        free, total = device.memory()
    except CapacityError:
        return f"memory: unknown; {device.memory_source}"
    return f"memory: {free / (1 << 20):,.0f} MiB free of {total / (1 << 20):,.0f} MiB " \
           f"({device.memory_source})"


def report(out):
    """Writes the check to `out`; the exit status: 0 when some backend opens a device, else 3."""
    print(f"poot devices: the toolchain check ({platform.system()} {platform.machine()})",
          file=out)
    print("\ndriver libraries", file=out)
    for name, users, path, version in libraries():
        state = f"{path}: {version}" if path else f"not loaded: {version}"
        print(f"  {name:<17} ({users}) {state}", file=out)
    print("\nbackends", file=out)
    opened = {}
    for backend in DEVICE_BACKENDS:
        found, reason = devices(backend)
        opened[backend] = found
        if not found:
            print(f"  {backend:<7} unavailable: {reason}", file=out)
        for device in found:
            print(f"  {backend:<7} {device.name}", file=out)
            print(f"          {memory_line(device)}", file=out)
            print(f"          capabilities: {' '.join(sorted(device.caps))}; subgroup "
                  f"{device.subgroup_size}; codegen: {device.target}", file=out)
        if found and reason:
            print(f"          (no more devices: {reason})", file=out)
    picked = next((b for b in AUTO_ORDER if opened[b]), None)
    print(f"\n--backend auto picks: {picked or 'nothing (every probed backend is unavailable)'}"
          f"; --backend reference (numpy) needs no driver", file=out)
    print(f"cross-check with the vendors' tools: {VENDOR_TOOLS}", file=out)
    return 0 if any(opened.values()) else BackendUnavailable.exit_status
