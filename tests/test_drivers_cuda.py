"""drivers/cuda.py against the real libcuda: devices, memory, a hand-written PTX kernel, graphs.

Without libcuda (or without a CUDA device) the device tests skip and say why; the loader's
missing-library error, the kernel-parameter packing and the PTX fixtures (via ptxas, when
installed) are checked everywhere. On a GPU machine: python -m pytest tests/test_drivers_cuda.py
"""

import ctypes
import shutil
import subprocess
import sys
import threading

import numpy as np
import pytest

import cffi

from drivers import DriverError, LibraryNotFound, address, cuda, held_functions

# y[i] = a * x[i] + b for i < n; rounded after the multiply and after the add, as numpy does.
AFFINE_PTX = """\
.version 7.0
.target sm_80
.address_size 64

.visible .entry affine(
    .param .u64 param_y,
    .param .u64 param_x,
    .param .f32 param_a,
    .param .f32 param_b,
    .param .u32 param_n
)
{
    .reg .pred %p<2>;
    .reg .b32 %r<6>;
    .reg .f32 %f<6>;
    .reg .b64 %rd<8>;

    ld.param.u64 %rd1, [param_y];
    ld.param.u64 %rd2, [param_x];
    ld.param.f32 %f1, [param_a];
    ld.param.f32 %f2, [param_b];
    ld.param.u32 %r1, [param_n];
    mov.u32 %r2, %ctaid.x;
    mov.u32 %r3, %ntid.x;
    mov.u32 %r4, %tid.x;
    mad.lo.u32 %r5, %r2, %r3, %r4;
    setp.ge.u32 %p1, %r5, %r1;
    @%p1 bra DONE;
    cvta.to.global.u64 %rd3, %rd2;
    cvta.to.global.u64 %rd4, %rd1;
    mul.wide.u32 %rd5, %r5, 4;
    add.s64 %rd6, %rd3, %rd5;
    ld.global.f32 %f3, [%rd6];
    mul.rn.f32 %f4, %f3, %f1;
    add.rn.f32 %f5, %f4, %f2;
    add.s64 %rd7, %rd4, %rd5;
    st.global.f32 [%rd7], %f5;
DONE:
    ret;
}
"""
# The same kernel loading through a register it never declared.
BROKEN_PTX = AFFINE_PTX.replace("ld.global.f32 %f3, [%rd6];", "ld.global.f32 %f3, [%rd9];")
BROKEN_LINE = 1 + BROKEN_PTX.splitlines().index("    ld.global.f32 %f3, [%rd9];")

POISON = 0xFFC00001  # a NaN bit pattern no kernel result equals
BLOCK = 256


def _ptxas(tmp_path, text):
    ptxas = shutil.which("ptxas")
    if ptxas is None:
        pytest.skip("ptxas is not installed")
    source = tmp_path / "kernel.ptx"
    source.write_text(text)
    return subprocess.run([ptxas, "-arch=sm_90", "-v", str(source), "-o", str(tmp_path / "k.o")],
                          capture_output=True, text=True, timeout=60)


def test_affine_ptx_assembles_for_sm_90(tmp_path):
    run = _ptxas(tmp_path, AFFINE_PTX)
    assert run.returncode == 0, run.stderr
    assert "Compiling entry function 'affine' for 'sm_90'" in run.stdout + run.stderr


def test_broken_ptx_is_rejected_by_ptxas_at_its_line(tmp_path):
    run = _ptxas(tmp_path, BROKEN_PTX)
    assert run.returncode != 0
    assert f"line {BROKEN_LINE}; error" in run.stderr and "'%rd9'" in run.stderr


def test_missing_library_names_the_path(monkeypatch):
    monkeypatch.setenv(cuda.ENV_VAR, "/nonexistent/libcuda.so.1")
    with pytest.raises(LibraryNotFound) as caught:
        cuda.Driver()
    assert "/nonexistent/libcuda.so.1" in str(caught.value)


def test_kernel_params_hold_typed_values():
    params = cuda.KernelParams(("CUdeviceptr", 2**40 + 8), ("float", 1.5), ("uint32_t", 7),
                               ("int64_t", -3))
    types = ["CUdeviceptr *", "float *", "uint32_t *", "int64_t *"]
    assert [cuda.ffi.cast(t, params.array[i])[0] for i, t in enumerate(types)] == \
        [2**40 + 8, 1.5, 7, -3]
    assert cuda.KernelParams().array == cuda.ffi.NULL


def test_a_call_holding_the_lock_gives_the_same_results_and_keeps_other_threads_waiting():
    """drivers.held_functions, as the launches use it, on the C library: the results of the
    plain cffi call; while the call runs (a 0.2 s sleep) no other Python thread runs, where
    the plain call lets one count all the while; and a ctypes signature that disagrees with
    the cffi declaration is refused."""
    ffi = cffi.FFI()
    ffi.cdef("size_t strlen(const char *s); int usleep(unsigned int usec);")
    libc = ffi.dlopen(None)
    held = held_functions(ffi, libc, {"strlen": (ctypes.c_size_t, ctypes.c_void_p),
                                      "usleep": (ctypes.c_int, ctypes.c_uint)})
    text = ffi.new("char[]", b"kernel parameters")
    assert held.strlen(address(ffi, text)) == libc.strlen(text) == 17
    for wrong in [(ctypes.c_size_t, ctypes.c_uint32), (ctypes.c_size_t,),
                  (ctypes.c_size_t, ctypes.c_void_p, ctypes.c_void_p)]:
        with pytest.raises(TypeError, match="strlen"):
            held_functions(ffi, libc, {"strlen": wrong})
    counted, stop = [0], threading.Event()

    def count():
        while not stop.is_set():
            counted[0] += 1
    interval = sys.getswitchinterval()
    sys.setswitchinterval(0.001)        # the counter's slices beside the call: 1 ms, not 5
    counter = threading.Thread(target=count)
    counter.start()
    try:
        counts = []
        for sleep in (libc.usleep, held.usleep):
            before = counted[0]
            sleep(200_000)
            counts.append(counted[0] - before)
    finally:
        stop.set()
        counter.join()
        sys.setswitchinterval(interval)
    released, held_count = counts
    assert released > 1000 and held_count < released / 10, counts


@pytest.fixture(scope="module")
def cu():
    try:
        driver = cuda.Driver()
    except LibraryNotFound as error:
        pytest.skip(f"libcuda not found (tried {', '.join(path for path, _ in error.tried)})")
    driver.init()
    if driver.device_get_count() == 0:
        pytest.skip("libcuda found no CUDA device")
    device = driver.device_get(0)
    driver.ctx_set_current(driver.device_primary_ctx_retain(device))
    yield driver
    driver.ctx_synchronize()
    driver.device_primary_ctx_release(device)


@pytest.fixture(scope="module")
def device(cu):
    return cu.device_get(0)


@pytest.fixture(scope="module")
def affine(cu):
    module, _ = cu.module_load_data(AFFINE_PTX)
    yield cu.module_get_function(module, "affine")
    cu.module_unload(module)


class DeviceArray:
    """A device allocation freed at exit (test bookkeeping, not part of the binding)."""

    def __init__(self, cu, size):
        self.cu, self.size, self.pointer = cu, size, cu.mem_alloc(size)

    def __enter__(self):
        return self.pointer

    def __exit__(self, *exc):
        self.cu.mem_free(self.pointer)


def _affine_params(y, x, a, b, n):
    return cuda.KernelParams(("CUdeviceptr", y), ("CUdeviceptr", x), ("float", a), ("float", b),
                             ("uint32_t", n))


def test_driver_version_and_current_context(cu):
    assert cu.driver_get_version() >= 11040  # cuGraphInstantiateWithFlags arrived in 11.4
    assert cu.ctx_get_current() != cuda.ffi.NULL


def test_device_attributes_are_sane(cu, device):
    def attribute(name):
        return cu.device_get_attribute(getattr(cuda, "CU_DEVICE_ATTRIBUTE_" + name), device)

    assert cu.device_get_name(device)
    assert attribute("COMPUTE_CAPABILITY_MAJOR") >= 5
    assert 0 <= attribute("COMPUTE_CAPABILITY_MINOR") <= 9
    assert attribute("MULTIPROCESSOR_COUNT") > 0
    assert attribute("WARP_SIZE") == 32
    assert attribute("MAX_THREADS_PER_BLOCK") == 1024
    assert attribute("MAX_SHARED_MEMORY_PER_BLOCK") == 48 * 1024
    assert attribute("MAX_SHARED_MEMORY_PER_BLOCK_OPTIN") >= 48 * 1024
    assert attribute("L2_CACHE_SIZE") > 0
    assert attribute("UNIFIED_ADDRESSING") == 1
    assert attribute("GLOBAL_MEMORY_BUS_WIDTH") >= 0 and attribute("MEMORY_CLOCK_RATE") >= 0


def test_memory_info(cu, device):
    free, total = cu.mem_get_info()
    assert 0 < free <= total
    assert total <= cu.device_total_mem(device)


def test_round_trip_of_random_bytes(cu):
    data = np.random.default_rng(1).integers(0, 256, 1 << 20, dtype=np.uint8)
    back = np.full_like(data, 0xAB)
    with DeviceArray(cu, data.nbytes) as first, DeviceArray(cu, data.nbytes) as second:
        cu.memcpy_htod(first, data, data.nbytes)
        cu.memcpy_dtod(second, first, data.nbytes)
        cu.memcpy_dtoh(back, second, data.nbytes)
        np.testing.assert_array_equal(back, data)

        cu.memset_d8(first, 0x5A, data.nbytes)
        cu.memset_d32(second + 4, 0x01020304, 2)
        cu.memcpy_dtoh(back, first, 16)
        assert bytes(back[:16]) == b"\x5a" * 16
        words = np.zeros(4, np.uint32)
        cu.memcpy_dtoh(words, second, words.nbytes)
        assert words[1] == words[2] == 0x01020304


def test_async_copies_through_pinned_memory(cu):
    size = 1 << 16
    pinned = cu.mem_alloc_host(2 * size)
    view = np.frombuffer(cuda.ffi.buffer(pinned, 2 * size), np.uint8)
    stream = cu.stream_create()
    try:
        view[:size] = np.random.default_rng(2).integers(0, 256, size, dtype=np.uint8)
        view[size:] = 0
        with DeviceArray(cu, size) as first, DeviceArray(cu, size) as second:
            cu.memset_d32_async(first, POISON, size // 4, stream)
            cu.memcpy_htod_async(first, pinned, size, stream)
            cu.memset_d8_async(second, 0, size, stream)
            cu.memcpy_dtod_async(second, first, size, stream)
            cu.memcpy_dtoh_async(int(cuda.ffi.cast("uintptr_t", pinned)) + size, second, size,
                                 stream)
            cu.stream_synchronize(stream)
        np.testing.assert_array_equal(view[size:], view[:size])
    finally:
        cu.stream_destroy(stream)
        cu.mem_free_host(pinned)


def test_affine_kernel_matches_numpy(cu, affine):
    assert cu.func_get_attribute(cuda.CU_FUNC_ATTRIBUTE_NUM_REGS, affine) > 0
    assert cu.func_get_attribute(cuda.CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK, affine) >= BLOCK
    assert cu.func_get_attribute(cuda.CU_FUNC_ATTRIBUTE_PTX_VERSION, affine) == 80  # .target
    cu.func_set_attribute(affine, cuda.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, 64 * 1024)
    assert cu.func_get_attribute(cuda.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                                 affine) == 64 * 1024

    n, pad = 100_003, 61  # n not a multiple of the block; the pad must stay poisoned
    x = np.random.default_rng(3).standard_normal(n).astype(np.float32)
    a, b = np.float32(1.75), np.float32(-0.5)
    y = np.zeros(n + pad, np.float32)
    with DeviceArray(cu, 4 * (n + pad)) as dy, DeviceArray(cu, x.nbytes) as dx:
        cu.memcpy_htod(dx, x, x.nbytes)
        cu.memset_d32(dy, POISON, n + pad)
        cu.launch_kernel(affine, (n + BLOCK - 1) // BLOCK, BLOCK, _affine_params(dy, dx, a, b, n))
        cu.ctx_synchronize()
        cu.memcpy_dtoh(y, dy, y.nbytes)
    np.testing.assert_array_equal(y[:n], a * x + b)
    assert (y[n:].view(np.uint32) == POISON).all()


def test_broken_ptx_raises_with_the_jit_log(cu):
    with pytest.raises(DriverError) as caught:
        cu.module_load_data(BROKEN_PTX)
    error = caught.value
    assert (error.library, error.call) == ("libcuda", "cuModuleLoadDataEx")
    assert error.name == "CUDA_ERROR_INVALID_PTX"
    message = str(error)
    assert f"line {BROKEN_LINE}; error" in message and "Unknown symbol '%rd9'" in message


def test_events_time_a_kernel(cu, affine):
    n = 1 << 24
    start, end = cu.event_create(), cu.event_create()
    try:
        with DeviceArray(cu, 4 * n) as dy, DeviceArray(cu, 4 * n) as dx:
            cu.memset_d32(dx, 0, n)
            params = _affine_params(dy, dx, 2.0, 1.0, n)
            cu.event_record(start)
            for _ in range(10):
                cu.launch_kernel(affine, n // BLOCK, BLOCK, params)
            cu.event_record(end)
            cu.event_synchronize(end)
            milliseconds = cu.event_elapsed_time(start, end)
    finally:
        cu.event_destroy(start)
        cu.event_destroy(end)
    # Ten passes over 2 x 64 MiB cannot take under ~0.1 ms at any memory speed, nor a second.
    assert 0.1 < milliseconds < 1000.0


def test_captured_graph_replays_with_new_inputs(cu, affine):
    n = 4096
    stream = cu.stream_create(cuda.CU_STREAM_NON_BLOCKING)
    host_x, host_y = cu.mem_alloc_host(4 * n), cu.mem_alloc_host(4 * n)
    x = np.frombuffer(cuda.ffi.buffer(host_x, 4 * n), np.float32)
    y = np.frombuffer(cuda.ffi.buffer(host_y, 4 * n), np.float32)
    a, b = np.float32(3.0), np.float32(0.25)
    try:
        with DeviceArray(cu, 4 * n) as dy, DeviceArray(cu, 4 * n) as dx:
            cu.stream_begin_capture(stream)
            cu.memcpy_htod_async(dx, host_x, 4 * n, stream)
            cu.memset_d32_async(dy, POISON, n, stream)
            cu.launch_kernel(affine, n // BLOCK, BLOCK, _affine_params(dy, dx, a, b, n),
                             stream=stream)
            cu.memcpy_dtoh_async(host_y, dy, 4 * n, stream)
            graph = cu.stream_end_capture(stream)
            executable = cu.graph_instantiate(graph)
            try:
                for seed in (4, 5):
                    x[:] = np.random.default_rng(seed).standard_normal(n).astype(np.float32)
                    y.view(np.uint32)[:] = POISON
                    cu.graph_launch(executable, stream)
                    cu.stream_synchronize(stream)
                    np.testing.assert_array_equal(y, a * x + b)
            finally:
                cu.graph_exec_destroy(executable)
                cu.graph_destroy(graph)
    finally:
        cu.mem_free_host(host_x)
        cu.mem_free_host(host_y)
        cu.stream_destroy(stream)


# The affine kernel for sm_90, ready to be launched programmatically: it waits for the kernel
# before it at its start and lets the next one launch at its end.
AFFINE_SM90_PTX = (AFFINE_PTX.replace(".version 7.0\n.target sm_80", ".version 7.8\n.target sm_90")
                   .replace("    ld.param.u64 %rd1", "    griddepcontrol.wait;\n    ld.param.u64 %rd1")
                   .replace("DONE:\n    ret;", "DONE:\n    griddepcontrol.launch_dependents;\n    ret;"))


def test_programmatic_launches_chain_in_order(cu, device):
    """Dependent kernels launched with programmatic stream serialisation, directly and captured
    into a graph, each reading what the one before wrote: y <- 3y + 0.25, eight times in place."""
    major = cu.device_get_attribute(cuda.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, device)
    if major < 9:
        pytest.skip(f"programmatic launches need sm_90; device 0 is sm_{major}x")
    module, _ = cu.module_load_data(AFFINE_SM90_PTX)
    affine = cu.module_get_function(module, "affine")
    n, times = 1 << 20, 8
    a, b = np.float32(3.0), np.float32(0.25)
    x = np.random.default_rng(6).uniform(-1, 1, n).astype(np.float32)
    want = x.copy()
    for _ in range(times):
        want = a * want + b
    stream = cu.stream_create(cuda.CU_STREAM_NON_BLOCKING)
    try:
        with DeviceArray(cu, 4 * n) as dy:
            def chain():
                cu.memcpy_htod_async(dy, x, 4 * n, stream)
                for _ in range(times):
                    cu.launch_kernel_programmatic(affine, n // BLOCK, BLOCK,
                                                  _affine_params(dy, dy, a, b, n), stream=stream)
            chain()
            got = np.empty(n, np.float32)
            cu.memcpy_dtoh_async(got, dy, 4 * n, stream)
            cu.stream_synchronize(stream)
            np.testing.assert_array_equal(got, want)
            cu.stream_begin_capture(stream)
            chain()
            graph = cu.stream_end_capture(stream)
            executable = cu.graph_instantiate(graph)
            try:
                cu.memset_d32_async(dy, POISON, n, stream)
                cu.graph_launch(executable, stream)
                got[:] = 0
                cu.memcpy_dtoh_async(got, dy, 4 * n, stream)
                cu.stream_synchronize(stream)
                np.testing.assert_array_equal(got, want)
            finally:
                cu.graph_exec_destroy(executable)
                cu.graph_destroy(graph)
    finally:
        cu.stream_destroy(stream)
        cu.module_unload(module)


def test_programmatic_affine_assembles_for_sm_90(tmp_path):
    run = _ptxas(tmp_path, AFFINE_SM90_PTX)
    assert run.returncode == 0, run.stderr


def test_peer_copy_between_two_devices(cu, device):
    if cu.device_get_count() < 2:
        pytest.skip("peer access needs two CUDA devices; this machine has one")
    first, second = device, cu.device_get(1)
    if not cu.device_can_access_peer(first, second):
        pytest.skip("devices 0 and 1 cannot access each other's memory")
    assert cu.device_can_access_peer(second, first)
    context, peer_context = cu.ctx_get_current(), cu.device_primary_ctx_retain(second)
    data = np.arange(1 << 18, dtype=np.uint32)
    back = np.zeros_like(data)
    try:
        cu.ctx_set_current(peer_context)
        peer_buffer = cu.mem_alloc(data.nbytes)
        cu.ctx_set_current(context)
        try:
            cu.ctx_enable_peer_access(peer_context)
        except DriverError as error:
            if error.name != "CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED":
                raise
        with DeviceArray(cu, data.nbytes) as local:
            cu.memcpy_htod(local, data, data.nbytes)
            cu.memcpy_peer_async(peer_buffer, peer_context, local, context, data.nbytes)
            cu.ctx_synchronize()
            cu.memset_d32(local, 0, data.size)
            cu.memcpy_peer_async(local, context, peer_buffer, peer_context, data.nbytes)
            cu.ctx_synchronize()
            cu.memcpy_dtoh(back, local, data.nbytes)
        np.testing.assert_array_equal(back, data)
        cu.ctx_set_current(peer_context)
        cu.mem_free(peer_buffer)
    finally:
        cu.ctx_set_current(context)
        cu.device_primary_ctx_release(second)
