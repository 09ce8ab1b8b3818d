"""drivers/hsa.py against the real libhsa-runtime64.

Everywhere: the loader's missing-library error, status strings before hsa_init, the AQL packet
layouts and header bits, and (without /dev/kfd) hsa_init's failure in the runtime's own words. On
a machine with an AMD GPU: agents, pools, memory, signals, and a comgr-built OpenCL kernel
dispatched through an AQL queue, followed by a barrier-AND packet, checked against numpy.
"""

import os
import struct

import numpy as np
import pytest

from drivers import DriverError, LibraryNotFound, comgr, hsa
from tests.test_drivers_comgr import AFFINE_CL, AFFINE_LDS_BYTES, build_opencl, kernel_metadata

ffi = hsa.ffi
POISON = 0xFFC00001  # a NaN bit pattern no kernel result equals


@pytest.fixture(scope="module")
def rt():
    try:
        return hsa.Runtime()
    except LibraryNotFound as error:
        pytest.skip(f"libhsa-runtime64 not found (tried {', '.join(p for p, _ in error.tried)})")


def test_missing_library_names_the_path(monkeypatch):
    monkeypatch.setenv(hsa.ENV_VAR, "/nonexistent/libhsa-runtime64.so.1")
    with pytest.raises(LibraryNotFound) as caught:
        hsa.Runtime()
    assert "/nonexistent/libhsa-runtime64.so.1" in str(caught.value)


def test_status_string_answers_before_init(rt):
    text = rt.status_string(hsa.HSA_STATUS_ERROR_OUT_OF_RESOURCES)
    assert text.startswith("HSA_STATUS_ERROR_OUT_OF_RESOURCES: The runtime failed to allocate")
    assert rt.status_string(hsa.HSA_STATUS_ERROR_INVALID_MEMORY_POOL).startswith(
        "HSA_STATUS_ERROR_INVALID_MEMORY_POOL")


@pytest.mark.skipif(os.path.exists("/dev/kfd"), reason="/dev/kfd exists: hsa_init can succeed")
def test_init_without_kfd_raises_the_runtime_text(rt):
    with pytest.raises(DriverError) as caught:
        rt.init()
    error = caught.value
    assert (error.library, error.call) == ("libhsa-runtime64", "hsa_init")
    assert error.code == hsa.HSA_STATUS_ERROR_OUT_OF_RESOURCES
    assert error.name == "HSA_STATUS_ERROR_OUT_OF_RESOURCES"
    runtime_text = rt.status_string(error.code).partition(": ")[2]
    assert error.text.startswith(runtime_text)
    assert "/dev/kfd" in str(error)


def test_packet_layouts_match_hsa_h():
    def offsets(ctype):
        return {name: ffi.offsetof(ctype, name) for name, _ in ffi.typeof(ctype).fields}

    assert ffi.sizeof("hsa_kernel_dispatch_packet_t") == 64
    assert offsets("hsa_kernel_dispatch_packet_t") == {
        "header": 0, "setup": 2, "workgroup_size_x": 4, "workgroup_size_y": 6,
        "workgroup_size_z": 8, "reserved0": 10, "grid_size_x": 12, "grid_size_y": 16,
        "grid_size_z": 20, "private_segment_size": 24, "group_segment_size": 28,
        "kernel_object": 32, "kernarg_address": 40, "reserved2": 48, "completion_signal": 56}
    assert ffi.sizeof("hsa_barrier_and_packet_t") == 64
    assert offsets("hsa_barrier_and_packet_t") == {
        "header": 0, "reserved0": 2, "reserved1": 4, "dep_signal": 8, "reserved2": 48,
        "completion_signal": 56}
    assert ffi.sizeof("hsa_queue_t") == 40
    assert offsets("hsa_queue_t")["base_address"] == 8
    assert offsets("hsa_queue_t")["doorbell_signal"] == 16
    assert offsets("hsa_queue_t")["size"] == 24


def test_packet_header_bits():
    assert hsa.packet_header(hsa.HSA_PACKET_TYPE_KERNEL_DISPATCH) == 2 | 2 << 9 | 2 << 11
    assert hsa.packet_header(hsa.HSA_PACKET_TYPE_BARRIER_AND, barrier=True,
                             acquire=hsa.HSA_FENCE_SCOPE_AGENT,
                             release=hsa.HSA_FENCE_SCOPE_NONE) == 3 | 1 << 8 | 1 << 9


def test_queue_slot_wraps_and_publish_writes_header_last_word():
    ring = ffi.new("char[]", 64 * 4)
    queue = ffi.new("hsa_queue_t *", {"base_address": ring, "size": 4})
    slot = hsa.queue_slot(queue, 5)
    assert int(ffi.cast("uintptr_t", slot)) == int(ffi.cast("uintptr_t", ring)) + 64
    slot.kernel_object = 0x1234
    hsa.publish_packet(slot, hsa.packet_header(hsa.HSA_PACKET_TYPE_KERNEL_DISPATCH), setup=1)
    assert struct.unpack_from("<HH", ffi.buffer(ring, 64 * 4), 64) == (0x1402, 1)
    assert hsa.queue_slot(queue, 5, "hsa_barrier_and_packet_t").completion_signal.handle == 0


# On an AMD GPU.

@pytest.fixture(scope="module")
def gpu(rt):
    try:
        rt.init()
    except DriverError as error:
        pytest.skip(f"no HSA runtime on this machine: {error}")
    agents = rt.agents()
    kinds = [rt.agent_get_info(agent, hsa.HSA_AGENT_INFO_DEVICE) for agent in agents]
    gpus = [agent for agent, kind in zip(agents, kinds) if kind == hsa.HSA_DEVICE_TYPE_GPU]
    cpus = [agent for agent, kind in zip(agents, kinds) if kind == hsa.HSA_DEVICE_TYPE_CPU]
    if not gpus:
        rt.shut_down()
        pytest.skip("the HSA runtime found no GPU agent")
    yield gpus[0], cpus[0]
    rt.shut_down()


def _pool(rt, agent, flag):
    """The first global pool of the agent with `flag` set that the runtime may allocate from."""
    def info(pool, attribute):
        return rt.memory_pool_get_info(pool, getattr(hsa, "HSA_AMD_MEMORY_POOL_INFO_" + attribute))

    for pool in rt.memory_pools(agent):
        if (info(pool, "SEGMENT") == hsa.HSA_AMD_SEGMENT_GLOBAL
                and info(pool, "GLOBAL_FLAGS") & flag and info(pool, "RUNTIME_ALLOC_ALLOWED")):
            return pool
    pytest.fail(f"agent has no allocatable global pool with flag {flag}")


def _isa_name(rt, agent):
    [isa] = rt.agent_isas(agent)
    return rt.isa_name(isa)


def test_agent_properties(rt, gpu):
    agent, _ = gpu
    assert rt.agent_get_info(agent, hsa.HSA_AGENT_INFO_NAME).startswith("gfx")
    assert _isa_name(rt, agent).startswith("amdgcn-amd-amdhsa--gfx")
    assert rt.agent_get_info(agent, hsa.HSA_AMD_AGENT_INFO_COMPUTE_UNIT_COUNT) > 0
    assert rt.agent_get_info(agent, hsa.HSA_AGENT_INFO_WAVEFRONT_SIZE) in (32, 64)
    assert rt.agent_get_info(agent, hsa.HSA_AGENT_INFO_WORKGROUP_MAX_SIZE) >= 256
    assert rt.agent_get_info(agent, hsa.HSA_AGENT_INFO_QUEUE_MAX_SIZE) >= 64
    groups = [p for p in rt.memory_pools(agent)
              if rt.memory_pool_get_info(p, hsa.HSA_AMD_MEMORY_POOL_INFO_SEGMENT)
              == hsa.HSA_AMD_SEGMENT_GROUP]
    assert rt.memory_pool_get_info(groups[0], hsa.HSA_AMD_MEMORY_POOL_INFO_SIZE) >= 32 * 1024  # LDS


def test_memory_pools_and_available_memory(rt, gpu):
    agent, _ = gpu
    pool = _pool(rt, agent, hsa.HSA_AMD_MEMORY_POOL_GLOBAL_FLAG_COARSE_GRAINED)
    size = rt.memory_pool_get_info(pool, hsa.HSA_AMD_MEMORY_POOL_INFO_SIZE)
    assert size > 0
    assert rt.memory_pool_get_info(pool, hsa.HSA_AMD_MEMORY_POOL_INFO_RUNTIME_ALLOC_GRANULE) > 0
    try:
        available = rt.agent_get_info(agent, hsa.HSA_AMD_AGENT_INFO_MEMORY_AVAIL)
    except DriverError as error:  # runtimes before ROCm 5.7 do not know the attribute
        assert error.name == "HSA_STATUS_ERROR_INVALID_ARGUMENT"
    else:
        assert 0 < available <= size


def test_signals(rt, gpu):
    signal = rt.signal_create(3)
    try:
        assert rt.signal_load(signal) == 3
        rt.signal_store(signal, 0)
        assert rt.signal_wait(signal, hsa.HSA_SIGNAL_CONDITION_EQ, 0, timeout_hint=10**9) == 0
    finally:
        rt.signal_destroy(signal)


def test_copies_between_host_and_device(rt, gpu):
    agent, cpu = gpu
    data = np.random.default_rng(1).integers(0, 2**32, 1 << 16, dtype=np.uint32)
    host = rt.memory_pool_allocate(_pool(rt, cpu, hsa.HSA_AMD_MEMORY_POOL_GLOBAL_FLAG_FINE_GRAINED),
                                   data.nbytes)
    device = rt.memory_pool_allocate(
        _pool(rt, agent, hsa.HSA_AMD_MEMORY_POOL_GLOBAL_FLAG_COARSE_GRAINED), data.nbytes)
    done = rt.signal_create(1)
    try:
        rt.agents_allow_access([agent], host)
        ffi.memmove(ffi.cast("void *", host), data.tobytes(), data.nbytes)
        rt.memory_copy(device, host, data.nbytes)
        ffi.memmove(ffi.cast("void *", host), b"\0" * data.nbytes, data.nbytes)
        rt.memory_async_copy(host, cpu, device, agent, data.nbytes, done)
        assert rt.signal_wait(done, hsa.HSA_SIGNAL_CONDITION_EQ, 0, timeout_hint=10**10) == 0
        back = np.frombuffer(ffi.buffer(ffi.cast("void *", host), data.nbytes), np.uint32)
        np.testing.assert_array_equal(back, data)
    finally:
        rt.signal_destroy(done)
        rt.memory_pool_free(device)
        rt.memory_pool_free(host)


def test_dispatch_of_a_comgr_kernel_matches_numpy(rt, gpu):
    agent, cpu = gpu
    isa = _isa_name(rt, agent).removeprefix("amdgcn-amd-amdhsa--")
    cg = comgr.Comgr()
    image = build_opencl(cg, isa, AFFINE_CL, "affine.cl")
    [meta] = kernel_metadata(cg, image)

    reader = rt.code_object_reader_create_from_memory(image)
    executable = rt.executable_create(rt.agent_get_info(agent, hsa.HSA_AGENT_INFO_PROFILE))
    rt.executable_load_agent_code_object(executable, agent, reader)
    rt.executable_freeze(executable)
    symbol = rt.executable_get_symbol_by_name(executable, meta[".symbol"], agent)
    def symbol_info(attribute):
        return rt.executable_symbol_get_info(
            symbol, getattr(hsa, "HSA_EXECUTABLE_SYMBOL_INFO_KERNEL_" + attribute))

    kernel_object, kernarg_size = symbol_info("OBJECT"), symbol_info("KERNARG_SEGMENT_SIZE")
    group_size = symbol_info("GROUP_SEGMENT_SIZE")
    private_size = symbol_info("PRIVATE_SEGMENT_SIZE")
    assert kernarg_size == int(meta[".kernarg_segment_size"])
    assert group_size == AFFINE_LDS_BYTES

    n, pad, workgroup = 10_007, 64, 64  # the kernel's __local tile holds one 64-wide group
    x = np.random.default_rng(2).standard_normal(n).astype(np.float32)
    a, b = np.float32(1.75), np.float32(-0.5)
    fine = _pool(rt, cpu, hsa.HSA_AMD_MEMORY_POOL_GLOBAL_FLAG_FINE_GRAINED)
    kernarg_pool = _pool(rt, cpu, hsa.HSA_AMD_MEMORY_POOL_GLOBAL_FLAG_KERNARG_INIT)
    x_address = rt.memory_pool_allocate(fine, x.nbytes)
    y_address = rt.memory_pool_allocate(fine, 4 * (n + pad))
    kernargs = rt.memory_pool_allocate(kernarg_pool, kernarg_size)
    queue = rt.queue_create(agent, 64)
    done, barrier_done = rt.signal_create(1), rt.signal_create(1)
    try:
        for address in (x_address, y_address, kernargs):
            rt.agents_allow_access([agent], address)
        ffi.memmove(ffi.cast("void *", x_address), x.tobytes(), x.nbytes)
        y = np.frombuffer(ffi.buffer(ffi.cast("void *", y_address), 4 * (n + pad)), np.float32)
        y.view(np.uint32)[:] = POISON
        # Explicit arguments y, x, a, b, n; the hidden ones (global offsets, ...) stay zero.
        args = struct.pack("<QQffI", y_address, x_address, a, b, n)
        ffi.memmove(ffi.cast("void *", kernargs), args.ljust(kernarg_size, b"\0"), kernarg_size)

        rt.profiling_set_profiler_enabled(queue, True)
        index = rt.queue_add_write_index(queue, 1)
        packet = hsa.queue_slot(queue, index)
        packet.workgroup_size_x, packet.workgroup_size_y, packet.workgroup_size_z = workgroup, 1, 1
        packet.grid_size_x = (n + workgroup - 1) // workgroup * workgroup
        packet.grid_size_y = packet.grid_size_z = 1
        packet.private_segment_size, packet.group_segment_size = private_size, group_size
        packet.kernel_object = kernel_object
        packet.kernarg_address = ffi.cast("void *", kernargs)
        packet.completion_signal = done
        hsa.publish_packet(packet, hsa.packet_header(hsa.HSA_PACKET_TYPE_KERNEL_DISPATCH),
                           setup=1 << hsa.HSA_KERNEL_DISPATCH_PACKET_SETUP_DIMENSIONS)
        rt.ring_doorbell(queue, index)

        index = rt.queue_add_write_index(queue, 1)
        barrier = hsa.queue_slot(queue, index, "hsa_barrier_and_packet_t")
        barrier.dep_signal[0] = done
        barrier.completion_signal = barrier_done
        hsa.publish_packet(barrier, hsa.packet_header(hsa.HSA_PACKET_TYPE_BARRIER_AND, True))
        rt.ring_doorbell(queue, index)

        assert rt.signal_wait(barrier_done, hsa.HSA_SIGNAL_CONDITION_EQ, 0,
                              timeout_hint=10**10) == 0
        assert rt.signal_load(done) == 0
        # OpenCL may contract a * x + b into one fma: one rounding instead of numpy's two.
        np.testing.assert_allclose(y[:n], a * x + b, rtol=1e-6, atol=1e-6)
        assert (y[n:].view(np.uint32) == POISON).all()
        start, end = rt.profiling_get_dispatch_time(agent, done)
        assert 0 < start <= end
    finally:
        rt.signal_destroy(done)
        rt.signal_destroy(barrier_done)
        rt.queue_destroy(queue)
        for address in (kernargs, y_address, x_address):
            rt.memory_pool_free(address)
        rt.executable_destroy(executable)
        rt.code_object_reader_destroy(reader)
