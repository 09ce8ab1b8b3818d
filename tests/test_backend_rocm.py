"""poot/backends/rocm.py: the ROCm Device.

Everywhere: opening without an AMD GPU fails with the runtime's own words and what the host
lacks (`poot generate --backend rocm` exits 3 with that one line); the kernel-argument segment
and the dispatch packet are laid out as the code object's metadata and hsa.h say. On a machine
with an AMD GPU (/dev/kfd and a GPU agent): the device opens, moves memory both ways in order
with launches, replays a captured step and times launches; tests/test_kernels.py and
tests/test_device_runner.py then run every kernel and the runner on it with the "rocm" param:

    python -m pytest tests/test_kernels.py tests/test_device_runner.py tests/test_backend_rocm.py -k rocm
"""
import os
import struct
import subprocess
import sys

import numpy as np
import pytest

from drivers import LibraryNotFound, hsa
from poot.backends.rocm import (DeviceBuffer, Program, RocmDevice, dispatch_packet,
                                kernel_arguments)
from poot.codegen.amdgpu import CodeObject, KernelArg, build_code_object
from poot.errors import BackendUnavailable
from poot.kernels import choice, ops
from poot.kernels.lang import F32, I32, KernelBuilder
from tests.models import tiny_model

HAS_KFD = os.path.exists("/dev/kfd")


def runtime_text(status):
    try:
        return hsa.Runtime().status_string(status).partition(": ")[2]
    except LibraryNotFound as error:
        pytest.skip(f"libhsa-runtime64 not found (tried {', '.join(p for p, _ in error.tried)})")


@pytest.mark.skipif(HAS_KFD, reason="/dev/kfd exists: the runtime may open here")
def test_open_without_kfd_says_the_runtime_reason_and_what_is_missing():
    text = runtime_text(hsa.HSA_STATUS_ERROR_OUT_OF_RESOURCES)
    with pytest.raises(BackendUnavailable) as caught:
        RocmDevice()
    message = str(caught.value)
    assert message.startswith("rocm: hsa_init failed: HSA_STATUS_ERROR_OUT_OF_RESOURCES")
    assert text in message
    assert "/dev/kfd" in message and "\n" not in message


@pytest.mark.skipif(HAS_KFD, reason="/dev/kfd exists: the runtime may open here")
def test_cli_exits_3_with_the_one_line_reason(tmp_path):
    text = runtime_text(hsa.HSA_STATUS_ERROR_OUT_OF_RESOURCES)
    result = subprocess.run([sys.executable, "-m", "poot", "generate", "--model",
                             str(tiny_model(tmp_path)), "--prompt", "x", "--backend", "rocm"],
                            capture_output=True, text=True, timeout=120,
                            cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert result.returncode == 3, result.stderr
    assert result.stderr.count("\n") == 1
    assert "rocm: hsa_init failed" in result.stderr and text in result.stderr
    assert "/dev/kfd" in result.stderr


def test_missing_runtime_library_is_backend_unavailable(monkeypatch):
    monkeypatch.setenv(hsa.ENV_VAR, "/nonexistent/libhsa-runtime64.so.1")
    with pytest.raises(BackendUnavailable, match="rocm: .*/nonexistent/libhsa-runtime64.so.1"):
        RocmDevice()


def scale_kernel():
    k = KernelBuilder("scale", (64,))
    x, y = k.buffer("x", F32), k.buffer("y", F32, "w")
    a, n = k.scalar("a", F32), k.scalar("n", I32)
    i = k.block_id() * 64 + k.thread_id()
    with k.if_(i < n):
        y[i] = x[i] * a
    return k.build()


def test_kernel_arguments_follow_the_metadata():
    kernel = ops.elementwise("add")                 # a, b, out, n, n_b
    try:
        code = build_code_object(kernel, "gfx90a", 64)
    except LibraryNotFound as error:
        pytest.skip(f"libamd_comgr not found (tried {', '.join(p for p, _ in error.tried)})")
    bufs = [DeviceBuffer(0x7F0000001000 * (j + 1), 64) for j in range(3)]
    data = kernel_arguments(code, kernel, (5, 1, 1), bufs + [1000, 300])
    assert len(data) == code.kernarg_size
    assert struct.unpack_from("<QQQii", data) == (*(b.pointer for b in bufs), 1000, 300)


def test_hidden_arguments_of_code_object_v5_are_filled():
    kernel = scale_kernel()
    hidden = [KernelArg(24, 4, "hidden_block_count_x"), KernelArg(28, 4, "hidden_block_count_y"),
              KernelArg(32, 4, "hidden_block_count_z"), KernelArg(36, 2, "hidden_group_size_x"),
              KernelArg(38, 2, "hidden_group_size_y"), KernelArg(40, 2, "hidden_group_size_z"),
              KernelArg(42, 2, "hidden_remainder_x"), KernelArg(64, 2, "hidden_grid_dims"),
              KernelArg(72, 8, "hidden_global_offset_x")]
    args = (KernelArg(0, 8, "global_buffer"), KernelArg(8, 8, "global_buffer"),
            KernelArg(16, 4, "by_value"), KernelArg(20, 4, "by_value"), *hidden)
    code = CodeObject(b"", "gfx90a", "scale.kd", 80, 8, 0, 0, 64, args)
    data = kernel_arguments(code, kernel, (7, 2, 1), [DeviceBuffer(16, 4), DeviceBuffer(32, 4),
                                                      2.5, 448])
    assert struct.unpack_from("<QQfi", data) == (16, 32, 2.5, 448)
    assert struct.unpack_from("<IIIHHHH", data, 24) == (7, 2, 1, 64, 1, 1, 0)
    assert struct.unpack_from("<H", data, 64) == (3,)
    assert data[72:80] == bytes(8)


def test_dispatch_packet_matches_hsa_h():
    program = Program(None, None, None, kernel_object=0xABC000, kernarg_size=32,
                      group_segment_size=1024, private_segment_size=16)
    image = dispatch_packet(program, choice.argmax(64), (5, 3, 1), 0x1000, 0x2000)
    packet = hsa.ffi.cast("hsa_kernel_dispatch_packet_t *", hsa.ffi.from_buffer(image))
    assert len(image) == 64
    assert packet.header == hsa.HSA_PACKET_TYPE_INVALID      # published last, on its own
    assert packet.setup == 3
    assert (packet.workgroup_size_x, packet.workgroup_size_y, packet.workgroup_size_z) == \
        (256, 1, 1)
    assert (packet.grid_size_x, packet.grid_size_y, packet.grid_size_z) == (5 * 256, 3, 1)
    assert (packet.group_segment_size, packet.private_segment_size) == (1024, 16)
    assert packet.kernel_object == 0xABC000
    assert int(hsa.ffi.cast("uintptr_t", packet.kernarg_address)) == 0x1000
    assert packet.completion_signal.handle == 0x2000


# On an AMD GPU.

@pytest.fixture(scope="module")
def device():
    try:
        return RocmDevice()
    except BackendUnavailable as e:
        pytest.skip(str(e))


def test_device_opens_with_its_agent(device):
    assert device.backend == "rocm" and "rocm:0" in device.name
    assert device.isa.startswith("amdgcn-amd-amdhsa--gfx")
    assert device.subgroup_size in (32, 64)
    free, total = device.memory()
    assert 0 < free <= total
    buffer = device.alloc(1 << 20)
    if device.memory_source != "HSA_AMD_AGENT_INFO_MEMORY_AVAIL":
        assert device.memory()[0] == free - (1 << 20)
    device.free(buffer)


def test_write_copy_read_in_order(device):
    data = np.random.default_rng().integers(0, 2**32, 1 << 18, dtype=np.uint32)
    a, b = device.alloc(data.nbytes), device.alloc(data.nbytes)
    device.write(a, data)
    device.copy(b, a, data.nbytes)
    device.write(a, np.zeros_like(data))
    assert np.array_equal(np.frombuffer(device.read(b), np.uint32), data)
    assert not np.frombuffer(device.read(a), np.uint32).any()
    assert np.frombuffer(device.read(b, 8, offset=16), np.uint32).tolist() == data[4:6].tolist()
    device.free(a)
    device.free(b)


def test_launches_run_in_order_and_a_capture_replays(device):
    kernel, n = scale_kernel(), 1000
    program = device.program(kernel)
    x = np.random.default_rng().standard_normal(n).astype(np.float32)
    bx, by = device.alloc(x.nbytes), device.alloc(x.nbytes)
    device.write(bx, x)
    grid = (-(-n // 64),)
    device.launch(program, kernel, grid, [bx, by, 2.0, n])
    device.launch(program, kernel, grid, [by, bx, 3.0, n])      # reads what the first wrote
    assert np.array_equal(np.frombuffer(device.read(bx), np.float32), x * 6)
    recording = device.capture(lambda: device.launch(program, kernel, grid, [bx, by, 0.5, n]))
    for _ in range(3):
        device.write(bx, x)
        device.replay(recording)
    device.synchronize()
    assert np.array_equal(np.frombuffer(device.read(by), np.float32), x * 0.5)
    device.free(bx)
    device.free(by)


def test_device_timing(device):
    kernel = scale_kernel()
    program = device.program(kernel)
    buf = device.alloc(4096)
    device.start_timing()
    for _ in range(3):
        device.launch(program, kernel, (16,), [buf, buf, 1.0, 1024])
    times = device.stop_timing()
    assert [name for name, _ in times] == ["scale"] * 3
    assert all(0 < seconds < 1 for _, seconds in times)
    device.free(buf)
