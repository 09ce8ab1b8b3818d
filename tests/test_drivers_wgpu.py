"""drivers/wgpu.py against the wgpu-native library of the `wgpu` wheel (lavapipe underneath on a
machine without a GPU).

Read as an example of the binding in use: find the library without importing the `wgpu` package,
a Vulkan-only instance, the adapter and its limits, a device requested with those limits, the
SPIR-V the Vulkan tests run pushed through naga and checked against numpy, and invalid input
reported as an error (error scopes, the uncaptured-error callback) instead of an abort.
"""

import shutil
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from drivers import DriverError, LibraryNotFound, held_functions
from drivers import wgpu

ffi = wgpu.ffi
SPIRV_SOURCES = Path(__file__).parent / "data" / "spirv"
NAN_PATTERN = 0x7FC0DEAD  # a quiet NaN no arithmetic produces: the output is poisoned with it


def assemble(name, tmp_path):
    """SPIR-V words of tests/data/spirv/<name>.spvasm, assembled with spirv-as (test-only tool)."""
    if shutil.which("spirv-as") is None:
        pytest.skip("spirv-as not installed (Debian package spirv-tools)")
    output = tmp_path / f"{name}.spv"
    subprocess.run(["spirv-as", "--target-env", "vulkan1.1", str(SPIRV_SOURCES / f"{name}.spvasm"),
                    "-o", str(output)], check=True)
    return output.read_bytes()


@pytest.fixture(scope="module")
def loaded():
    try:
        return wgpu.load()
    except LibraryNotFound as error:
        pytest.skip(f"wgpu-native not available (pip install wgpu): {error}")


@pytest.fixture(scope="module")
def lib(loaded):
    return loaded[0]


@pytest.fixture(scope="module")
def instance(lib):
    extras = wgpu.new("WGPUInstanceExtras", backends=lib.WGPUInstanceBackend_Vulkan)
    handle = lib.wgpuCreateInstance(wgpu.chain(wgpu.new("WGPUInstanceDescriptor"), extras))
    assert handle != ffi.NULL
    yield handle
    lib.wgpuInstanceRelease(handle)


@pytest.fixture(scope="module")
def adapter(lib, instance):
    options = wgpu.new("WGPURequestAdapterOptions", backendType=lib.WGPUBackendType_Vulkan)
    try:
        handle = wgpu.request_adapter(lib, instance, options)
    except DriverError as error:
        pytest.skip(f"no Vulkan adapter for wgpu (mesa-vulkan-drivers gives lavapipe): {error}")
    yield handle
    lib.wgpuAdapterRelease(handle)


def adapter_info(lib, adapter):
    """The adapter's description strings and types, read before wgpu frees them."""
    info = wgpu.new("WGPUAdapterInfo")
    assert lib.wgpuAdapterGetInfo(adapter, info) == lib.WGPUStatus_Success
    try:
        return {"device": wgpu.text(info.device), "description": wgpu.text(info.description),
                "backend": info.backendType, "type": info.adapterType}
    finally:
        lib.wgpuAdapterInfoFreeMembers(info[0])


def is_lavapipe(lib, adapter):
    return "llvmpipe" in adapter_info(lib, adapter)["device"]


class Device:
    """A WGPUDevice requested with the adapter's own limits (and the immediates feature where
    offered), collecting errors raised outside any scope; released objects are tracked."""

    def __init__(self, lib, instance, adapter):
        self.lib, self.instance = lib, instance
        self.limits = wgpu.new("WGPULimits")
        assert lib.wgpuAdapterGetLimits(adapter, self.limits) == lib.WGPUStatus_Success
        features = [lib.WGPUNativeFeature_Immediates] if lib.wgpuAdapterHasFeature(
            adapter, lib.WGPUNativeFeature_Immediates) else []
        self.uncaptured = []
        # Without this callback an unscoped error aborts the process; it lives with the device.
        self.callback = wgpu.uncaptured_error_callback(self.uncaptured)
        descriptor = wgpu.new(
            "WGPUDeviceDescriptor", label="poot test device",
            requiredFeatureCount=len(features),
            requiredFeatures=ffi.new("WGPUFeatureName[]", features),
            requiredLimits=self.limits,
            uncapturedErrorCallbackInfo={"callback": self.callback})
        self.handle = wgpu.request_device(lib, instance, adapter, descriptor)
        self.queue = lib.wgpuDeviceGetQueue(self.handle)
        self.releases = []

    def make(self, kind, descriptor):
        """wgpuDeviceCreate<kind>, inside error scopes (so an invalid object raises DriverError);
        the object, valid or not, is released with the device."""
        call, release = f"wgpuDeviceCreate{kind}", getattr(self.lib, f"wgpu{kind}Release")
        with wgpu.error_scope(self.lib, self.instance, self.handle, call):
            made = getattr(self.lib, call)(self.handle, descriptor)
            self.releases.append(lambda: release(made))
        return made

    def buffer(self, size, usage):
        return self.make("Buffer", wgpu.new("WGPUBufferDescriptor", size=size, usage=usage))

    def release(self):
        for release in reversed(self.releases):
            release()
        self.lib.wgpuQueueRelease(self.queue)
        self.lib.wgpuDeviceRelease(self.handle)


@pytest.fixture(scope="module")
def device(lib, instance, adapter):
    device = Device(lib, instance, adapter)
    yield device
    device.release()


@pytest.fixture(autouse=True)
def no_uncaptured_errors(request):
    """Fail a test that left an error no scope caught."""
    if "device" not in request.fixturenames:
        yield
        return
    device = request.getfixturevalue("device")
    yield
    assert [str(error) for error in device.uncaptured] == []


def test_the_calls_a_launch_makes_are_declared_alike_to_ctypes(lib):
    """RECORDED's ctypes signatures agree with the cffi declarations (drivers.held_functions
    checks them as it binds), and each is a function of the opened library."""
    held = held_functions(wgpu.ffi, lib, wgpu.RECORDED)
    assert all(callable(getattr(held, name)) for name in wgpu.RECORDED)


def test_library_comes_from_the_wheel_without_importing_wgpu(lib, loaded):
    path = loaded[1]
    assert Path(path).name.startswith("libwgpu_native") and Path(path).parent.name == "resources"
    assert path in wgpu.candidates()
    assert "wgpu" not in sys.modules, "finding the library must not import the wgpu package"
    assert wgpu.version_string(lib.wgpuGetVersion()).startswith("29.")


def test_adapter_is_vulkan(lib, adapter):
    info = adapter_info(lib, adapter)
    assert info["backend"] == lib.WGPUBackendType_Vulkan
    if is_lavapipe(lib, adapter):
        assert info["type"] == lib.WGPUAdapterType_CPU
    features = wgpu.new("WGPUSupportedFeatures")
    lib.wgpuAdapterGetFeatures(adapter, features)
    try:
        names = {wgpu.enum_name("WGPUFeatureName", features.features[i])
                 for i in range(features.featureCount)}
    finally:
        lib.wgpuSupportedFeaturesFreeMembers(features[0])
    if is_lavapipe(lib, adapter):
        assert {"WGPUFeatureName_ShaderF16", "WGPUNativeFeature_Immediates",
                "WGPUNativeFeature_Subgroup"} <= names


def test_device_has_the_adapter_limits(lib, adapter, device):
    limits = wgpu.new("WGPULimits")
    assert lib.wgpuDeviceGetLimits(device.handle, limits) == lib.WGPUStatus_Success
    assert limits.maxStorageBufferBindingSize == device.limits.maxStorageBufferBindingSize
    assert limits.maxBufferSize == device.limits.maxBufferSize
    assert limits.maxImmediateSize == device.limits.maxImmediateSize
    if is_lavapipe(lib, adapter):
        assert limits.maxImmediateSize == 128
        assert limits.maxStorageBufferBindingSize == 128 << 20


def test_affine_dispatch_matches_numpy(lib, instance, device, tmp_path):
    """The SPIR-V the Vulkan test runs, through naga: y = a*x + b, with the output poisoned."""
    if device.limits.maxImmediateSize < 12:
        pytest.skip("the adapter offers no immediates (push constants)")
    n, pad, local_size = 1000, 64, 64
    rng = np.random.default_rng()
    x = rng.standard_normal(n).astype(np.float32)
    a, b = np.float32(rng.uniform(-2, 2)), np.float32(rng.uniform(-2, 2))

    code = assemble("affine", tmp_path)
    words = ffi.from_buffer("uint32_t[]", code)
    source = wgpu.new("WGPUShaderSourceSPIRV", codeSize=len(code) // 4, code=words)
    module = device.make("ShaderModule", wgpu.chain(
        wgpu.new("WGPUShaderModuleDescriptor", label="affine"), source))
    entries = wgpu.new_array("WGPUBindGroupLayoutEntry", [
        {"binding": 0, "visibility": lib.WGPUShaderStage_Compute,
         "buffer": {"type": lib.WGPUBufferBindingType_ReadOnlyStorage}},
        {"binding": 1, "visibility": lib.WGPUShaderStage_Compute,
         "buffer": {"type": lib.WGPUBufferBindingType_Storage}}])
    group_layout = device.make("BindGroupLayout", wgpu.new(
        "WGPUBindGroupLayoutDescriptor", entryCount=2, entries=entries))
    layouts = ffi.new("WGPUBindGroupLayout[]", [group_layout])
    pipeline_layout = device.make("PipelineLayout", wgpu.new(
        "WGPUPipelineLayoutDescriptor", bindGroupLayoutCount=1, bindGroupLayouts=layouts,
        immediateSize=12))
    pipeline = device.make("ComputePipeline", wgpu.new(
        "WGPUComputePipelineDescriptor", label="affine", layout=pipeline_layout,
        compute={"module": module, "entryPoint": "main"}))

    x_buffer = device.buffer(4 * n, lib.WGPUBufferUsage_Storage | lib.WGPUBufferUsage_CopyDst)
    copy_src, copy_dst = lib.WGPUBufferUsage_CopySrc, lib.WGPUBufferUsage_CopyDst
    y_buffer = device.buffer(4 * (n + pad), lib.WGPUBufferUsage_Storage | copy_src | copy_dst)
    readback = device.buffer(4 * (n + pad), lib.WGPUBufferUsage_MapRead | copy_dst)
    group = device.make("BindGroup", wgpu.new(
        "WGPUBindGroupDescriptor", layout=group_layout, entryCount=2,
        entries=wgpu.new_array("WGPUBindGroupEntry", [
            {"binding": 0, "buffer": x_buffer, "offset": 0, "size": 4 * n},
            {"binding": 1, "buffer": y_buffer, "offset": 0, "size": 4 * (n + pad)}])))

    lib.wgpuQueueWriteBuffer(device.queue, x_buffer, 0, ffi.from_buffer(x), x.nbytes)
    poison = np.full(n + pad, NAN_PATTERN, dtype=np.uint32)
    lib.wgpuQueueWriteBuffer(device.queue, y_buffer, 0, ffi.from_buffer(poison), poison.nbytes)

    with wgpu.error_scope(lib, instance, device.handle, "encoding the affine dispatch"):
        encoder = lib.wgpuDeviceCreateCommandEncoder(device.handle, ffi.NULL)
        compute = lib.wgpuCommandEncoderBeginComputePass(encoder, ffi.NULL)
        lib.wgpuComputePassEncoderSetPipeline(compute, pipeline)
        lib.wgpuComputePassEncoderSetBindGroup(compute, 0, group, 0, ffi.NULL)
        params = struct.pack("<ffI", a, b, n)
        lib.wgpuComputePassEncoderSetImmediates(compute, 0, ffi.from_buffer(params), len(params))
        groups = (n + local_size - 1) // local_size
        lib.wgpuComputePassEncoderDispatchWorkgroups(compute, groups, 1, 1)
        lib.wgpuComputePassEncoderEnd(compute)
        lib.wgpuComputePassEncoderRelease(compute)
        lib.wgpuCommandEncoderCopyBufferToBuffer(encoder, y_buffer, 0, readback, 0, 4 * (n + pad))
        commands = lib.wgpuCommandEncoderFinish(encoder, ffi.NULL)
        lib.wgpuCommandEncoderRelease(encoder)
    lib.wgpuQueueSubmit(device.queue, 1, ffi.new("WGPUCommandBuffer[]", [commands]))
    lib.wgpuCommandBufferRelease(commands)

    wgpu.map_buffer(lib, instance, device.handle, readback, lib.WGPUMapMode_Read, 0, 4 * (n + pad))
    mapped = lib.wgpuBufferGetConstMappedRange(readback, 0, 4 * (n + pad))
    result = np.frombuffer(ffi.buffer(mapped, 4 * (n + pad)), dtype=np.float32).copy()
    lib.wgpuBufferUnmap(readback)

    np.testing.assert_allclose(result[:n], a * x + b, rtol=1e-6, atol=1e-6)
    assert (result[n:].view(np.uint32) == NAN_PATTERN).all(), "the shader wrote past n"


def test_invalid_shader_is_an_error_not_an_abort(lib, instance, device):
    garbage = ffi.new("uint32_t[]", [0x07230203, 0x00010300, 0, 10, 0, 1, 2, 3])  # header, junk
    source = wgpu.new("WGPUShaderSourceSPIRV", codeSize=len(garbage), code=garbage)
    descriptor = wgpu.chain(wgpu.new("WGPUShaderModuleDescriptor", label="garbage"), source)
    with pytest.raises(DriverError) as caught:
        device.make("ShaderModule", descriptor)
    error = caught.value
    assert (error.library, error.call, error.name) == (
        "wgpu", "wgpuDeviceCreateShaderModule", "WGPUErrorType_Validation")
    assert "garbage" in error.text  # wgpu's own message names the module's label
    assert "\n" not in str(error)

    # Made with no scope, the same mistake reaches the uncaptured-error callback.
    module = lib.wgpuDeviceCreateShaderModule(device.handle, descriptor)
    lib.wgpuShaderModuleRelease(module)
    assert [e.name for e in device.uncaptured] == ["WGPUErrorType_Validation"]
    device.uncaptured.clear()


def test_invalid_pipeline_is_caught_before_submit(lib, instance, device, tmp_path):
    """A pipeline whose layout lacks the shader's immediates is reported by the error scope,
    so it never reaches wgpuQueueSubmit (which would abort the process on it)."""
    code = assemble("affine", tmp_path)
    source = wgpu.new("WGPUShaderSourceSPIRV", codeSize=len(code) // 4,
                      code=ffi.from_buffer("uint32_t[]", code))
    module = device.make("ShaderModule", wgpu.chain(wgpu.new("WGPUShaderModuleDescriptor"), source))
    layout = device.make("PipelineLayout",
                         wgpu.new("WGPUPipelineLayoutDescriptor", immediateSize=0))
    with pytest.raises(DriverError) as caught:
        device.make("ComputePipeline", wgpu.new(
            "WGPUComputePipelineDescriptor", label="no immediates", layout=layout,
            compute={"module": module, "entryPoint": "main"}))
    assert caught.value.name == "WGPUErrorType_Validation"
    assert caught.value.call == "wgpuDeviceCreateComputePipeline"


def test_another_library_is_refused(monkeypatch, lib):
    monkeypatch.setenv(wgpu.ENV_VAR, "libvulkan.so.1")  # opens, but is not wgpu-native
    try:
        ffi.dlopen("libvulkan.so.1")
    except OSError:
        pytest.skip("libvulkan.so.1 (the stand-in library) is not installed")
    with pytest.raises(DriverError, match="does not export wgpuGetVersion"):
        wgpu.load()


def test_library_absent_names_the_path(monkeypatch):
    monkeypatch.setenv(wgpu.ENV_VAR, "/nonexistent/libwgpu_native-release.so")
    with pytest.raises(LibraryNotFound) as caught:
        wgpu.load()
    assert isinstance(caught.value, DriverError)
    assert "/nonexistent/libwgpu_native-release.so" in str(caught.value)
