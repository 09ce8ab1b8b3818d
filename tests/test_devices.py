"""`poot devices`, the toolchain check, on this machine's real libraries, and with libraries made
absent or wrong through the drivers' environment seams (POOT_*_LIB names the only path tried)."""
import time

import pytest

from poot.backends import toolchain
from poot.backends.select import open_device
from poot.cli import main
from poot.errors import BackendUnavailable

NO_LIBRARIES = {"POOT_CUDA_LIB": "/nonexistent", "POOT_HSA_LIB": "/nonexistent",
                "POOT_COMGR_LIB": "/nonexistent", "POOT_VULKAN_LIB": "/nonexistent",
                "POOT_WGPU_LIB": "/nonexistent"}


def opens(backend):
    try:
        open_device(backend)
        return True
    except BackendUnavailable:
        return False


def run_devices(capsys):
    start = time.perf_counter()
    status = main(["devices"])
    seconds = time.perf_counter() - start
    out, err = capsys.readouterr()
    return status, out, err, seconds


def backend_lines(out, backend):
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(f"  {backend} "))
    block = [lines[start]]
    for line in lines[start + 1:]:
        if not line.startswith("          "):
            break
        block.append(line)
    return "\n".join(block)


def test_every_library_and_backend_is_reported_fast(capsys):
    status, out, err, seconds = run_devices(capsys)
    assert seconds < 2.0 and err == ""
    for name in ("libcuda", "libhsa-runtime64", "libamd_comgr", "libvulkan", "wgpu-native"):
        assert f"  {name} " in out
    for backend in toolchain.DEVICE_BACKENDS:
        block = backend_lines(out, backend)
        if opens(backend):
            assert "memory: " in block and "capabilities: " in block and "codegen: " in block
        else:
            assert "unavailable: " + backend in block
    assert status == (0 if any(opens(b) for b in toolchain.DEVICE_BACKENDS) else 3)
    assert "nvidia-smi" in out and "rocminfo" in out and "vulkaninfo" in out


def test_lavapipe_is_listed_with_no_budget_and_spirv(capsys):
    if not opens("vulkan") or "llvmpipe" not in open_device("vulkan").name:
        pytest.skip("lavapipe is not Vulkan device 0 here")
    _, out, _, _ = run_devices(capsys)
    for backend in ("vulkan", "wgpu"):
        block = backend_lines(out, backend)
        assert "llvmpipe" in block and "codegen: SPIR-V 1.3" in block and "subgroup 8" in block
        assert "no budget (no VK_EXT_memory_budget): --memory-limit needed" in block
    assert "Vulkan 1.3" in out and "wgpu-native 29." in out
    if not opens("ptx") and not opens("rocm"):
        assert "--backend auto picks: wgpu" in out


def test_the_drivers_own_reasons_are_shown_for_ptx_and_rocm(capsys):
    _, out, _, _ = run_devices(capsys)
    if not opens("ptx"):
        assert "ptx: " in backend_lines(out, "ptx")
    if not opens("rocm"):
        block = backend_lines(out, "rocm")
        assert "rocm: " in block and ("hsa_init" in block or "/nonexistent" in block
                                      or "libhsa-runtime64" in block)


def test_with_every_library_absent_nothing_is_usable_and_the_exit_is_3(capsys, monkeypatch):
    for name, value in NO_LIBRARIES.items():
        monkeypatch.setenv(name, value)
    status, out, _, _ = run_devices(capsys)
    assert status == 3
    for name in NO_LIBRARIES:
        assert f"/nonexistent (from {name})" in out
    assert "--backend auto picks: nothing" in out


def test_a_library_that_is_not_the_driver_is_named_as_such(capsys, monkeypatch):
    """POOT_CUDA_LIB pointing at a real library that is not libcuda (the Vulkan loader)."""
    from drivers import vulkan
    try:
        _, soname = vulkan.load()
    except Exception as e:
        pytest.skip(f"no Vulkan loader to stand in: {e}")
    path = toolchain.loaded_file(soname)
    monkeypatch.setenv("POOT_CUDA_LIB", path)
    _, out, _, _ = run_devices(capsys)
    assert "not loaded: the library loaded is not libcuda" in out
    with pytest.raises(BackendUnavailable) as e:
        open_device("ptx")
    assert "is not the NVIDIA driver" in str(e.value)
